"""`WarmupStop`: SIGTERM and Ctrl-C during an SFT warm-up, and resuming one.

The warm-up counts its own steps, so its checkpoints live apart from the RL ones, in
`RUN_DIR/sft_checkpoints/` (the latest only). Each warm-up step runs inside
`StopSignal.guard()` (Ctrl-C is held until the step's update is done, as in RL); after the
step a Ctrl-C or a SIGTERM (`StopSignal.reached`: on several processes, at a warm-up step
every process agrees on) saves the warm-up state and its loop variables and stops the run
(KeyboardInterrupt, or `Preempted` naming the SFT step). `run.resume` with no RL
checkpoint yet restores that state, and the warm-up continues from the step after it, with
the same data and the same stopping rule, as if it had not stopped.
"""

from __future__ import annotations

from typing import Any

from rljax.run.preemption import Preempted, save_interrupted
from rljax.train.checkpoint import Checkpointer

__all__ = ["SFT_CHECKPOINTS", "WarmupStop"]

SFT_CHECKPOINTS = "sft_checkpoints"


class WarmupStop:
    """Stop handling of one warm-up: `restore` (resume), `stop.guard()` (around each
    step), `after` (at each step boundary), `interrupted` (a Ctrl-C outside a step)."""

    def __init__(self, rd, stop, resume: bool | str, out):
        self.rd, self.stop, self.out = rd, stop, out
        self.directory = rd.path / SFT_CHECKPOINTS
        self._resume = bool(resume)
        self._ck: Checkpointer | None = None

    def _checkpointer(self) -> Checkpointer:
        if self._ck is None:  # made when first needed: a run that never stops has none
            self._ck = Checkpointer(self.directory, keep=1)
        return self._ck

    def saved_step(self) -> int | None:
        """The step of the saved warm-up state a resume continues from, or None."""
        if not self._resume or not self.directory.exists():
            return None
        return self._checkpointer().latest_step()

    def restore(self, fresh) -> tuple[Any, int, dict]:
        """`(state, steps done, saved loop variables)`: the saved warm-up state when
        resuming one (checked against `fresh`'s shapes before the run directory is
        written), else `(fresh, 0, {})`."""
        step = self.saved_step()
        if step is None:
            return fresh, 0, {}
        state, meta = self.rd.restore(self._checkpointer(), fresh)
        self.rd.begin()
        self.rd.truncate_metrics(step, phase="sft")
        print(f"[rljax] resumed the SFT warm-up of {self.rd.path} at step {step}",
              file=self.out)
        return state, step, dict(meta.get("loop", {}))

    def after(self, step: int, state, loop: dict, held) -> None:
        """At the boundary after warm-up step `step`: on a Ctrl-C during the step or a
        SIGTERM, save `state` with `loop` (JSON: what the loop needs to go on) and stop."""
        if held.hit:
            raise KeyboardInterrupt
        if self.stop.reached(step):  # every process alike
            ck = self._checkpointer()
            ck.save(step, state, {"phase": "sft", "loop": loop}, force=True)
            ck.wait_until_finished()
            raise Preempted(step, str(self.directory), self.stop.cause, phase="sft")

    def interrupted(self, step: int, state, loop: dict) -> None:
        """After a KeyboardInterrupt: save the warm-up state reached (when its buffers
        are intact) and say how to continue; the caller re-raises."""
        save_interrupted(self._checkpointer(), step, state, {"phase": "sft", "loop": loop},
                         self.out)

    def close(self) -> None:
        if self._ck is not None:
            self._ck.close()
            self._ck = None
