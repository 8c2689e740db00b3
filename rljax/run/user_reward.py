"""The user's reward in a run: `reward.function` loaded, placed in the worker pool, named.

- `custom_reward(cfg)`: `reward.function` (found as `python -m` finds modules: the current
  directory first) as the run's reward. With `reward.workers > 0` every call runs in the
  process's shared `rljax.rewards.RewardPool` under `reward.timeout_s`, a batch reward
  (`function_form="batch"`) as one call per batch (or per `reward.batch_chunk`
  completions), an item reward (`"item"`) as one call per completion; a call past the
  limit scores 0, is logged with its prompts' file lines, and the run goes on. A `rljax.rewards.device.DeviceReward` instance is used as it is.
- `Verifier`: the accuracy check with the name the run reports it under.
- `check_reward(cfg)`: load the reward before anything is written (the run directory).
"""

from __future__ import annotations

import atexit
import dataclasses
from collections.abc import Callable
from typing import Any

from rljax import rewards as rw
from rljax.rewards.imported import ImportedFunction
from rljax.rewards.pooled import PooledBatchReward

__all__ = ["Verifier", "check_reward", "custom_reward", "shared_reward_pool"]

_POOLS: dict[int, rw.RewardPool] = {}  # workers -> the process's reward pool


def shared_reward_pool(workers: int) -> rw.RewardPool:
    """One `rljax.rewards.RewardPool` per size for the whole process, started on first use
    and closed at exit: runs in one process (tests, sweeps) share its warm workers."""
    if workers not in _POOLS:
        _POOLS[workers] = rw.RewardPool(workers)
        atexit.register(_POOLS[workers].close)
    return _POOLS[workers]


@dataclasses.dataclass(frozen=True)
class Verifier:
    """`fn(completion, meta) -> bool`: the check behind the reported accuracy; `name`
    says which function computed it (printed beside every accuracy)."""

    fn: Callable[[str, Any], Any]
    name: str

    def __call__(self, completion: str, meta: Any) -> bool:
        return bool(self.fn(completion, meta))


def check_reward(cfg) -> None:
    """Import `reward.function` now (ImportError / ValueError naming the setting), so a
    wrong name stops the run before its directory is made."""
    if cfg.reward.kind == "custom":
        ImportedFunction.of(cfg.reward.function, "reward.function")


def custom_reward(cfg, component_reward: Callable) -> Any:
    """The run's reward for `reward.kind="custom"` (see the module docstring).
    `component_reward(terms, timeout_s=, workers=)` builds the item-reward form
    (`rljax.run.builders.ComponentReward`)."""
    # Imported here, not at the top: `Verifier` lives in this module, and a reward worker
    # that unpickles one must not import JAX (rljax.rewards.device) to get it.
    from rljax.rewards.device import is_device_reward

    r = cfg.reward
    fn = ImportedFunction.of(r.function, "reward.function")
    loaded = fn.resolve()
    if is_device_reward(loaded):
        return loaded  # scored from token ids inside the step's program
    if r.function_form == "item":
        return component_reward(((1.0, fn),), timeout_s=r.timeout_s, workers=r.workers)
    if r.workers == 0:  # in the training process: no time limit (documented)
        return loaded
    return PooledBatchReward(fn, lambda: shared_reward_pool(r.workers), timeout_s=r.timeout_s,
                             chunk=r.batch_chunk or None)
