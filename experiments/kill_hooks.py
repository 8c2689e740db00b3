"""Fault injection for `experiments/kill_campaign.py`: SIGKILL this `rljax train` process
at a chosen phase of a chosen RL step.

The campaign's generated experiment file calls `install_from_env()` when it is imported
(the CLI imports it before anything runs). With `RLJAX_KILL_PLAN` set to a JSON object

    {"phase": "rollout" | "update" | "save", "step": K, "delay_s": D, "record": PATH}

this module wraps three rljax entry points (only in this process; rljax is unchanged):

- `RLTrainer.step` (and `SeedRL.step`, several seeds): the phase is "rollout" from the
  start of step K (prompts, sampling, rewards) until the learning program starts, and
  "host" after it (metrics, logging);
- the step's timer for "learn" (`rljax.train.rl.PhaseTimes.timed`), or for "step" where the
  whole step is one program (a device reward): the phase is "update" while the jitted
  program runs (its compilation included on a first step); in an asynchronous run
  (`rl.max_staleness`) the phase is "update" from the learning program's dispatch
  (`rljax.train.async_driver.run`), while the host scores the next batch;
- `Checkpointer.save`: once the asynchronous save of step K has started ("save"), its
  write runs in orbax's background thread while the loop goes on.

When step K enters the planned phase, a thread sleeps `D` seconds, writes to `PATH`
(suffixed `.p<process index>`) where the process really was (phase, step, and any
unfinished checkpoint directories: a kill during a save leaves them), fsyncs it, and sends
this process SIGKILL, which no handler can catch or delay: what a preempted machine sees.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

PLAN_ENV = "RLJAX_KILL_PLAN"
PHASES = ("rollout", "update", "save")
_FINAL_MARKER = "_CHECKPOINT_METADATA"  # what orbax writes last in a finished step dir

_where: dict[str, Any] = {"phase": "startup", "step": 0, "ckpt_dir": None}
_plan: dict[str, Any] = {}
_fired = threading.Event()


def unfinished_checkpoints(ckpt_dir: str | None) -> list[str]:
    """Names in `ckpt_dir` that are half-written checkpoints: orbax's temporary
    directories and step directories without the finalisation marker."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if "tmp" in name or (name.isdigit() and not os.path.exists(
                os.path.join(path, _FINAL_MARKER))):
            out.append(name)
    return out


def _process_index() -> int:
    try:
        import jax
        return jax.process_index()
    except Exception:  # noqa: BLE001 - before the runtime starts: one process
        return 0


def _kill_after(delay_s: float) -> None:
    time.sleep(delay_s)
    record = {"planned": {k: _plan[k] for k in ("phase", "step", "delay_s")},
              "phase": _where["phase"], "step": _where["step"],
              "unfinished": unfinished_checkpoints(_where["ckpt_dir"]), "time": time.time()}
    fd = os.open(f"{_plan['record']}.p{_process_index()}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, json.dumps(record).encode())
    os.fsync(fd)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _enter(phase: str, step: int | None = None) -> None:
    """Note the phase (and step); start the killer when it is the planned one."""
    _where["phase"] = phase
    if step is not None:
        _where["step"] = step
    if (_plan and not _fired.is_set() and phase == _plan["phase"]
            and _where["step"] == _plan["step"]):
        _fired.set()
        threading.Thread(target=_kill_after, args=(float(_plan["delay_s"]),),
                         daemon=True).start()


def install(plan: dict[str, Any]) -> None:
    """Wrap the entry points (module docstring) and arm `plan`."""
    import numpy as np

    from rljax.train import async_driver, rl, seeds
    from rljax.train.checkpoint import Checkpointer

    if plan.get("phase") not in PHASES or not isinstance(plan.get("step"), int):
        raise ValueError(f"{PLAN_ENV}: phase must be one of {PHASES} and step an int, got {plan}")
    _plan.update(plan)
    step_fn, timed_fn, save_fn = rl.RLTrainer.step, rl.PhaseTimes.timed, Checkpointer.save
    dispatch_fn = async_driver.run
    seed_step_fn = seeds.SeedRL.step

    def wrap(fn):
        def step(self, state, source):
            _enter("rollout", int(np.asarray(state.step).reshape(-1)[0]) + 1)
            out = fn(self, state, source)
            _enter("host")
            return out
        return step

    def timed(self, name, fn, *args, **kw):
        if name not in ("learn", "step"):
            return timed_fn(self, name, fn, *args, **kw)
        _enter("update")
        out = timed_fn(self, name, fn, *args, **kw)
        _enter("host")
        return out

    def dispatch(*args, **kw):
        _enter("update")
        return dispatch_fn(*args, **kw)

    def save(self, step_, state, meta=None, *, force=False):
        _where["ckpt_dir"] = os.fspath(self.directory)
        started = save_fn(self, step_, state, meta, force=force)
        if started:
            phase = _where["phase"]
            _enter("save", int(step_))
            _where["phase"] = phase  # the write goes on in the background
        return started

    rl.RLTrainer.step, seeds.SeedRL.step = wrap(step_fn), wrap(seed_step_fn)
    rl.PhaseTimes.timed, Checkpointer.save = timed, save
    async_driver.run = dispatch


def install_from_env() -> None:
    """`install` the plan in `RLJAX_KILL_PLAN`, if it is set (else nothing changes)."""
    text = os.environ.get(PLAN_ENV)
    if text:
        install(json.loads(text))
