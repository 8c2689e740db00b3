"""A run's wall time over every process that worked on it (a first launch and its resumes).

`RUN_DIR/wall_time.json` holds `{"segments_s": [s1, s2, ...]}`: the seconds of each
process that ran the run, in order, the current one last. The run directory rewrites it
(atomically) with each metrics line and when it closes, so a process stopped by SIGTERM
or Ctrl-C counts in full and one killed outright (`kill -9`, a lost VM) up to its last
metrics line. A run directory written before this file existed starts its count at the
process that resumes it.
"""

from __future__ import annotations

import json
import time

from etils import epath

from rljax.run.run_writers import write_atomic

__all__ = ["TIME_FILE", "RunClock"]

TIME_FILE = "wall_time.json"


class RunClock:
    """This process's segment of a run's wall time, after the segments recorded in
    `folder / TIME_FILE` when `resumed` (none otherwise)."""

    def __init__(self, folder: epath.Path, resumed: bool):
        self.path = folder / TIME_FILE
        self._t0 = time.perf_counter()
        self.before: list[float] = self._read() if resumed else []

    def _read(self) -> list[float]:
        if not self.path.exists():
            return []
        try:
            return [float(s) for s in json.loads(self.path.read_text())["segments_s"]]
        except (ValueError, KeyError, TypeError):  # unreadable: count from this process
            return []

    @property
    def segments(self) -> int:
        """How many processes have run the run, this one included."""
        return len(self.before) + 1

    def wall_s(self) -> float:
        """Seconds of every segment so far: the recorded ones and this process's."""
        return sum(self.before) + time.perf_counter() - self._t0

    def record(self) -> None:
        """Write the segments, this process's up to now (atomically)."""
        now = time.perf_counter() - self._t0
        write_atomic(self.path, json.dumps({"segments_s": [*self.before, round(now, 3)]}))
