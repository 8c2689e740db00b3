"""The episode source: multi-turn episodes with an environment per row
(``rljax.train.multiturn.MultiTurnRollouts``), the episode returns as the rewards and
the environments' observations in the completion with loss mask 0."""

from __future__ import annotations

import time

import jax

from rljax.train.batch import Rollout
from rljax.train.multiturn import MultiTurnRollouts
from rljax.train.sources import Collected, Window

__all__ = ["Episodes"]


class Episodes:
    """``MultiTurnRollouts`` as a rollout source. ``step_metrics`` are the episode
    metrics (``env/...``) of the rounds sampled since the last call, averaged over rounds
    (each round holds equally many episodes)."""

    on_device = False

    def __init__(self, rollouts: MultiTurnRollouts):
        self.rollouts = rollouts
        self.group_size, self.pad_id = rollouts.group_size, rollouts.pad_id
        self._rounds: list[dict] = []

    def sample_round(self, params, window: Window, key, ph) -> Rollout:
        """Episodes of ``window``'s prompts (this process drives its own rows' environments)."""
        t0 = time.perf_counter()
        out = self.rollouts.sample(params, window.prompts, window.pos, window.n, key)
        jax.block_until_ready(out.rollout)
        ph.times["rollout"] = ph.times.get("rollout", 0.0) + time.perf_counter() - t0
        self._rounds.append(dict(out.metrics))
        return out.rollout

    def step_metrics(self) -> dict:
        rounds, self._rounds = self._rounds, []
        names = sorted({k for r in rounds for k in r})
        return {k: sum(r.get(k, 0.0) for r in rounds) / len(rounds) for k in names}

    def collect(self, params, window: Window, key, ph) -> Collected:
        """One round of episodes of ``window`` (the key used as it is)."""
        ro = self.sample_round(params, window, key, ph)
        return Collected(ro, window.pos + window.n, self.step_metrics())

    def eval_batch(self, params, prompts: list, metadata: list, first: int) -> dict:
        """Greedy episodes, one per held-out prompt: sums of the episode return
        (``reward``) and of the episode metrics (``env/...``) over every process's rows."""
        k = len(prompts)

        def src(start, m):
            return list(prompts[start - first:start - first + m]), \
                list(metadata[start - first:start - first + m])

        out = self.rollouts.sample(params, src, first, k, jax.random.key(0), greedy=True,
                                   group_size=1)
        sums = {name: v * k for name, v in out.metrics.items() if name != "env/rollout_turns"}
        sums["reward"] = out.metrics.get("env/return", 0.0) * k
        return sums
