"""A deterministic shuffled iterator whose position can be saved and restored.

Epoch e visits the source in the order `permutation(seed, e)`, drawn from
`numpy.random.default_rng([seed, e])`, so any position (seed, epoch, offset) is
reproducible from three integers: saving a run's data position is saving `state()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class IteratorState:
    """Where a `ShuffledIterator` is: `epoch`, `position` within it, plus the `seed`,
    `size` of the source and `shuffle` flag it must be restored onto."""

    seed: int
    epoch: int = 0
    position: int = 0
    size: int = 0
    shuffle: bool = True

    def to_dict(self) -> dict[str, int]:
        """Plain ints, for checkpoints (orbax/JSON)."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "size": self.size, "shuffle": int(self.shuffle)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "IteratorState":
        """Inverse of `to_dict`; names any missing key."""
        missing = [k for k in ("seed", "epoch", "position", "size") if k not in d]
        if missing:
            raise ValueError(f"IteratorState.from_dict: missing keys {missing}")
        return cls(int(d["seed"]), int(d["epoch"]), int(d["position"]), int(d["size"]),
                   bool(int(d.get("shuffle", 1))))


class ShuffledIterator:
    """Endless iterator over `source` (anything with `len` and `[i]`), one permutation
    per epoch. `next_batch(n)` crosses epoch boundaries; `state()` / `restore()` resume
    exactly."""

    def __init__(self, source: Sequence[Any], *, seed: int, shuffle: bool = True):
        if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
            raise TypeError(f"ShuffledIterator: source must support len() and [i], got "
                            f"{type(source).__name__}")
        if len(source) == 0:
            raise ValueError("ShuffledIterator: source is empty")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"ShuffledIterator: seed must be an int >= 0, got {seed!r}")
        self.source, self.seed, self.shuffle = source, int(seed), shuffle
        self._epoch, self._pos = 0, 0
        self._perm = self.permutation(0)

    @property
    def epoch(self) -> int:
        """The current epoch (0-based)."""
        return self._epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """The visiting order of `epoch`: a pure function of (seed, epoch, len)."""
        n = len(self.source)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_indices(self, n: int) -> list[int]:
        """The next `n` source indices."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"next_indices: n must be an int >= 0, got {n!r}")
        out = []
        while len(out) < n:
            if self._pos == len(self._perm):
                self._epoch, self._pos = self._epoch + 1, 0
                self._perm = self.permutation(self._epoch)
            take = min(n - len(out), len(self._perm) - self._pos)
            out.extend(int(i) for i in self._perm[self._pos:self._pos + take])
            self._pos += take
        return out

    def next_batch(self, n: int) -> list[Any]:
        """The next `n` items."""
        return [self.source[i] for i in self.next_indices(n)]

    def __iter__(self) -> "ShuffledIterator":
        return self

    def __next__(self) -> Any:
        return self.next_batch(1)[0]

    def state(self) -> IteratorState:
        """The current position (a small frozen dataclass; `.to_dict()` for checkpoints)."""
        return IteratorState(self.seed, self._epoch, self._pos, len(self.source), self.shuffle)

    def restore(self, state: IteratorState | dict[str, Any]) -> None:
        """Continue from `state`; the source must have the size the state was saved with."""
        if isinstance(state, dict):
            state = IteratorState.from_dict(state)
        n = len(self.source)
        if state.size != n:
            raise ValueError(f"ShuffledIterator.restore: state was saved for a source of "
                             f"{state.size} items, this source has {n}")
        if not 0 <= state.position <= n or state.epoch < 0:
            raise ValueError(f"ShuffledIterator.restore: invalid position {state}")
        self.seed, self.shuffle = state.seed, state.shuffle
        self._epoch, self._pos = state.epoch, state.position
        self._perm = self.permutation(self._epoch)
