"""JAX profiler traces of chosen RL steps (`rljax train --profile-steps 3-5`,
`run.profile_steps`).

Steps are numbered as in `metrics.jsonl` and the progress line: 1 is the first RL step
(which includes compiling the programs; profile a later one to see the steady state).
Each run of consecutive chosen steps is one trace, with one `StepTraceAnnotation` per step
so that XProf / TensorBoard's profile plugin (`tensorboard --logdir <run_dir>/profile`)
shows the step boundaries. Process 0 writes into `<run_dir>/profile/`, process i > 0 into
`<run_dir>/profile/process_<i>/` (each host's chips are in its own trace).
"""

from __future__ import annotations

import contextlib
import os
import re

import jax

__all__ = ["MAX_STEPS", "StepProfiler", "parse_profile_steps"]

MAX_STEPS = 1000  # a trace of more steps would fill gigabytes
_ALLOWED = ("step numbers from 1 separated by commas, and ranges A-B with A <= B, "
            f"at most {MAX_STEPS} steps in all, e.g. '3', '3,5' or '3-5,8' "
            "(empty: no profile)")
_ITEM = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", re.ASCII)


def parse_profile_steps(text: str) -> frozenset[int]:
    """`"3-5,8"` -> `{3, 4, 5, 8}`; `""` -> no steps. A ValueError says what is allowed."""
    if not isinstance(text, str):
        raise ValueError(f"profile steps must be text such as '3,5' or '3-5', got {text!r}")
    steps: set[int] = set()
    for item in (p.strip() for p in text.split(",")) if text.strip() else ():
        m = _ITEM.fullmatch(item)
        a = int(m[1]) if m else 0
        b = int(m[2]) if m and m[2] else a
        if a < 1 or b < a or b - a >= MAX_STEPS:
            raise ValueError(f"profile steps {text!r}: {item!r} is not a step or range; "
                             f"allowed: {_ALLOWED}")
        steps.update(range(a, b + 1))
        if len(steps) > MAX_STEPS:
            raise ValueError(f"profile steps {text!r} name {len(steps)} steps; allowed: "
                             f"{_ALLOWED}")
    return frozenset(steps)


class StepProfiler:
    """Wraps each RL step; traces the chosen ones with `jax.profiler`.

        with StepProfiler(parse_profile_steps("3-5"), run_dir / "profile") as prof:
            for n in range(1, steps + 1):
                with prof.step(n):
                    ...  # step n, finished (its results fetched) before the block ends
    """

    def __init__(self, steps: frozenset[int], log_dir, *, last: int | None = None) -> None:
        """`last`: the run's last step; chosen steps after it are never reached, and a
        trace running at `last` stops there."""
        self.steps = frozenset(s for s in steps if last is None or s <= last)
        self.log_dir = os.fspath(log_dir)
        if jax.process_index() > 0:
            self.log_dir = os.path.join(self.log_dir, f"process_{jax.process_index()}")
        self.active = False
        self.traced: list[int] = []

    @contextlib.contextmanager
    def step(self, n: int):
        """Trace step `n` if chosen (starting a trace unless one runs); the trace stops
        after the last step of a run of consecutive chosen steps, or at an error."""
        if n not in self.steps:
            yield
            return
        if not self.active:
            jax.profiler.start_trace(self.log_dir)
            self.active = True
        try:
            with jax.profiler.StepTraceAnnotation("rl_step", step_num=n):
                yield
        except BaseException:
            self._stop()  # never leave the profiler running behind a failed step
            raise
        self.traced.append(n)
        if n + 1 not in self.steps:
            self._stop()

    def _stop(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()  # an error or an early end inside a run of chosen steps
