"""The device reward's programs: the RL step as one compiled program when the reward is
a JAX function of token ids, and the held-out evaluation's scores.

With a device reward (``rljax.rewards.device``) nothing in a step needs the host between
the prompts and the metrics, so sample -> score -> learn is one ``jax.jit``:

  prompt ids + task arrays (host, packed) -> sampler (``sample_arrays``) -> device reward
  -> ``Rollout`` -> the learning program (``rljax.train.learn``) -> state, metrics.

The key flow is the host step's (``rljax.train.driver.rl_step``), so a run with a device reward draws
the same samples and makes the same updates as one with the equivalent host reward.
Being a pure function of its arguments, the program also ``jax.vmap``s over a leading
seed axis (``rljax.train.seeds``). Used by the device source
(``rljax.train.sources.device``) and ``rljax.train.programs.step``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rljax.sampling.sampler import DecodeSpec, sample_arrays
from rljax.train.batch import Rollout, to_rollout

Array = Any
__all__ = ["device_rollout", "device_scores", "seeds_evaluate", "split_step_key"]


def split_step_key(key_data) -> tuple[Array, Array, Array]:
    """Raw key data -> (next state's key data, rollout key, learning key), as every RL
    step splits its key."""
    nxt, k_roll, k_learn = jax.random.split(jax.random.wrap_key_data(key_data), 3)
    return jax.random.key_data(nxt), k_roll, k_learn


def device_rollout(graphdef, params, prompts: tuple, task: dict, key, *, spec: DecodeSpec,
                   reward: Callable, mesh=None) -> Rollout:
    """Sample ``spec.num_samples`` completions of each packed prompt (``prompts`` =
    ``(tokens_BxP, mask_BxP, positions_BxP)``) and score them with the device ``reward``
    (``task``: per-prompt arrays, repeated here to one row per completion)."""
    g = spec.num_samples
    # The host step splits its rollout key once more before each sampling round.
    _, k = jax.random.split(key)
    out = sample_arrays(graphdef, params, *prompts, spec, k, mesh)
    task_R = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0), task)
    rewards_R = reward(out.tokens, out.completion_mask.astype(jnp.float32), task_R)
    rewards_R = rewards_R.astype(jnp.float32)
    verifier = bool(getattr(reward, "verifier", False))
    correct_R = (rewards_R > 0).astype(jnp.float32) if verifier else jnp.zeros_like(rewards_R)
    fields = to_rollout(out.prompt_tokens, out.prompt_mask, out.tokens, out.completion_mask,
                        out.sampling_logprobs, out.truncated, rewards_R, correct_R,
                        jnp.ones_like(rewards_R))
    return Rollout(*fields, expert_ids_BxLxSxK=out.expert_ids, group_size=g,
                   has_correct=verifier)


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
