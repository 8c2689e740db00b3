"""`PooledBatchReward`: a batch reward `(completions, metadata) -> rewards` run in a
`RewardPool` worker under a time limit, so that a reward that hangs cannot hang the run.

One call scores the whole batch in one worker (a batch reward may compare completions with
each other, so the batch is never split). A call past `timeout_s` is abandoned (its worker
is killed and replaced): every row of it scores `timeout_reward`, the rows' prompts are
logged by file and line (their metadata's `source`), and `timeouts` counts it. A call that
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
    which the trainer logs `reward/<term>` means."""

    is_batch_reward = True

    def __init__(self, fn: Callable, get_pool: Callable[[], RewardPool], *,
                 timeout_s: float, timeout_reward: float = 0.0):
        if not timeout_s > 0:
            raise ValueError(f"PooledBatchReward: timeout_s must be > 0, got {timeout_s!r}")
        self.fn, self.get_pool = fn, get_pool
        self.timeout_s, self.timeout_reward = float(timeout_s), float(timeout_reward)
        self.name = reward_name(fn)
        self.timeouts = 0
        self.last_components: dict[str, np.ndarray] = {}

    def __call__(self, completions: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        self.last_components = {}
        res = self.get_pool().run([(_WithComponents(self.fn), list(completions),
                                    list(metadata))], self.timeout_s)[0]
        if res[0] == "ok":
            values, self.last_components = res[1]
            return values
        if res[0] == "error":
            raise RemoteRewardError(res[1], res[2])
        self.timeouts += 1
        log.warning("reward function %r timed out after %.1f s (reward.timeout_s=%g) on a "
                    "batch of %d completions (their prompts: %s); they score %g",
                    self.name, res[1], self.timeout_s, len(completions),
                    sources_text(metadata), self.timeout_reward)
        return np.full(len(completions), self.timeout_reward, np.float32)


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
