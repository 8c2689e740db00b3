"""The console side of a run: `Progress` prints a progress line with key metrics (to
stderr by default); `format_summary` builds the end-of-run screen whose last line is
`RESULT accuracy_before=... accuracy_after=... wall_s=...`; `result_line` formats any
experiment's `RESULT k=v ...` line."""

from __future__ import annotations

import math
import pathlib
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "algorithm_label", "format_summary", "result_line"]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _fmt_time(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """A plain-text progress line: `[ 12/100  12%] reward=0.41 accuracy=0.38 | 1.2s/step eta 1m45s`.

    On a terminal the line is redrawn in place; otherwise one line is printed every
    `min_interval_s` seconds (and for the last step), so logs stay short. The time per step
    and the ETA count from the first update on: the first step after `start` (the steps a
    resumed run had done) compiles the programs, and its time would inflate the ETA many
    times over; until a second step has ended the ETA reads `--` (compiling).
    """

    def __init__(self, total: int, keys: tuple[str, ...] = (), *, stream: TextIO | None = None,
                 min_interval_s: float = 5.0, desc: str = "", start: int = 0):
        if not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be an int >= 1, got {total!r}")
        self.total, self.keys, self.desc = total, tuple(keys), desc
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval_s = min_interval_s
        self._t0 = time.perf_counter()
        self._first: tuple[int, float] | None = None  # (steps, time) at the first update
        self._start = start
        self._last_print = -math.inf
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self, done: int, metrics: dict[str, Any]) -> str:
        """The progress text after `done` of `total` steps."""
        now = time.perf_counter()
        if self._first is not None and done > self._first[0]:
            per = (now - self._first[1]) / (done - self._first[0])
            rate = f"{per:.2f}s/step eta {_fmt_time(per * (self.total - done))}"
        else:  # the first step (compiling) alone says nothing about the others
            rate = f"{now - self._t0:.2f}s first step (compiling) eta --"
        shown = " ".join(f"{k}={_fmt(metrics[k])}" for k in self.keys if k in metrics)
        width = len(str(self.total))
        head = f"{self.desc} " if self.desc else ""
        return (f"{head}[{done:>{width}}/{self.total} {100 * done // self.total:>3}%] {shown}"
                f" | {rate}")

    def update(self, done: int, metrics: dict[str, Any]) -> None:
        """Show progress after `done` steps with the chosen `keys` of `metrics`."""
        now = time.perf_counter()
        if self._first is None and done > self._start:
            self._first = (done, now)
        last = done >= self.total
        if self._tty:
            end = "\n" if last else ""
            self.stream.write("\r" + self.line(done, metrics) + "\x1b[K" + end)
        elif last or now - self._last_print >= self.min_interval_s:
            self.stream.write(self.line(done, metrics) + "\n")
            self._last_print = now
        self.stream.flush()


def result_line(values: dict[str, float]) -> str:
    """``RESULT k1=v1 k2=v2 ...`` (6 significant digits): the last line of an experiment."""
    return "RESULT " + " ".join(f"{k}={float(v):.6g}" for k, v in values.items())


def algorithm_label(algorithm) -> str:
    """How a summary names an `AlgorithmConfig`: its preset, and the user objective that
    replaced the preset's (`algorithm.objective`, an import path) when there is one."""
    if algorithm.objective is None:
        return algorithm.name
    return f"objective {algorithm.objective} ({algorithm.name} preset's other settings)"


def _wall_line(wall_s: float, segments: int) -> str:
    text = f"{wall_s:.1f} s ({_fmt_time(wall_s)})"
    if segments > 1:
        text += f", the sum of the {segments} processes that ran it (resumed)"
    return f"  wall time       : {text}"


def format_summary(*, accuracy_before: float, accuracy_after: float, wall_s: float,
                   run_dir: str | pathlib.Path | None = None, title: str = "rljax run",
                   details: dict[str, Any] | None = None, metric: str = "accuracy",
                   measured_by: str | None = None, segments: int = 1) -> str:
    """The end-of-run screen; its last line is `RESULT accuracy_before=.. accuracy_after=.. wall_s=..`.

    Accuracies are fractions in [0, 1] (ValueError otherwise). `details` are extra lines
    (e.g. tokens/s, steps) shown above the RESULT line; one whose label the screen already
    shows (`reward after` of a run whose headline is the reward) is not repeated.
    `metric="reward"`: the two values are held-out reward means (a run whose reward has
    no verifier), any finite numbers, and the last line is `RESULT reward_before=..
    reward_after=.. wall_s=..`. `measured_by` names the function that computed them (shown
    beside them). `wall_s` of a resumed run is the sum over the `segments` processes that
    ran it (`rljax.run.run_clock`), which the wall-time line states.
    """
    if metric not in ("accuracy", "reward"):
        raise ValueError(f"metric must be 'accuracy' or 'reward', got {metric!r}")
    allowed = "a fraction in [0, 1]" if metric == "accuracy" else "a finite number"
    for name, value in ((f"{metric}_before", accuracy_before), (f"{metric}_after", accuracy_after)):
        if not isinstance(value, (int, float)) or not (
                0.0 <= value <= 1.0 if metric == "accuracy" else math.isfinite(value)):
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if not isinstance(wall_s, (int, float)) or not wall_s >= 0:
        raise ValueError(f"wall_s must be a number >= 0, got {wall_s!r}")
    rule = "=" * 60
    lines = [rule, title, rule]
    if measured_by:
        lines.append(f"  {metric + ' by':<16}: {measured_by}")
    gain = accuracy_after - accuracy_before
    lines += [f"  {metric + ' before':<16}: {accuracy_before:.4f}",
              f"  {metric + ' after':<16}: {accuracy_after:.4f}  ({gain:+.4f})",
              _wall_line(wall_s, segments)]
    shown = {metric + " by", metric + " before", metric + " after", "wall time"}
    for key, value in (details or {}).items():
        if key not in shown:
            lines.append(f"  {key:<16}: {_fmt(value)}")
    if run_dir is not None:
        lines.append(f"  run directory   : {run_dir}")
    lines.append(rule)
    lines.append(f"RESULT {metric}_before={accuracy_before:.4f} "
                 f"{metric}_after={accuracy_after:.4f} wall_s={wall_s:.1f}")
    return "\n".join(lines)
