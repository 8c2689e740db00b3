"""Adapters on a loaded model: drawing them for a checkpoint's base, and their arrays.

`from_pretrained(..., lora=...)` reads the base weights from a Hugging Face folder and
draws the adapters here (`init_adapters`): one jitted program returns only the
`nnx.LoRAParam` leaves of a `Decoder` built from a key, so XLA drops the base weights'
draws and the adapters equal those of a random-init model of the same key.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from rljax.models.config import ModelConfig
from rljax.models.decoder import Decoder
from rljax.sharding import mesh_context, state_shardings

__all__ = ["init_adapters"]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draw_adapters(config: ModelConfig, mesh: Mesh | None, key: jax.Array):
    """The adapters of ``Decoder(config, rngs=nnx.Rngs(key))`` placed per the logical rules
    on ``mesh``: one program per (config, mesh), keyed by JAX's cache."""
    adapters = nnx.state(Decoder(config, rngs=nnx.Rngs(key)), nnx.LoRAParam)
    if mesh is None:
        return adapters
    return jax.lax.with_sharding_constraint(adapters, state_shardings(adapters, mesh))


def init_adapters(config: ModelConfig, key: jax.Array, mesh: Mesh | None = None):
    """The `nnx.LoRAParam` state of ``Decoder(config, rngs=nnx.Rngs(key))`` (``config.lora``
    set), placed per the logical rules on ``mesh``; the base is never materialised."""
    if config.lora is None:
        raise ValueError("init_adapters: config.lora is None (no adapters to draw)")
    with mesh_context(mesh):
        return _draw_adapters(config, mesh, key)
