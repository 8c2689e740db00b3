"""Ctrl-C campaign: SIGINT to `rljax train`'s whole process group at random moments; every
run must exit 130 with its last finished step saved, and resume from it to the same end.

    python experiments/sigint_campaign.py --trials 20

The experiment is the kill campaign's tiny GRPO run (`experiments/kill_campaign.py`: a
1-layer decoder, 4 prompts x 4 samples, a batch reward in 2 reward worker processes under
`reward.timeout_s`) with no scheduled checkpoint before the last step
(`run.save_every=1000`), so the step a Ctrl-C leaves is saved by the interrupt or not at
all. It runs once uninterrupted ("ref"), then as runs of `--per-run` trials. A trial is
one attempt (`rljax train ... run.resume=auto`, in a process group of its own, as a
terminal's foreground job) that gets one SIGINT sent to the whole group -- the trainer and
its reward workers, as a terminal's Ctrl-C -- at a random moment of one of two kinds
(`--kinds`; the trials of a run share one, picked in turn by the trials made before it):
"any", uniform over the shortest attempt seen to its end (the reference's at first;
start-up, compilation and evaluation included); "rl", once the attempt has logged a step drawn uniformly from those
left (all but the last), uniform over that step's time: in the next step or at its
boundary. A final attempt completes each run; the reference runs beside the first trial.

Per trial: the exit status must be 130 (the CLI's status; `-2`, a death by SIGINT before
Python's handler exists, is what a shell also reports as 130 and is counted apart as
`signal_deaths`), never 2 or 1; `lost_steps` adds the steps that logged a metric line
but are not in the latest complete checkpoint; the trial is `resumed` when the next attempt
that restores resumes exactly that checkpoint (or starts afresh when there is none). Per
run: the final attempt exits 0, and the run's metric lines and final checkpoint equal the
reference's bit for bit (`mismatched_runs` counts those that do not). An attempt that
finished before its SIGINT came is not a trial (`finished_first`), nor is one that
finished after it (`ignored`: the Ctrl-C did not stop the run; nothing is lost).
Last line: `RESULT trials=... exit130=... lost_steps=... resumed=... ...`; each attempt's
record (`trial`: whether it counts) is in ROOT/sigint.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # also when imported by path
from kill_campaign import Attempt, Campaign  # noqa: E402
from kill_checks import (checkpoint_differences, complete_steps, differences,  # noqa: E402
                         metric_rows, resumed_step)

KINDS = ("any", "rl")
EXTRA = ("--set", "run.save_every=1000")  # no checkpoint but the interrupt's and the last
STOP_GUARD_S = 300  # an attempt still running this long after its SIGINT hangs: a failure
STEPS_PER_RUN = 14  # the kill campaign's experiment with kills_per_run=4: 3 * 4 + 2 steps


def _steps_logged(run_dir: pathlib.Path) -> int:
    """The last RL step with a metric line (0: none)."""
    return max((s for s, _ in metric_rows(run_dir)), default=0)


def _step_s(run_dir: pathlib.Path) -> float:
    """The seconds the last logged step's phases took (its `time_*` metrics)."""
    from rljax.run.run_dir import read_metrics

    rows = [r for r in read_metrics(run_dir) if r["phase"] == "rl"]
    return sum(v for k, v in rows[-1].items() if k.startswith("time_")) if rows else 0.0


def _latest(run_dir: pathlib.Path) -> int:
    """The latest complete checkpoint step (0: none)."""
    return (complete_steps(run_dir / "checkpoints") or [0])[-1]


class SigintCampaign:
    """Trials, resumes and checks (the module docstring); `run()` returns the summary."""

    def __init__(self, root: pathlib.Path, *, trials: int, per_run: int, seed: int,
                 kinds: tuple[str, ...] = KINDS, steps_left: int = 1):
        if trials < 1 or per_run < 1:
            raise ValueError(f"trials and per_run must be >= 1, got {trials} and {per_run}")
        if not kinds or not set(kinds) <= set(KINDS):
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds}")
        # The kill campaign writes the experiment and its reward module into root.
        self.kc = Campaign(root, kills=trials, processes=1, kills_per_run=4, seed=seed)
        self.root, self.trials, self.per_run, self.kinds = root, trials, per_run, kinds
        self.steps_left = steps_left  # an "rl" moment leaves at least this many steps
        self.rng = np.random.default_rng(seed)
        self.records: list[dict] = []
        self.problems: dict[str, list[str]] = {}
        self.finished_first, self.ignored, self.ref_wall_s = 0, 0, None
        self._ref: Attempt | None = None

    def _attempt(self, run_dir: pathlib.Path, n: int) -> Attempt:
        return Attempt(self.kc, run_dir, n, None, session=True, extra=EXTRA)

    def _reference(self) -> float:
        """The uninterrupted run (started beside the first trial), waited for: its metric
        lines (for the comparisons); the shortest wall time of an attempt that ran to its
        end (the reference's, then any shorter one that finished before its SIGINT)."""
        if self.ref_wall_s is None:
            if self._ref.wait() != [0]:
                raise RuntimeError(f"the uninterrupted run failed:\n{self._ref.log()[-3000:]}")
            self.kc.ref_rows = metric_rows(self.root / "ref")
            self.ref_wall_s = self._ref.wall_s
        return self.ref_wall_s

    def _moment(self, kind: str, attempt: Attempt, run_dir: pathlib.Path) -> float | None:
        """Seconds since the attempt's start at which to send SIGINT (None: it ended
        before an "rl" moment came)."""
        if kind == "any":
            return float(self.rng.uniform(0, self._reference()))
        first = _steps_logged(run_dir) + 1
        target = int(self.rng.integers(first, max(first + 1,
                                                   self.kc.steps + 1 - self.steps_left)))
        while _steps_logged(run_dir) < target:
            if attempt.procs[0].poll() is not None:
                return None
            time.sleep(0.002)
        return time.monotonic() - attempt.t0 + float(self.rng.uniform(0, _step_s(run_dir)))

    def _interrupt(self, attempt: Attempt, kind: str, run_dir: pathlib.Path) -> dict:
        """Send SIGINT to the attempt's process group at a random moment; its exit."""
        proc = attempt.procs[0]
        at = self._moment(kind, attempt, run_dir)
        while at is not None and proc.poll() is None and time.monotonic() - attempt.t0 < at:
            time.sleep(0.002)
        sent = at is not None and proc.poll() is None
        if sent:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(timeout=STOP_GUARD_S)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it hangs
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        return {"kind": kind, "sent": sent, "at_s": at, "exit": rc,
                "wall_s": round(time.monotonic() - attempt.t0, 2)}

    def _trial(self, run_dir: pathlib.Path, n: int) -> dict:
        """One interrupted attempt of the run and its checks."""
        kind = self.kinds[len(self.records) % len(self.kinds)]
        attempt = self._attempt(run_dir, n)
        rec = {"run": run_dir.name, "attempt": n, **self._interrupt(attempt, kind, run_dir)}
        rec["resumed_from"] = resumed_step(attempt.log())
        rec["logged"], rec["saved"] = _steps_logged(run_dir), _latest(run_dir)
        rec["lost_steps"] = max(rec["logged"] - rec["saved"], 0)
        rec["log_tail"] = attempt.log()[-1500:] if rec["exit"] not in (0, 130) else ""
        return rec

    def _one_run(self, r: int, trials: int) -> int:
        """Up to `trials` trials of run `r`, then the final attempt and the comparisons;
        returns the trials made (fewer when the run finished first)."""
        run_dir, pending, made, n = self.root / f"run{r}", [], [], 0
        while len(made) < trials and _latest(run_dir) < self.kc.steps - 1:
            before = _steps_logged(run_dir)
            rec = self._trial(run_dir, n)
            n += 1
            _confirm(pending, rec["resumed_from"], rec["logged"] > before)
            rec["trial"] = rec["sent"] and rec["exit"] != 0
            self._log(rec)
            if not rec["trial"]:  # the run finished before its SIGINT, or after it
                self.finished_first += not rec["sent"]
                self.ref_wall_s = min(self._reference(), rec["wall_s"])  # "any": within it
                self.ignored += rec["sent"]
                break
            pending.append(rec)
            made.append(rec)
        final = self._attempt(run_dir, n)
        problems = [] if final.wait() == [0] else [
            f"the final attempt failed:\n{final.log()[-2000:]}"]
        _confirm(pending, resumed_step(final.log()), True)
        self._reference()
        rows = metric_rows(run_dir)
        if sorted(rows) != sorted(self.kc.ref_rows):
            problems.append(f"steps {sorted(rows)} != {sorted(self.kc.ref_rows)}")
        problems += differences(rows, self.kc.ref_rows)
        problems += checkpoint_differences(self.root / "ref", run_dir, self.kc.steps)
        if problems:
            self.problems[run_dir.name] = problems
        self.records += made
        return len(made)

    def _log(self, rec: dict) -> None:
        """Append the attempt's record to ROOT/sigint.jsonl (`resumed` is known later: in
        the records `run()` returns)."""
        with open(self.root / "sigint.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def run(self) -> dict:
        """Every run of the campaign; the summary (RESULT keys)."""
        t0 = time.perf_counter()
        self._ref = self._attempt(self.root / "ref", 0)
        left, r, idle = self.trials, 0, 0
        while left:
            done = self._one_run(r, min(self.per_run, left))
            idle = 0 if done else idle + 1
            if idle == 3:
                raise RuntimeError("three runs in a row finished before any SIGINT")
            left, r = left - done, r + 1
        exits = [rec["exit"] for rec in self.records]
        return {"trials": len(self.records), "runs": r,
                "exit130": sum(e in (130, -signal.SIGINT) for e in exits),
                "signal_deaths": exits.count(-signal.SIGINT), "exit2": exits.count(2),
                "other_exits": sum(e not in (130, -signal.SIGINT, 2) for e in exits),
                "lost_steps": sum(rec["lost_steps"] for rec in self.records),
                "resumed": sum(bool(rec.get("resumed")) for rec in self.records),
                "mismatched_runs": len(self.problems), "finished_first": self.finished_first,
                "ignored": self.ignored,
                "saved_steps": sum(rec["saved"] > 0 for rec in self.records),
                "wall_s": round(time.perf_counter() - t0, 1), "problems": self.problems}


def _confirm(pending: list[dict], got: int | None, restored: bool) -> None:
    """Once a later attempt got past its restore (`restored`: it logged a step, or it is
    the final one) or says it resumed step `got`: each pending trial was resumed when that
    is the step it saved (none, 0: a fresh start); they are then no longer pending."""
    if got is None and not restored:
        return  # stopped before its restore: the checkpoints are as the trials left them
    for rec in pending:
        rec["resumed"] = (got or 0) == rec["saved"]
    pending.clear()


def main(argv: list[str] | None = None) -> dict:
    """Parse the command line, run the campaign, print its RESULT line; the summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20, help="SIGINTs in all (default 20)")
    p.add_argument("--per-run", type=int, default=4, help="trials of one run (default 4)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0, help="the campaign's random moments")
    p.add_argument("--steps-left", type=int, default=1,
                   help="an 'rl' moment comes after a step that leaves at least this many "
                        "(default 1: any step but the last)")
    p.add_argument("--root", default=None, help="work folder (default: a new temporary one)")
    a = p.parse_args(argv)
    root = pathlib.Path(a.root or tempfile.mkdtemp(prefix="sigint_campaign_")).resolve()
    out = SigintCampaign(root, trials=a.trials, per_run=a.per_run, seed=a.seed,
                         kinds=tuple(a.kinds.split(",")), steps_left=a.steps_left).run()
    for name, problems in out["problems"].items():
        print(f"MISMATCH {name}:\n  " + "\n  ".join(problems), file=sys.stderr)
    print(f"work folder {root}")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in out.items() if k != "problems"))
    return out


def _failed(out: dict) -> bool:
    return bool(out["exit130"] != out["trials"] or out["lost_steps"] or out["mismatched_runs"]
                or out["resumed"] != out["trials"] or out["ignored"])


if __name__ == "__main__":
    sys.exit(1 if _failed(main()) else 0)
