"""Rollout sources: where one RL step's batch comes from.

Every source turns a window of prompts into a ``rljax.train.batch.Rollout`` (global
arrays) that the one learning program consumes (``rljax.train.driver.rl_step``):

- :class:`~rljax.train.sources.host.Rollouts`: single-turn completions scored on the host
  (a batch reward or item rewards; each process scores its own rows);
- :class:`~rljax.train.sources.device.DeviceRewardSource`: single-turn completions scored
  by a JAX reward; its step is one program (sample -> score -> learn,
  ``rljax.train.programs.step.fused_step``), so it collects nothing on the host;
- :class:`~rljax.train.sources.episodes.Episodes`: multi-turn episodes with an environment
  per row (``rljax.train.multiturn``);
- :class:`~rljax.train.sources.refill.Refill`: DAPO's dynamic sampling, rounds of *any*
  host source until the batch holds enough groups whose rewards differ.

The protocol (:class:`RolloutSource`) has three parts: ``on_device`` (whether the step is
one program), ``collect`` (a host source's batch, rewards in), and ``eval_batch`` (a
held-out batch's sums, for the one evaluator ``rljax.train.sources.evaluate``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

from rljax.train.batch import PromptSource, Rollout

__all__ = ["Collected", "RolloutSource", "Window"]


@dataclasses.dataclass(frozen=True)
class Window:
    """One step's prompts: ``prompts(pos, n)`` (``PromptSource``; global positions, so a
    resumed run or one on another number of processes reads the same prompts)."""

    prompts: PromptSource
    pos: int
    n: int

    def next(self) -> "Window":
        """The window right after this one (a refill round's prompts)."""
        return dataclasses.replace(self, pos=self.pos + self.n)


class Collected(NamedTuple):
    """A host source's batch: the rollout, the data position after it, and the step's
    host metrics (floats the same on every process: episode statistics, reward terms,
    refill counts)."""

    rollout: Rollout
    next_pos: int
    metrics: dict


class RolloutSource(Protocol):
    """What the driver and the evaluator need of a source.

    ``group_size``: completions per prompt; ``pad_id``: the tokenizer's pad id (pads
    prompts when batches join). ``on_device``: True when the step is one
    program (the source gives the program its inputs, ``DeviceRewardSource.inputs``);
    False when ``collect`` returns the batch. ``collect(params, window, key, ph,
    dispatched=None)`` samples and scores ``window`` with the policy ``params`` (``ph``:
    ``rljax.train.throughput.PhaseTimes``); ``dispatched()``, when given, is called once,
    as soon as the first sampling program is dispatched and before the host first waits
    for the device: what the caller dispatches there (an asynchronous step's learning
    program, ``rljax.train.async_driver``) runs on the chips while the host scores.
    ``samples_after_dispatch`` (optional, default False): True when ``collect`` may
    dispatch programs that read ``params`` after calling ``dispatched`` (later turns,
    refill rounds); the asynchronous driver then hands it a copy of the weights. ``eval_batch(params, prompts, metadata,
    first)``: greedy results of held-out prompts, ``{name: sum over every process's
    rows}`` with at least ``"reward"`` (and ``"accuracy"`` where there is a verifier).
    """

    group_size: int
    pad_id: int
    on_device: bool

    def collect(self, params: Any, window: Window, key: Any, ph: Any,
                dispatched: Any = None) -> Collected: ...

    def eval_batch(self, params: Any, prompts: list, metadata: list,
                   first: int) -> dict: ...
