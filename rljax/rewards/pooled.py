"""`PooledBatchReward`: a batch reward `(completions, metadata) -> rewards` run in a
`RewardPool` worker under a time limit, so that a reward that hangs cannot hang the run.

One call scores the whole batch in one worker (a batch reward may compare completions with
each other), unless `chunk` splits it: then each run of `chunk` completions is one call
with its own limit, the calls run side by side in the pool's workers, and a hang cuts only
its own chunk (a multiple of the group size keeps every group in one call). A call past
`timeout_s` is abandoned (its worker is killed and replaced): every row of it scores
`timeout_reward`, the rows' prompts are logged by file and line (their metadata's
`source`), `timeouts` counts the call and `last_timeouts` the rows it cut. A call that
raises raises `RemoteRewardError` carrying the function's own traceback from the worker;
`score_batch_fn` then re-calls it on single completions to name the
prompt that fails.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rljax.rewards._pool import RewardPool
from rljax.rewards.batch import RewardError, source_of, traceback_of
from rljax.rewards.compose import reward_name

log = logging.getLogger(__name__)

__all__ = ["PooledBatchReward", "RemoteRewardError", "score_batch_fn"]


class RemoteRewardError(RuntimeError):
    """A reward function raised in a worker process: the message is its exception
    ("ZeroDivisionError: ..."), `traceback` its traceback there."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.traceback = traceback


def sources_text(metadata: Sequence[Mapping[str, Any]], limit: int = 8) -> str:
    """The rows' prompt sources ("file:line"), in order without repeats, `limit` at most."""
    seen = list(dict.fromkeys(s for s in map(source_of, metadata) if s))
    if not seen:
        return "generated, no file lines"
    more = f" and {len(seen) - limit} more" if len(seen) > limit else ""
    return ", ".join(seen[:limit]) + more


@dataclasses.dataclass(frozen=True)
class _WithComponents:
    """`fn`'s rewards and, when its function object sets `last_components` (a dict of
    per-row term values, as `ComponentReward` does), those too: the worker's copy of the
    object holds them, so they travel back with the rewards."""

    fn: Callable

    def __call__(self, completions, metadata):
        values = self.fn(completions, metadata)
        target = self.fn.resolve() if hasattr(self.fn, "resolve") else self.fn
        comps = getattr(target, "last_components", None) or {}
        return values, {k: np.asarray(v, np.float32) for k, v in comps.items()}


class PooledBatchReward:
    """`fn(completions, metadata)` in a worker of `get_pool()`, cut at `timeout_s`.

    `fn` must pickle (`rljax.rewards.imported.ImportedFunction` does: a worker imports it
    again by path). `get_pool` returns the pool at call time, so the process's shared pool
    starts only when a reward is first scored. `last_components`: the per-row term values
    the function set in the worker on the latest call (empty after a time-out), from
    which the trainer logs `reward/<term>` means (a cut chunk's rows hold
    `timeout_reward` in every term). `chunk`: completions per call (None: the whole
    batch in one call); `last_timeouts`: the rows a time limit cut on the latest call,
    which the trainer logs as `reward/timeouts`."""

    is_batch_reward = True

    def __init__(self, fn: Callable, get_pool: Callable[[], RewardPool], *,
                 timeout_s: float, timeout_reward: float = 0.0, chunk: int | None = None):
        if not timeout_s > 0:
            raise ValueError(f"PooledBatchReward: timeout_s must be > 0, got {timeout_s!r}")
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool)
                                  or chunk < 1):
            raise ValueError(f"PooledBatchReward: chunk must be an int >= 1 (completions "
                             f"per call) or None (the whole batch), got {chunk!r}")
        self.fn, self.get_pool, self.chunk = fn, get_pool, chunk
        self.timeout_s, self.timeout_reward = float(timeout_s), float(timeout_reward)
        self.name = reward_name(fn)
        self.timeouts = self.last_timeouts = 0
        self.last_components: dict[str, np.ndarray] = {}

    def __call__(self, completions: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        completions, metadata = list(completions), list(metadata)
        step = self.chunk or max(len(completions), 1)
        spans = [(i, min(i + step, len(completions))) for i in range(0, len(completions), step)]
        replies = self.get_pool().run([(_WithComponents(self.fn), completions[a:b],
                                        metadata[a:b]) for a, b in spans], self.timeout_s)
        for res in replies:
            if res[0] == "error":
                raise RemoteRewardError(res[1], res[2])
        parts = [self._part(res, completions[a:b], metadata[a:b])
                 for res, (a, b) in zip(replies, spans)]
        self.last_timeouts = sum(b - a for res, (a, b) in zip(replies, spans)
                                 if res[0] == "timeout")
        names = sorted({k for _, comps in parts for k in comps})
        fill = lambda n: np.full(n, self.timeout_reward, np.float32)  # noqa: E731
        self.last_components = {k: np.concatenate([comps.get(k, fill(len(v))) for v, comps
                                                   in parts]) for k in names}
        return np.concatenate([v for v, _ in parts]) if parts else np.zeros(0, np.float64)

    def _part(self, res: tuple, completions: list, metadata: list) -> tuple:
        """One call's `(values float64[n], components)`; a call past the limit is logged
        and its rows score `timeout_reward` (no components)."""
        if res[0] == "ok":
            values = np.asarray(res[1][0], np.float64)
            if values.shape != (len(completions),):
                raise RewardError(f"reward function {self.name!r} returned shape "
                                  f"{values.shape} for a call of {len(completions)} "
                                  f"completions; expected ({len(completions)},), one reward "
                                  "per completion", index=-1, fn=self.name)
            return values, res[1][1]
        self.timeouts += 1
        log.warning("reward function %r timed out after %.1f s (reward.timeout_s=%g) on a "
                    "batch of %d completions (their prompts: %s); they score %g",
                    self.name, res[1], self.timeout_s, len(completions),
                    sources_text(metadata), self.timeout_reward)
        return np.full(len(completions), self.timeout_reward, np.float32), {}


def _described(e: BaseException) -> str:
    """"KeyError: 'x'": the exception, as raised in a reward worker process too."""
    return str(e) if isinstance(e, RemoteRewardError) else f"{type(e).__name__}: {e}"


def _user_traceback(e: BaseException) -> str:
    """The reward function's traceback for an error message (from the reward worker
    process where it ran there)."""
    return "\n" + (e.traceback if isinstance(e, RemoteRewardError) else traceback_of(e))


def score_batch_fn(fn, completions: list, metadata: list, group_size: int,
                   first_prompt: int = 0) -> np.ndarray:
    """Call a batch reward ``fn(completions, metadata) -> float[B]`` and check it.

    A raise is localised by re-calling ``fn`` on single completions, so the error names
    the first failing prompt (global index: ``first_prompt`` is this block's first); a
    non-finite or wrongly shaped result is an error too. All errors are
    ``rljax.rewards.RewardError`` naming the function and the prompt index.
    """
    name = reward_name(fn)

    def where(i):  # the prompt's file:line when its metadata has a source
        at = f"batch index {i} (prompt index {first_prompt + i // group_size})"
        src = source_of(metadata[i]) if i < len(metadata) else None
        return f"the prompt at {src}, {at}" if src else at

    try:
        out = np.asarray(fn(list(completions), list(metadata)), np.float64)
    except RewardError:  # already names its prompt and function
        raise
    except Exception as e:  # find which prompt made it fail
        for i, (c, m) in enumerate(zip(completions, metadata)):
            try:
                fn([c], [m])
            except Exception as e1:
                raise RewardError(f"reward function {name!r} raised {_described(e1)} at "
                                  f"{where(i)}{_user_traceback(e1)}", index=i, fn=name) from e1
        raise RewardError(f"reward function {name!r} raised {_described(e)} on the batch (but "
                          f"on no single completion){_user_traceback(e)}", index=-1, fn=name) from e
    if out.shape != (len(completions),):
        raise RewardError(f"reward function {name!r} returned shape {out.shape}; expected "
                          f"({len(completions)},), one reward per completion", index=-1, fn=name)
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        i = int(bad[0])
        raise RewardError(f"reward function {name!r} returned non-finite {out[i]} at {where(i)}",
                          index=i, fn=name)
    return out.astype(np.float32)
