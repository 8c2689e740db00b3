"""The one RL step driver: ``rl_step(spec, source, state, window)`` for every rollout
source (``rljax.train.sources``).

A host source collects the batch (sampling, then rewards or episodes on the host, DAPO's
rounds when wrapped in ``Refill``), then the learning program runs
(``rljax.train.programs.step.learn_step``); a device source's whole step is one program
(``fused_step``: sample -> score -> learn). Both split the state's key the same way
(``split_step_key``), so a device reward draws the same samples and makes the same
updates as the equivalent host reward. Several seeds are the same pure step vmapped over
a leading seed axis (``rljax.train.seeds``).

The host boundary inside a step: the data position and prompt ids in, own rows' token ids
out, rewards in (``rljax.train.hosts``), the packed batch's bucket (one scalar) when the
layout packs, and the metrics dict out.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rljax.sharding import put_on
from rljax.train import hosts
from rljax.train.learn.update import TrainState
from rljax.train.programs.device import split_step_key
from rljax.train.programs.step import StepSpec, fused_step, learn_step, run, state_scalars
from rljax.train.sources import Window
from rljax.train.throughput import PhaseTimes

__all__ = ["StepOutput", "rl_step"]

_split_key = jax.jit(split_step_key)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One step's results: the new state, its metrics (floats, the same on every
    process; the program's bookkeeping ``done_steps`` and ``nonfinite_run`` still in
    them), the spec its learning program ran with (a packed batch's shape included), and
    the phase times."""

    state: TrainState
    metrics: dict
    spec: StepSpec
    times: PhaseTimes


def rl_step(spec: StepSpec, source, state: TrainState, window: Window, *,
            teacher_params=None, ph: PhaseTimes | None = None) -> StepOutput:
    """One RL step of ``state`` on ``window``'s prompts from ``source``. A host source's
    rollout sizes the spec's layout (``Packed.for_rollout``: the packed batch's bucket);
    ``teacher_params``: a distillation teacher's weights.
    """
    ph = PhaseTimes() if ph is None else ph
    params, opt_state = put_on((state.params, state.opt_state), spec.out_shardings)
    state = dataclasses.replace(state, params=params, opt_state=opt_state)
    scalars = state_scalars(state)
    policy = state.params["policy"]
    if source.on_device:
        decode, prompts, task = source.inputs(policy, window.prompts, window.pos, window.n)
        pos, extra = window.pos + window.n, {}
        params, opt_state, out, m = ph.timed(
            "step", run, fused_step, spec, decode, state.params, state.opt_state, scalars,
            state.ref_params, prompts, task, state.key, teacher_params)
    else:
        key, k_roll, k_learn = _split_key(state.key)
        ro, pos, extra = source.collect(policy, window, k_roll, ph)
        spec = dataclasses.replace(spec, layout=spec.layout.for_rollout(ro))
        params, opt_state, out, m = ph.timed("learn", run, learn_step, spec, state.params,
                                             state.opt_state, scalars, state.ref_params, ro,
                                             k_learn, teacher_params)
        out["key"] = key
    state = dataclasses.replace(
        state, params=params, opt_state=opt_state,
        data_pos=hosts.put_replicated(pos, spec.mesh, np.int32), **out)
    metrics = hosts.fetch_scalars(m)
    metrics.update(extra)
    return StepOutput(state, metrics, spec, ph)
