"""The RL phase of every run, one seed or several (`run.seeds`): steps from the state's
step to `rl.steps`, each inside `StopSignal.guard()` (a step donates the state: it is never
cut), the held-out evaluation when `rl.eval_due`, metrics logged per seed, the progress
line, JAX profiler traces of `run.profile_steps`, and the checkpoint schedule with
SIGTERM and Ctrl-C (`rljax.run.preemption`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from rljax.run.preemption import DeferredInterrupt, save_interrupted, save_step
from rljax.run.profiling import StepProfiler, parse_profile_steps
from rljax.run.report import Progress

__all__ = ["Seeds", "rl_loop"]


@dataclasses.dataclass(frozen=True)
class Seeds:
    """A run's seed axis: ``step(state) -> (state, [metrics per seed])`` and
    ``evaluate(policy params) -> [held-out results per seed]``; ``seeds`` names them in
    ``metrics.jsonl`` (``(None,)``: one run, whose lines carry no ``seed``)."""

    step: Callable
    evaluate: Callable
    seeds: Sequence = (None,)


def rl_loop(cfg, rd, ck, state, done: int, run: Seeds, meta: Callable, stop, out,
            progress_keys: Sequence[str]):
    """RL steps ``done + 1 .. rl.steps`` of ``state``; ``meta(phase, state)`` is a
    checkpoint's metadata. Returns ``(state, seconds the steps' phases took)``."""
    bar = Progress(max(cfg.rl.steps, 1), progress_keys, stream=out, desc="rl", start=done)
    prof = StepProfiler(parse_profile_steps(cfg.run.profile_steps), rd.path / "profile",
                        last=cfg.rl.steps)
    step_s, logged = 0.0, done
    try:
        while done < cfg.rl.steps:
            with prof.step(done + 1), stop.guard() as held:  # numbered as metrics.jsonl
                state, ms = run.step(state)
                done += 1
            step_s += sum(v for k, v in ms[0].items() if k.startswith("time_"))
            if cfg.rl.eval_due(done):
                for m, res in zip(ms, run.evaluate(state.params["policy"])):
                    m.update({f"eval/{k}": v for k, v in res.items()})
            with DeferredInterrupt(hold=not stop.distributed) as writing:  # whole lines
                _log_lines(rd, done, run.seeds, ms)
                logged = done
            if writing.hit:
                raise KeyboardInterrupt
            if done % cfg.run.log_every == 0 or done == cfg.rl.steps:
                bar.update(done, {k: float(np.mean([m[k] for m in ms]))
                                  for k in progress_keys if k in ms[0]})
            save_step(ck, done, cfg.rl.steps, state, lambda phase: meta(phase, state), stop,
                      held)
    except KeyboardInterrupt:  # keep what was learned, with its metric lines
        if logged < done:  # cut after the step, before its lines (its evaluation, say)
            _log_lines(rd, done, run.seeds, ms)
        save_interrupted(ck, done, state, meta("interrupted", state), out)
        raise
    return state, step_s


def _log_lines(rd, done: int, seeds: Sequence, ms: Sequence[dict]) -> None:
    """Step `done`'s metric lines, one per seed."""
    for seed, m in zip(seeds, ms):
        rd.log(done, m if seed is None else {**m, "seed": seed})
