"""The episode source: multi-turn episodes with an environment per row
(``rljax.train.multiturn.MultiTurnRollouts``), the episode returns as the rewards and
the environments' observations in the completion with loss mask 0."""

from __future__ import annotations

import time
from typing import Callable

import jax

from rljax.train import hosts
from rljax.train.batch import Rollout
from rljax.train.multiturn import MultiTurnRollouts
from rljax.train.sources import Collected, Window
from rljax.train.sources.prompts import sum_rows

__all__ = ["Episodes"]


class Episodes:
    """``MultiTurnRollouts`` as a rollout source. ``step_metrics`` are the episode
    metrics (``env/...``) of the rounds sampled since the last call, averaged over rounds
    (each round holds equally many episodes)."""

    on_device = False
    samples_after_dispatch = True  # later turns: rljax.train.async_driver copies the weights

    def __init__(self, rollouts: MultiTurnRollouts):
        self.rollouts = rollouts
        self.group_size, self.pad_id = rollouts.group_size, rollouts.pad_id
        self._rounds: list[dict] = []

    def sample_round(self, params, window: Window, key, ph,
                     dispatched: Callable | None = None) -> Rollout:
        """Episodes of ``window``'s prompts (this process drives its own rows'
        environments); ``dispatched()`` runs once the first turn is dispatched."""
        t0 = time.perf_counter()
        out = self.rollouts.sample(params, window.prompts, window.pos, window.n, key,
                                   dispatched=dispatched)
        jax.block_until_ready(out.rollout)
        ph.add("rollout", time.perf_counter() - t0)
        self._rounds.append(dict(out.metrics))
        return out.rollout

    def step_metrics(self) -> dict:
        rounds, self._rounds = self._rounds, []
        names = sorted({k for r in rounds for k in r})
        return {k: sum(r.get(k, 0.0) for r in rounds) / len(rounds) for k in names}

    def collect(self, params, window: Window, key, ph,
                dispatched: Callable | None = None) -> Collected:
        """One round of episodes of ``window`` (the key used as it is)."""
        ro = self.sample_round(params, window, key, ph, dispatched)
        return Collected(ro, window.pos + window.n, self.step_metrics())

    def _episodes(self, params, prompts: list, metadata: list, first: int, key, *,
                  greedy: bool, group_size: int):
        """Episodes of held-out ``prompts`` (the batch at offset ``first``)."""
        def source(start, m):
            i = start - first
            return list(prompts[i:i + m]), list(metadata[i:i + m])

        return self.rollouts.sample(params, source, first, len(prompts), key, greedy=greedy,
                                    group_size=group_size)

    def eval_batch(self, params, prompts: list, metadata: list, first: int) -> dict:
        """Greedy episodes, one per held-out prompt: sums of the episode return
        (``reward``) and of the episode metrics (``env/...``) over every process's rows."""
        k = len(prompts)
        out = self._episodes(params, prompts, metadata, first, jax.random.key(0), greedy=True,
                             group_size=1)
        sums = {name: v * k for name, v in out.metrics.items() if name != "env/rollout_turns"}
        sums["reward"] = out.metrics.get("env/return", 0.0) * k
        return sums

    def eval_samples(self, params, prompts: list, metadata: list, first: int, k: int,
                     key) -> dict:
        """``k`` episodes of each held-out prompt at the sampling temperature: sums over
        every process's prompts of ``"sample_reward_mean"`` (the prompt's mean return) and
        ``"best@k_reward_mean"`` (its best)."""
        out = self._episodes(params, prompts, metadata, first, key, greedy=False, group_size=k)
        r_Nxk = hosts.host_rows(out.rollout.rewards_B, out.lo, out.hi).reshape(-1, k)
        return sum_rows({"sample_reward_mean": float(r_Nxk.mean(axis=1).sum()),
                         f"best@{k}_reward_mean": float(r_Nxk.max(axis=1).sum())})
