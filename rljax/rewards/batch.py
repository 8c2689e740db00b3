"""`score_batch`: the trainer's entry point for host-side rewards.

Runs item rewards `(completion, meta) -> float` over a batch and returns float32 arrays.
- In process (`workers=0`, no pool): cheap checks, no start-up cost, no time limit.
- In a `RewardPool` of worker processes: each (completion, function) call runs under a
  per-call time limit; a call that overruns is abandoned (its worker is killed and
  replaced), reported as a `RewardTimeout` naming the batch and prompt index (and the
  prompt's file and line, from its metadata's `source`), and given `timeout_reward` --
  the run does not stall.
Either way, a reward function that raises, or returns something that is not a finite
number, raises `RewardError` naming the function, the prompt's `source` (file:line) when
its metadata has one, the batch/prompt index, and the function's own traceback.

Functions marked with `is_batch_reward = True` (e.g. a learned reward model scoring the
whole batch on device) are called once with the full lists, in process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import traceback
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rljax.rewards._pool import RewardPool
from rljax.rewards.compose import ItemReward, reward_name

log = logging.getLogger(__name__)


class RewardError(ValueError):
    """A reward function raised or returned a non-finite value; names index and function."""

    def __init__(self, message: str, *, index: int, fn: str):
        super().__init__(message)
        self.index, self.fn = index, fn


@dataclasses.dataclass(frozen=True)
class RewardTimeout:
    """One abandoned call: batch `index`, `prompt_index` (index // group_size), `fn` name,
    `source`: the prompt's "file:line" (its metadata's `source`), if it has one."""

    index: int
    prompt_index: int
    fn: str
    seconds: float
    source: str | None = None


@dataclasses.dataclass(frozen=True)
class BatchScores:
    """`rewards`: float32[B] weighted sum; `components`: name -> float32[B] per function;
    `timeouts`: the calls abandoned (their components hold `timeout_reward`)."""

    rewards: np.ndarray
    components: dict[str, np.ndarray]
    timeouts: tuple[RewardTimeout, ...] = ()


def source_of(meta: Any) -> str | None:
    """The prompt's "file:line" from its metadata (`source`), or None."""
    src = meta.get("source") if isinstance(meta, Mapping) else None
    return src if isinstance(src, str) and src else None


def _where(i: int, group_size: int, meta: Any = None) -> str:
    at = f"batch index {i} (prompt index {i // group_size})"
    src = source_of(meta)
    return f"the prompt at {src}, {at}" if src else at


def _finite(value: Any, i: int, name: str, group_size: int, meta: Any = None) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward function {name!r} returned {value!r} (not a number) at "
                          f"{_where(i, group_size, meta)}", index=i, fn=name) from e
    if not math.isfinite(v):
        raise RewardError(f"reward function {name!r} returned non-finite {v} at "
                          f"{_where(i, group_size, meta)}", index=i, fn=name)
    return v


def traceback_of(e: BaseException) -> str:
    """`e`'s traceback from the reward function's frame down (not this module's)."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))


def _call(fn, c, m, i, name, group_size) -> float:
    try:
        value = fn(c, m)
    except Exception as e:  # reported with the prompt, the function and its traceback
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e} at "
                          f"{_where(i, group_size, m)}\n{traceback_of(e)}", index=i, fn=name) from e
    return _finite(value, i, name, group_size, m)


def _names(fns: Sequence[Any]) -> list[str]:
    out: list[str] = []
    for f in fns:
        n = reward_name(f)
        k, base = 1, n
        while n in out:
            n, k = f"{base}_{k}", k + 1
        out.append(n)
    return out


def _validate(fns, completions, metadata, weights) -> tuple[list, list[float]]:
    fns = [fns] if callable(fns) else list(fns)
    if not fns or not all(callable(f) for f in fns):
        raise TypeError("score_batch: fns must be a callable or a non-empty list of callables")
    if len(completions) != len(metadata):
        raise ValueError(f"score_batch: {len(completions)} completions but {len(metadata)} "
                         "metadata entries; they must match one to one")
    for i, c in enumerate(completions):
        if not isinstance(c, str):
            raise TypeError(f"score_batch: completions[{i}] is {type(c).__name__}, not str")
    w = [1.0] * len(fns) if weights is None else [float(x) for x in weights]
    if len(w) != len(fns) or not all(math.isfinite(x) for x in w):
        raise ValueError(f"score_batch: weights must be {len(fns)} finite numbers, got {weights!r}")
    return fns, w


def score_batch(fns: Callable | Sequence[Callable], completions: Sequence[str],
                metadata: Sequence[Mapping[str, Any]], *, weights: Sequence[float] | None = None,
                group_size: int = 1, timeout_s: float | None = None, workers: int = 0,
                pool: RewardPool | None = None, timeout_reward: float | None = 0.0
                ) -> BatchScores:
    """Score `completions` with item rewards `fns`; rewards = sum_j weights[j] * fns[j].

    Args:
      group_size: completions per prompt, so errors can name the prompt (index // G).
      timeout_s: per-call limit; needs `pool` or `workers > 0` (an in-process call
        cannot be abandoned).
      workers: start a temporary pool of this many processes (start-up costs about a
        second; pass a long-lived `pool` in a training loop instead).
      timeout_reward: value given to an abandoned call, or None to raise RewardError.
    """
    fns, w = _validate(fns, completions, metadata, weights)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"score_batch: group_size must be an int >= 1, got {group_size!r}")
    if timeout_s is not None and not (timeout_s > 0):
        raise ValueError(f"score_batch: timeout_s must be > 0 or None, got {timeout_s!r}")
    if timeout_s is not None and pool is None and workers <= 0:
        raise ValueError("score_batch: timeout_s needs a worker pool (pass pool= or workers>0)")
    names = _names(fns)
    B = len(completions)
    comps = {n: np.zeros(B, np.float32) for n in names}
    item = [(f, n) for f, n in zip(fns, names) if not getattr(f, "is_batch_reward", False)]
    for f, n in zip(fns, names):
        if getattr(f, "is_batch_reward", False):
            comps[n][:] = _batch_call(f, n, completions, metadata, group_size)
    timeouts: list[RewardTimeout] = []
    if pool is None and workers <= 0:
        for f, n in item:
            comps[n][:] = [_call(f, c, m, i, n, group_size)
                           for i, (c, m) in enumerate(zip(completions, metadata))]
    else:
        own = pool is None
        pool = RewardPool(workers) if own else pool
        try:
            timeouts = _pooled(pool, item, completions, metadata, comps, group_size,
                               timeout_s, timeout_reward)
        finally:
            if own:
                pool.close()
    total = sum(wj * comps[n].astype(np.float64) for wj, n in zip(w, names))
    return BatchScores(np.asarray(total, np.float32), comps, tuple(timeouts))


def _batch_call(f, n, completions, metadata, group_size) -> np.ndarray:
    try:
        out = np.asarray(f(list(completions), list(metadata)), np.float64)
    except Exception as e:
        raise RewardError(f"batch reward function {n!r} raised {type(e).__name__}: {e}",
                          index=-1, fn=n) from e
    if out.shape != (len(completions),):
        raise RewardError(f"batch reward function {n!r} returned shape {out.shape}, "
                          f"expected ({len(completions)},)", index=-1, fn=n)
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        i = int(bad[0])
        raise RewardError(f"batch reward function {n!r} returned non-finite {out[i]} at "
                          f"{_where(i, group_size, metadata[i])}", index=i, fn=n)
    return out


def _pooled(pool, item, completions, metadata, comps, group_size, timeout_s,
            timeout_reward) -> list[RewardTimeout]:
    tasks, where = [], []
    for f, n in item:
        for i, (c, m) in enumerate(zip(completions, metadata)):
            tasks.append((f, c, m))
            where.append((i, n))
    timeouts = []
    for (i, n), res in zip(where, pool.run(tasks, timeout_s)):
        m = metadata[i]
        if res[0] == "ok":
            comps[n][i] = _finite(res[1], i, n, group_size, m)
        elif res[0] == "error":
            raise RewardError(f"reward function {n!r} raised {res[1]} at "
                              f"{_where(i, group_size, m)}\n{res[2]}", index=i, fn=n)
        else:
            if timeout_reward is None:
                raise RewardError(f"reward function {n!r} exceeded {timeout_s}s at "
                                  f"{_where(i, group_size, m)}", index=i, fn=n)
            log.warning("reward function %r abandoned after %.1f s (time limit %g s) at %s; "
                        "it scores %g", n, res[1], timeout_s, _where(i, group_size, m),
                        timeout_reward)
            timeouts.append(RewardTimeout(i, i // group_size, n, float(res[1]), source_of(m)))
            comps[n][i] = timeout_reward
    return timeouts


@dataclasses.dataclass(frozen=True)
class Batched:
    """An item reward lifted to the batch `RewardFn` protocol (in-process, sequential)."""

    fn: Any

    @property
    def name(self) -> str:
        return reward_name(self.fn)

    def __call__(self, completions: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        return score_batch([self.fn], completions, metadata).rewards


def batched(fn: ItemReward) -> Batched:
    """Lift an item reward `(completion, meta) -> float` to a batch `RewardFn`."""
    return Batched(fn)
