"""Stopping a run at a step every process agrees on, when it is told to stop (SIGTERM).

Cloud TPU VMs get SIGTERM before a maintenance event or a spot / preemptible reclaim; on
a pod slice it may reach only some of the hosts. Every process must then stop after the
same step, or the checkpoint's collective save would hang or mix steps.

- Several processes (`jax.distributed` initialised): JAX's preemption sync manager (created
  by `jax.distributed.initialize`; it catches SIGTERM in C++) propagates the notice
  through the coordination service, and `multihost_utils.reached_preemption_sync_point(step)`
  returns True on every process at the same step (one past the largest step any process
  had reported last). Every process must call it at every step boundary, in the same
  order: the SFT warm-up reports its own steps (`WarmupStop.after`), so it stops at an
  agreed warm-up step as RL does at an agreed RL step. Checked here on CPU processes with
  gloo collectives. JAX ignores a notice that
  comes before a process's first call (checked here), so `run_experiment` reports a
  boundary as soon as its checkpoint directory is open: a SIGTERM during the setup (model,
  compilation, first evaluation) stops the run at its first step; only one during the
  start of the process (imports, `jax.distributed.initialize`) is lost, and the run goes on.
- One process: a Python SIGTERM handler sets a flag, read at the next step boundary
  (installed only from the main thread, the previous handler restored on exit), and says
  at once, once, that the run will stop there. The warm-up's boundaries read it too, so a
  SIGTERM there stops the warm-up at its next step with a checkpoint
  (`rljax.run.warmup_stop`).

`Preempted` is what `run_experiment` raises once the state of that step is saved
(`save_step`); its message is printed once, by `rljax train`. Ctrl-C (SIGINT) on one
process, during an RL or SFT step, is held until the step
ends (`DeferredInterrupt`, from `StopSignal.guard()`): a step donates the state's buffers to
its program, so a KeyboardInterrupt raised inside it would leave no state to save.
`save_interrupted` then saves the step reached; a second Ctrl-C stops at once. Outside a
step, `StopSignal`'s handler raises KeyboardInterrupt as Python's own does, and remembers
the Ctrl-C: Python drops a KeyboardInterrupt raised inside a garbage-collection callback
(JAX runs one at every collection; "Exception ignored in ..."), and the run then stops
after its next step instead of going on (`StopSignal.guard`), or, after the last one, when
the `StopSignal` block ends.

On several processes a Ctrl-C usually reaches some of them (the terminal of one host), and a
checkpoint is a collective write that a lone process would wait on forever. So there, while
JAX's service can make the processes agree, `StopSignal` turns the first Ctrl-C into a
SIGTERM to its own process: every process then stops after the same step and saves it, as on
a preemption. A second Ctrl-C raises KeyboardInterrupt at once; `save_interrupted` saves
nothing on several processes (the other processes stop on their heartbeat timeout) and says
that the latest checkpoint is intact.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils

__all__ = ["CtrlC", "DeferredInterrupt", "Preempted", "StopSignal", "save_interrupted",
           "save_step"]


class CtrlC:
    """Python's own Ctrl-C handler (KeyboardInterrupt at once) that remembers the Ctrl-C in
    `hit`: Python drops a KeyboardInterrupt raised inside a garbage-collection callback,
    so code that must stop reads `hit` at its next boundary (`StopSignal`; the `rljax`
    command, `rljax.__main__`, for the whole command)."""

    def __init__(self) -> None:
        self.hit = False

    def __call__(self, signum, frame) -> None:
        self.hit = True
        raise KeyboardInterrupt


class Preempted(Exception):
    """The run stopped on SIGTERM at `step` with its checkpoint saved in `checkpoint_dir`
    (complete on disk); `rljax train` reports it and exits 0. `cause` names the signal in
    the message ("SIGTERM", or `StopSignal.cause` on the process where Ctrl-C was
    forwarded). `phase` "sft": `step` counts SFT warm-up steps."""

    def __init__(self, step: int, checkpoint_dir: str, cause: str = "SIGTERM",
                 phase: str = "rl"):
        self.step, self.checkpoint_dir, self.phase = step, checkpoint_dir, phase
        where = "SFT warm-up step" if phase == "sft" else "step"
        super().__init__(f"stopped by {cause} at {where} {step}; checkpoint saved in "
                         f"{checkpoint_dir}; continue with --set run.resume=true")


class StopSignal:
    """`reached(step)` is True at the step boundary where every process stops (see the
    module docstring); a context manager that installs / removes the one-process handler.
    `cause` is what asked this process to stop, for its message: "SIGTERM", or
    "Ctrl-C (forwarded as SIGTERM)" once it forwarded a Ctrl-C."""

    def __init__(self) -> None:
        self.distributed = jax.distributed.is_initialized()
        # Without JAX's service (jax_enable_preemption_service=False) the processes could
        # not agree: SIGTERM then keeps its default effect.
        self._agreed = self.distributed and jax.config.jax_enable_preemption_service
        self._flag = False
        self._previous: dict[int, object] = {}  # signal -> the handler to put back
        self.cause = "SIGTERM"
        self._ctrl_c: CtrlC | None = None  # one process: the SIGINT handler while entered

    def _handle(self, signum, frame) -> None:
        if not self._flag:  # acknowledged when received, once
            print("\n[rljax] SIGTERM received: the run stops after the current step and "
                  "saves it", file=sys.stderr, flush=True)
        self._flag = True

    @property
    def ctrl_c(self) -> bool:
        """One process: whether a Ctrl-C came (its KeyboardInterrupt may have been dropped)."""
        return self._ctrl_c is not None and self._ctrl_c.hit

    def _forward_ctrl_c(self, signum, frame) -> None:
        """Several processes: the first Ctrl-C asks for an agreed stop (module docstring)."""
        signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))  # a second: at once
        self.cause = "Ctrl-C (forwarded as SIGTERM)"
        print(f"\n[rljax] Ctrl-C on process {jax.process_index()} of {jax.process_count()}: "
              "every process stops after the same step and saves it, as on SIGTERM "
              "(Ctrl-C again to stop at once, unsaved)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's handler tells the other processes

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        if not self.distributed:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
        current = signal.getsignal(signal.SIGINT)
        if not self.distributed and isinstance(current, CtrlC):
            self._ctrl_c = current  # the command's: a Ctrl-C during its set-up counts
            return self
        if not self.distributed:
            self._ctrl_c = CtrlC()
        handler = self._forward_ctrl_c if self._agreed else self._ctrl_c
        # A process that ignores SIGINT (started in the background) keeps ignoring it.
        if handler is not None and current is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, handler)
            self._previous[signal.SIGINT] = (signal.default_int_handler if current is None
                                             else current)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self.ctrl_c and exc_type is None:  # dropped after the last step: stop here
            raise KeyboardInterrupt

    def guard(self) -> DeferredInterrupt:
        """The block around one RL step: on one process a `DeferredInterrupt` (Ctrl-C held
        to the step's end); on several, none (Ctrl-C is an agreed stop, or, without JAX's
        service, a KeyboardInterrupt that saves nothing), with the same `hit` attribute.
        After a Ctrl-C whose KeyboardInterrupt was dropped, `hit` is set from the start:
        the run stops after this step."""
        held = DeferredInterrupt(hold=not self.distributed)
        held.hit = self.ctrl_c
        return held

    def reached(self, step: int) -> bool:
        """True at the boundary after `step` where every process stops. Call it at every
        step boundary (SFT warm-up steps numbered by the warm-up, RL steps by RL, and
        once with the starting RL step before either), on every process, in the same
        order. JAX's sync manager keeps each process's latest `step` only: the agreed stop
        is one past the largest of them, so warm-up steps can be followed by RL steps
        counted from 1 again (orbax's own checks report RL steps too). A notice that
        comes while one process is past the warm-up's last step S and another is not
        stops RL at step S + 1 (or the run ends first)."""
        if self._agreed:
            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        return self._flag


class DeferredInterrupt:
    """A block that Ctrl-C must not cut (an update that donates the state's buffers):
    a SIGINT inside it only sets `hit` (the caller raises KeyboardInterrupt at its next
    step boundary, once the step is logged); a second SIGINT raises at once. Only from
    the main thread (a no-op elsewhere, where Python delivers no signals), and only with
    `hold` (without it a block that holds nothing: `StopSignal.guard()` on several
    processes)."""

    def __init__(self, hold: bool = True) -> None:
        self.hit = False
        self._hold, self._installed = hold, False
        self._previous = signal.default_int_handler

    def _handle(self, signum, frame) -> None:
        self.hit = True
        signal.signal(signal.SIGINT, self._previous)  # a second Ctrl-C: at once
        print("\n[rljax] Ctrl-C: stopping after this step (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    def __enter__(self) -> DeferredInterrupt:
        # A process that ignores SIGINT (started in the background) keeps ignoring it.
        if (self._hold and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN):
            previous = signal.signal(signal.SIGINT, self._handle)
            # None: a handler not set from Python; Python's own takes its place after.
            self._previous = signal.default_int_handler if previous is None else previous
            self._installed = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False


def save_step(ck, done: int, steps: int, state, meta, stop: StopSignal, held) -> None:
    """The checkpoint after RL step `done` of `steps` (`ck`: a
    `rljax.train.checkpoint.Checkpointer`; `meta(phase)`: its metadata), as every RL loop
    takes it: a Ctrl-C during the step (`held`, the step's `stop.guard()`) raises
    KeyboardInterrupt for the caller to save; a stop request before the last step saves
    this one, waits until it is on disk and raises `Preempted` naming `stop.cause`;
    otherwise the `run.save_every` schedule's save, forced for the last step. A Ctrl-C
    while orbax starts a save is held until the call returns (one that cut it half-way
    left orbax a temporary directory it then failed to replace), then raises."""
    if held.hit:
        raise KeyboardInterrupt
    with DeferredInterrupt(hold=not stop.distributed) as saving:
        if done < steps and stop.reached(done):  # before orbax's own check
            ck.save(done, state, meta("preempted"), force=True)
            ck.wait_until_finished()
            raise Preempted(done, str(ck.directory), stop.cause, "rl")
        last = done == steps  # the final state: saved as soon as it exists
        ck.save(done, state, meta("done" if last else "rl"), force=last)
    if saving.hit:
        raise KeyboardInterrupt


def save_interrupted(ck, step: int, state, meta: dict, out) -> None:
    """After a KeyboardInterrupt: save `state` as checkpoint `step` (forced; once a save
    of it in flight is finished, nothing: it is that state), wait for the write and say
    how to continue (the caller re-raises). A state whose buffers a cut
    step had donated is not saved, nor is anything on several processes (a checkpoint is a
    collective write the others are not making): the checkpoints on disk stay as they were."""
    if jax.process_count() > 1:
        print(f"\n[rljax] interrupted on process {jax.process_index()} of "
              f"{jax.process_count()}: nothing new saved (a checkpoint needs every process); "
              f"the latest checkpoint in {ck.directory} is intact (continue with --set "
              "run.resume=true)", file=out)
        return
    if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
        print(f"\n[rljax] interrupted inside a step: nothing new saved; the latest "
              f"checkpoint in {ck.directory} is intact (continue with --set "
              "run.resume=true)", file=out)
        return
    ck.wait_until_finished()  # a save of `step` started before the Ctrl-C ends first
    ck.save(step, state, meta, force=True)
    ck.wait_until_finished()
    print(f"\n[rljax] interrupted at step {step}; checkpoint saved in {ck.directory}; "
          "continue with --set run.resume=true", file=out)
