"""DAPO's dynamic sampling as a source: rounds of any host source (single-turn rewards or
multi-turn episodes) until the batch holds ``n`` groups whose rewards differ
(``AlgorithmConfig.dynamic_sampling``).

Each round samples ``n`` further prompts (the inner source's ``sample_round``); one transfer per round
brings the kept-group count and the round's token counts to every host, so every process
takes the same decision. The batch is then assembled in one program: groups whose outcomes
differ first (in sampling order), zero-variance groups as padding with weight 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rljax.train import hosts
from rljax.train.batch import Rollout, widen_prompts, zero_variance_groups
from rljax.train.sources import Collected, Window

__all__ = ["Refill"]


@functools.partial(jax.jit, static_argnums=(1,))
def _round_counts(ro: Rollout, group_size: int):
    """A round's host numbers: kept groups (verifier outcomes differ), and the completion
    and prompt tokens it sampled (for the step's FLOPs and token rates)."""
    kept = jnp.sum(~zero_variance_groups(ro.rewards_B, group_size)).astype(jnp.int32)
    return kept, jnp.sum(ro.completion_mask_BxT), jnp.sum(ro.prompt_mask_BxP)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _assemble(rounds: tuple, n_groups: int, pad_id: int) -> Rollout:
    """The batch from its sampling rounds: kept groups first, then zero-variance groups
    with weight 0; prompts left-padded to the widest round's bucket."""
    g = rounds[0].group_size
    width = max(r.prompt_BxP.shape[1] for r in rounds)
    cat = jax.tree.map(lambda *xs: jnp.concatenate(xs),
                       *[widen_prompts(r, width, pad_id) for r in rounds])
    zv_G = zero_variance_groups(cat.rewards_B, g)
    take_N = jnp.argsort(zv_G, stable=True)[:n_groups]
    rows = (take_N[:, None] * g + jnp.arange(g)[None]).reshape(-1)
    out = jax.tree.map(lambda x: x[rows], cat)
    weight_B = jnp.repeat(jnp.where(zv_G[take_N], 0.0, 1.0), g)
    return dataclasses.replace(out, weight_B=weight_B)


class Refill:
    """DAPO's refill rounds around a host source ``inner`` (one with ``sample_round(params,
    window, key, ph) -> Rollout``, ``step_metrics()`` and ``pad_id``, which pads narrower
    rounds' prompts): at most ``max_refill_rounds`` rounds after the first. Its held-out
    evaluation is the inner source's."""

    on_device = False
    samples_after_dispatch = True  # later rounds: rljax.train.async_driver copies the weights

    def __init__(self, inner, *, max_refill_rounds: int):
        if getattr(inner, "on_device", False):
            raise ValueError("dynamic sampling decides its refills on the host; it needs a "
                             "host source (a host reward or environment episodes), not a "
                             "device reward")
        self.inner, self.max_refill_rounds = inner, max_refill_rounds
        self.group_size, self.pad_id = inner.group_size, inner.pad_id

    def collect(self, params, window: Window, key, ph, dispatched=None) -> Collected:
        """Rounds of ``window``-sized prompt blocks from ``window.pos`` until
        ``window.n`` groups are kept or the refills run out: the batch, the position
        after the last round, the round metrics and the inner source's; the key is
        split before each round, as a single round splits it. ``dispatched`` goes to
        the first round."""
        n, rounds, kept, sampled = window.n, [], [], np.zeros(2)
        while True:
            key, k = jax.random.split(key)
            ro = self.inner.sample_round(params, window, k, ph, dispatched)
            dispatched = None
            window = window.next()
            rounds.append(ro)
            k, *tokens = hosts.fetch_scalars(_round_counts(ro, ro.group_size))
            kept.append(int(k))
            sampled += tokens
            if sum(kept) >= n or len(rounds) > self.max_refill_rounds:
                break
        return Collected(_assemble(tuple(rounds), n, self.pad_id), window.pos, {
            **self.inner.step_metrics(),
            "zero_var_frac": 1.0 - kept[0] / n,
            "dyn_refill_rounds": float(len(rounds) - 1),
            "dyn_dropped_groups": float(len(rounds) * n - sum(kept)),
            "dyn_short_groups": float(max(0, n - sum(kept))),
            "dyn_sampled_tokens": float(sampled[0]),
            "dyn_sampled_prompt_tokens": float(sampled[1])})

    def eval_batch(self, params, prompts: list, metadata: list, first: int) -> dict:
        return self.inner.eval_batch(params, prompts, metadata, first)
