"""Layers with stacked parameters: built with `nnx.vmap`, applied with `jax.lax.scan`.

A scanned decoder (`ModelConfig.scan_layers=True`) holds one `Block` whose parameters
carry a leading layer axis `[L, ...]` (logical name "layers", never sharded), so the
forward is one loop body in the compiled program: compile time stays flat as layers are
added, where a Python loop over layers traces and compiles every layer again.

Rematerialisation (`ModelConfig.remat`) wraps the loop body in `jax.checkpoint`: "full"
keeps only each layer's input for the backward pass; "dots_saveable" also keeps matmul
outputs (`jax.checkpoint_policies.dots_saveable`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.config import REMAT_POLICIES

LAYER_AXIS = "layers"


def remat_policy(name: str) -> Callable | None:
    """The `jax.checkpoint` policy of a `ModelConfig.remat` name ("full": save nothing)."""
    if name not in REMAT_POLICIES or name == "none":
        raise ValueError(f"remat_policy: {name!r}; allowed: {REMAT_POLICIES[1:]}")
    return jax.checkpoint_policies.dots_saveable if name == "dots_saveable" else None


def effective_remat(config_remat: str, remat_flag: bool) -> str:
    """The remat used by a forward: the config's, or "full" when only the call asks for it
    (the trainers' `remat=True`, which predates `ModelConfig.remat`)."""
    return "full" if config_remat == "none" and remat_flag else config_remat


def stacked(factory: Callable[..., nnx.Module], num_layers: int,
            *rngs: nnx.Rngs) -> nnx.Module:
    """`factory(*rngs)` built `num_layers` times under `nnx.vmap`, parameters `[L, ...]`.

    Each layer draws from its own split of each `rngs` (`nnx.split_rngs`; e.g. the
    model's stream and its adapters' stream, `rljax.models.lora`). Every variable's
    `logical_axes` metadata gets `"layers"` in front, so `rljax.sharding` places the
    stacked arrays with the layer axis replicated.
    """

    make = nnx.vmap(factory, in_axes=(0,) * len(rngs), out_axes=0)
    module = nnx.split_rngs(splits=num_layers)(make)(*rngs)
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable):
            names = var.get_metadata("logical_axes", None)
            if names is not None:
                var.set_metadata("logical_axes", (LAYER_AXIS, *names))
    return module


def scan_apply(layers: nnx.Module, body: Callable, carry, remat: str = "none", xs=None):
    """``carry, y = body(layer_i, carry, x_i)`` for each layer slice i of stacked
    `layers`, as one `jax.lax.scan` over the split state and ``xs`` (a pytree of
    ``[L, ...]`` arrays, or None); returns ``(carry, ys)`` with ``ys`` stacked ``[L, ...]``.
    `remat` ("none" | "full" | "dots_saveable") wraps `body` in `jax.checkpoint`.

    `jax.lax.scan` over `nnx.split` state rather than `nnx.scan`: the sampler and the
    trainer call the model inside JAX loops (`lax.while_loop`, `lax.scan`) on a model
    merged outside them, and `nnx.scan` refuses variables from an outer trace level.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"scan_apply: remat={remat!r}; allowed: {REMAT_POLICIES}")
    graphdef, state = nnx.split(layers)

    def step(c, layer_state, x):
        return body(nnx.merge(graphdef, layer_state), c, x)

    if remat != "none":
        step = jax.checkpoint(step, policy=remat_policy(remat))
    return jax.lax.scan(lambda c, sx: step(c, *sx), carry, (state, xs))


def scan_apply_indexed(layers: nnx.Module, body: Callable, carry, num_layers: int):
    """Like `scan_apply` (no remat, no xs), but ``carry, y = body(layer_i, i, carry)`` also
    gets the layer index (an int32 scalar), to read and write per-layer slices of arrays
    in the carry; returns ``(carry, ys)``."""
    graphdef, state = nnx.split(layers)

    def step(c, xs):
        layer_state, i = xs
        return body(nnx.merge(graphdef, layer_state), i, c)

    return jax.lax.scan(step, carry, (state, jnp.arange(num_layers, dtype=jnp.int32)))
