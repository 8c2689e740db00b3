"""The held-out evaluation's programs with a device reward (``Rollouts.evaluate``): the
reward on the sampler's output, and each seed's greedy completions sampled and scored in
one program vmapped over a leading seed axis."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rljax.sampling.sampler import sample_arrays

__all__ = ["device_scores", "seeds_evaluate"]


@functools.partial(jax.jit, static_argnums=0)
def device_scores(reward, out, task: dict):
    """A device reward on the sampler's output (all rows, one per prompt)."""
    return reward(out.tokens, out.completion_mask.astype(jnp.float32), task)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def seeds_evaluate(graphdef, reward, decode_spec, params, tok, mask, pos, task):
    """Each seed's device-reward scores of its greedy completions (leading seed axis)."""
    def one(params, tok, mask, pos, task):
        out = sample_arrays(graphdef, params, tok, mask, pos, decode_spec, jax.random.key(0))
        return reward(out.tokens, out.completion_mask.astype(jnp.float32), task)

    return jax.vmap(one)(params, tok, mask, pos, task)
