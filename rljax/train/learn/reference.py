"""The frozen KL reference: a copy of the policy's parameters, float32 or bfloat16.

With ``RLConfig.ref_dtype="bfloat16"`` every floating leaf of the copy is rounded to
bfloat16 once, when the state is made, and stays bfloat16: in the ``TrainState``, in
checkpoints (saved and restored as bfloat16, so a resumed run is bit-identical) and as an
argument of the learning program. That halves the reference's memory (an 8B model: 16 GB
instead of 32 GB across the slice). Each leaf keeps the policy's sharding.

The reference forward is the policy's program on these weights: matmuls take the model's
``compute_dtype`` (bfloat16 on accelerators; with "float32" each bfloat16 weight is
widened inside its matmul, never stored wide), norms, logits, log-softmax and the
returned log-probs are float32 (``rljax.train.learn.logprobs``). Rounding to bfloat16 moves
each weight by at most 2^-9 of its magnitude (8 significand bits, round to nearest).

A policy with LoRA adapters has no copy: its reference is its own base, the adapters
switched off inside the program (``reference_model``), and the base is stored in the
compute dtype (``lora_base``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.layers import cast_matmul_weights, compute_dtype
from rljax.models.lora import has_adapters, set_adapters

__all__ = ["lora_base", "reference_copy", "reference_model"]


@functools.partial(jax.jit, static_argnums=(1,))
def _cast_tree(tree: Any, dtype: str) -> Any:
    """Fresh buffers for every leaf, floating leaves as ``dtype`` (one program)."""
    def one(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        # An explicit copy: jit may hand back an unchanged input as its output, and the
        # policy's buffers are donated by the updates.
        return jnp.copy(x)

    return jax.tree.map(one, tree)


def reference_copy(params: Any, dtype: str = "float32") -> Any:
    """A frozen copy of ``params`` with floating leaves stored as ``dtype``.

    Args:
      params: the policy's parameters (an NNX state of global arrays).
      dtype: "float32" (an exact copy) or "bfloat16" (half the bytes).

    Returns:
      New arrays (never aliases of ``params``: the policy's are donated by updates), each
      with the sharding of the leaf it copies.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"reference_copy: dtype={dtype!r}; allowed: 'float32', 'bfloat16'")
    # An elementwise cast: each output keeps its input's sharding (and, on one device, its
    # committedness, which the learning program's compile cache sees).
    return _cast_tree(params, dtype)


def reference_model(policy_gd, policy_params, ref_params) -> tuple[Any, Any]:
    """``(graphdef, params)`` of the KL reference inside a program: ``ref_params`` under
    the policy's graphdef, or, when there is no copy (a policy with LoRA adapters), the
    policy's own weights with its adapters switched off (``rljax.models.lora.set_adapters``):
    the frozen base, read in place, never copied."""
    if ref_params is not None:
        return policy_gd, ref_params
    if not has_adapters(policy_params):
        raise ValueError("reference_model: no reference parameters, and the policy has no "
                         "adapters to switch off")
    return nnx.split(set_adapters(nnx.merge(policy_gd, policy_params), False))


def lora_base(policy_gd, policy_params) -> Any:
    """A LoRA policy's state with its frozen base's matmul weights stored in the compute
    dtype (``rljax.models.layers.cast_matmul_weights``: every forward casts them to it
    anyway, so it computes the same, from half the bytes under bfloat16); adapters stay
    float32. A policy without adapters is returned as it is."""
    if not has_adapters(policy_params):
        return policy_params
    config = nnx.merge(policy_gd, policy_params).config
    return cast_matmul_weights(policy_params, compute_dtype(config))
