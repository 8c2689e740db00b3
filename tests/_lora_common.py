"""Shared by the LoRA tests (tests/test_lora.py, tests/test_lora_seeds.py)."""

import jax
from flax import nnx

from rljax.models.lora import LoraConfig

LORA = LoraConfig(rank=4, alpha=8.0)


def randomise_adapters(state, seed: int = 1, scale: float = 0.3):
    """Every adapter leaf (A and B) drawn N(0, scale^2): nonzero, so a gradient test of
    A could fail (with B = 0, dL/dA is identically 0)."""
    keys = iter(jax.random.split(jax.random.key(seed), 1000))

    def one(v):
        if isinstance(v, nnx.LoRAParam):
            return v.replace(scale * jax.random.normal(next(keys), v.get_value().shape))
        return v

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
