"""Prompt difficulty tracking: recent pass rates and the chance of a mixed group.

With GRPO a group of G completions gives a learning signal only if its rewards differ.
For a prompt solved with probability p, the chance of a mixed group is

    P(mixed) = 1 - p^G - (1 - p)^G

(the seed text: groups of 8 give signal with chance 0 at p = 0, 0.99 at p = 0.5 and 0.34
at p = 0.95: "learning concentrates on prompts at the edge of the model's ability").
`DifficultyTracker` keeps an exponential moving average of each prompt's pass rate and,
optionally, skips prompts whose predicted P(mixed) is below a threshold -- but lets a
skipped prompt through again after `max_skips` consecutive skips, so a prompt whose
estimate is stale is re-measured rather than excluded forever.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Sequence

import numpy as np


def mixed_group_prob(p: float | np.ndarray, group_size: int) -> float | np.ndarray:
    """1 - p^G - (1-p)^G: the chance that G Bernoulli(p) rewards are not all equal."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    p = np.asarray(p, np.float64)
    if np.any((p < 0) | (p > 1)):
        raise ValueError("pass rate p must lie in [0, 1]")
    out = 1.0 - p ** group_size - (1.0 - p) ** group_size
    return float(out) if out.ndim == 0 else out


@dataclasses.dataclass
class _Entry:
    rate: float
    count: int = 0
    skips: int = 0


@dataclasses.dataclass
class DifficultyTracker:
    """Per-prompt pass-rate EMA and optional skipping of no-signal prompts.

    Attributes:
      group_size: G, completions per prompt.
      ema: weight of the newest group's pass fraction (1.0 = only the last group).
      min_mixed_prob: skip a prompt when its predicted P(mixed) is below this (0 = never).
      min_observations: groups seen before a prompt may be skipped.
      max_skips: consecutive skips after which a prompt is let through to be re-measured.
      success_threshold: a reward >= this counts as a pass.
    """

    group_size: int
    ema: float = 0.5
    min_mixed_prob: float = 0.0
    min_observations: int = 1
    max_skips: int = 8
    success_threshold: float = 0.5
    _entries: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"DifficultyTracker.group_size must be an int >= 1, "
                             f"got {self.group_size!r}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"DifficultyTracker.ema must be in (0, 1], got {self.ema!r}")
        if not 0.0 <= self.min_mixed_prob <= 1.0:
            raise ValueError(f"DifficultyTracker.min_mixed_prob must be in [0, 1], "
                             f"got {self.min_mixed_prob!r}")
        for f in ("min_observations", "max_skips"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 0:
                raise ValueError(f"DifficultyTracker.{f} must be an int >= 0")

    def update(self, prompt_id: Hashable, rewards_G: Sequence[float] | np.ndarray) -> float:
        """Record one group's rewards for `prompt_id`; returns the new pass-rate estimate.
        The first group sets the rate; later ones move it by `ema`."""
        r = np.asarray(rewards_G, np.float64).reshape(-1)
        if r.size == 0 or not np.all(np.isfinite(r)):
            raise ValueError(f"DifficultyTracker.update: rewards for {prompt_id!r} must be a "
                             f"non-empty finite array, got {rewards_G!r}")
        frac = float(np.mean(r >= self.success_threshold))
        e = self._entries.get(prompt_id)
        if e is None:
            e = self._entries[prompt_id] = _Entry(frac)
        else:
            e.rate = (1.0 - self.ema) * e.rate + self.ema * frac
        e.count, e.skips = e.count + 1, 0
        return e.rate

    def update_batch(self, prompt_ids: Sequence[Hashable], rewards_B: np.ndarray) -> None:
        """`rewards_B` holds `len(prompt_ids)` consecutive groups of `group_size`."""
        r = np.asarray(rewards_B, np.float64).reshape(-1)
        if r.size != len(prompt_ids) * self.group_size:
            raise ValueError(f"update_batch: {r.size} rewards for {len(prompt_ids)} prompts x "
                             f"group_size {self.group_size}")
        for k, pid in enumerate(prompt_ids):
            self.update(pid, r[k * self.group_size:(k + 1) * self.group_size])

    def pass_rate(self, prompt_id: Hashable) -> float | None:
        """The pass-rate estimate, or None for a prompt never seen."""
        e = self._entries.get(prompt_id)
        return None if e is None else e.rate

    def mixed_prob(self, prompt_id: Hashable) -> float | None:
        """Predicted chance that the next group of this prompt is mixed (None if unseen)."""
        p = self.pass_rate(prompt_id)
        return None if p is None else mixed_group_prob(p, self.group_size)

    def should_skip(self, prompt_id: Hashable) -> bool:
        """Whether to skip the prompt now (counts the skip; see `max_skips`)."""
        e = self._entries.get(prompt_id)
        if e is None or self.min_mixed_prob <= 0 or e.count < self.min_observations:
            return False
        if mixed_group_prob(e.rate, self.group_size) >= self.min_mixed_prob:
            return False
        if e.skips >= self.max_skips:
            e.skips = 0
            return False
        e.skips += 1
        return True

    def select(self, prompt_ids: Sequence[Hashable]) -> tuple[list[Hashable], list[Hashable]]:
        """Split `prompt_ids` into (kept, skipped)."""
        kept, skipped = [], []
        for pid in prompt_ids:
            (skipped if self.should_skip(pid) else kept).append(pid)
        return kept, skipped

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able snapshot of the per-prompt estimates (ids become strings)."""
        return {str(k): [e.rate, e.count, e.skips] for k, e in self._entries.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (prompt ids as the strings it stored)."""
        self._entries = {k: _Entry(float(v[0]), int(v[1]), int(v[2])) for k, v in state.items()}
