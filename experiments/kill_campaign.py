"""Kill -9 campaign: SIGKILL `rljax train` at random moments, resume, and check nothing is
lost and no half-written checkpoint is ever read.

    python experiments/kill_campaign.py --kills 50 --processes 1
    python experiments/kill_campaign.py --kills 20 --processes 2      # 2 processes x 4 devices
    python experiments/kill_campaign.py --kills 20 --seeds 2          # 2 seeds in one program
    python experiments/kill_campaign.py --kills 12 --staleness 1      # one step off (async)

A tiny GRPO experiment (1-layer decoder, 4 prompts x 4 samples, a checkpoint every step,
the last 2 kept) runs once uninterrupted ("ref"), then as runs of `--kills-per-run` kills
each. Every attempt of a run is `rljax train EXP --set run.resume=auto` (1 process, or 2
joined by `--distributed`), armed by `experiments/kill_hooks.py` to SIGKILL itself (every
process of the attempt) in the rollout, in the update or during the asynchronous save of
a step shortly after its latest checkpoint, after a random delay; a fourth kind is
SIGKILLed from outside at a uniformly random time since its start (start-up, restore and
compilation included). After each kill the campaign notes the unfinished checkpoint
directories the kill left and the latest complete step; the next attempt must resume
exactly that step (reading a half-written one counts in `half_checkpoints_read`). A final
attempt completes the run. A run is lost when an attempt fails other than by the kill,
resumes another step, or when any metric line (all steps, every attempt, before and after
each kill) or the final checkpoint (parameters, optimiser state, counters, bit for bit)
differs from the uninterrupted run's: same seed, same process count, so equal means equal.
With `--seeds N` (one process) the experiment trains N seeds in one program
(`rljax.run.seed_runs`), scored by a device reward; its metric lines are compared per step
and seed, and "update" is the step's one program (sample, score, learn). With
`--staleness K` the run is asynchronous (`rl.max_staleness=K`): its checkpoints hold the
in-flight batches, and "update" is the learning program from its dispatch, while the
host scores the next batch.

One process uses 1 device and JAX's persistent compilation cache (no collectives, so the
restored-collective deadlock of tests/conftest.py cannot occur), so a restart costs its
imports rather than its compilations; 2 x 4 compiles afresh at every start. Last line:
`RESULT kills=... lost_runs=... half_checkpoints_read=... kills_during_save=... ...`;
each kill's record is in ROOT/campaign.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # also when imported by path
from kill_checks import (checkpoint_differences, complete_steps, differences,  # noqa: E402
                         fresh_unfinished, metric_rows, resumed_step)
from kill_hooks import PLAN_ENV, unfinished_checkpoints  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# XLA:CPU compiles without optimisation passes (the learning program: ~20 s -> ~1 s here).
# The campaign compares runs made with the same flags, bit for bit, not with other runs.
FAST_COMPILE = ("--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false "
                "--xla_backend_optimization_level=0")
KINDS = ("rollout", "update", "save", "external")
ATTEMPT_TIMEOUT_S = 900  # a guard against a hang, not a speed assertion
SAVE_DELAY_S = 0.05  # orbax's background write of this tiny state takes tens of ms

EXPERIMENT = textwrap.dedent('''
    import numpy as np
    import kill_hooks
    from rljax.models import ModelConfig
    from rljax.train.config import AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig
    from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig
    from rljax.rewards.device import DeviceReward

    kill_hooks.install_from_env()

    class EvenShare(DeviceReward):  # on token ids: varies within groups, real updates
        def task_arrays(self, metadata):
            return {{"n": np.ones(len(metadata), np.float32)}}

        def __call__(self, tokens_BxT, mask_BxT, task):
            even = (tokens_BxT % 2 == 0) * mask_BxT
            return task["n"] * even.sum(axis=1) / (mask_BxT.sum(axis=1) + 1.0)

    even_share = EvenShare()

    def config():
        return ExperimentConfig(
            name="kill", sft=None,
            model=ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=32),
            task=TaskConfig(name="arithmetic", difficulty=1, max_prompt_tokens=8),
            reward=RewardConfig(kind="custom", function="{reward}"),
            algorithm=AlgorithmConfig(name="grpo", group_size=4), optim=OptimConfig(lr=3e-3),
            sampling=SamplingConfig(max_new_tokens=4, temperature=1.0),
            rl=RLConfig(steps={steps}, prompts_per_step=4, eval_prompts=4, logp_chunk=8,
                        max_staleness={staleness}),
            run=RunConfig(dir="runs/unset", save_every=1, keep=2, plots=False,
                          tensorboard=False, seeds={seeds}))
''')
# The host reward, in a module of its own beside the experiment: a reward worker imports
# only numpy for it (from the experiment file, it would import JAX and the trainer, 3-4 s
# per worker, paid again by every attempt).
REWARDS = textwrap.dedent('''
    import numpy as np

    def digits(completions, metadata):  # varies within groups: real updates every step
        return np.array([sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions])
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Attempt:
    """One `rljax train` invocation on `processes` processes (logs in `run_dir.name`.N);
    `session`: in a session (process group) of its own, which a signal can be sent to."""

    def __init__(self, c: "Campaign", run_dir: pathlib.Path, n: int, plan: dict | None,
                 session: bool = False, extra: tuple[str, ...] = ()):
        self.logs = [c.root / f"{run_dir.name}.{n}.p{i}.log" for i in range(c.processes)]
        self.record = c.root / f"{run_dir.name}.{n}.kill"
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
            [str(REPO), str(REPO / "experiments"), os.environ.get("PYTHONPATH", "")]),
            XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count={c.devices}")
        env.pop(PLAN_ENV, None)
        if plan is not None:
            env[PLAN_ENV] = json.dumps({**plan, "record": str(self.record)})
        if c.processes == 1:
            env.update(JAX_COMPILATION_CACHE_DIR=str(c.root / "jax_cache"),
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        argv = [sys.executable, "-m", "rljax", "train", str(c.exp), "--set",
                f"run.dir={run_dir}", "--set", "run.resume=auto", *extra]
        if c.processes > 1:
            argv += ["--distributed", "--coordinator", f"127.0.0.1:{_free_port()}",
                     "--num-processes", str(c.processes), "--process-id"]
        self.t0, self.started = time.monotonic(), time.time()
        self.procs = [subprocess.Popen(argv + ([str(i)] if c.processes > 1 else []),
                                       cwd=c.root, env=env, stdout=open(log, "w"),
                                       stderr=subprocess.STDOUT, start_new_session=session)
                      for i, log in enumerate(self.logs)]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def wait(self, external_after: float | None = None) -> list[int]:
        """Exit codes; with `external_after`, SIGKILL every process at that time since the
        start. Once one process has failed, the others get 2 s before SIGKILL too (a job
        dies as a whole; JAX's heartbeat would take longer to notice)."""
        failed_at = None
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic() - self.t0
            if failed_at is None and any(p.poll() for p in self.procs):
                failed_at = now
            if (now > ATTEMPT_TIMEOUT_S or (failed_at is not None and now - failed_at > 2)
                    or (external_after is not None and now >= external_after)):
                self.kill()
            time.sleep(0.005)
        self.wall_s = time.monotonic() - self.t0
        return [p.wait() for p in self.procs]

    def log(self) -> str:
        return self.logs[0].read_text(errors="replace")

    def records(self) -> list[dict]:
        paths = sorted(self.record.parent.glob(self.record.name + ".p*"))
        return [json.loads(p.read_text()) for p in paths]


class Campaign:
    """Kills, resumes and checks (the module docstring); `run()` returns the summary."""

    def __init__(self, root: pathlib.Path, *, kills: int, processes: int, kills_per_run: int,
                 seed: int, kinds: tuple[str, ...] = KINDS, devices: int | None = None,
                 seeds: int = 1, staleness: int = 0):
        if kills < 1 or processes not in (1, 2) or kills_per_run < 1 or seeds < 1:
            raise ValueError("kills, kills_per_run and seeds must be >= 1 and processes 1 or 2")
        if seeds > 1 and processes != 1:
            raise ValueError(f"seeds={seeds}: several-seed runs use one process")
        if staleness < 0 or (staleness and seeds > 1):
            raise ValueError(f"staleness={staleness}: an int >= 0, with seeds=1")
        if not set(kinds) <= set(KINDS) or not kinds:
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds}")
        self.root, self.kills, self.processes, self.kinds = root, kills, processes, kinds
        self.devices = devices or (1 if processes == 1 else 4)
        self.per_run, self.rng = kills_per_run, np.random.default_rng(seed)
        self.steps = 3 * kills_per_run + 2  # room for every kill of a run to progress
        self.exp = root / "killexp.py"
        root.mkdir(parents=True, exist_ok=True)
        self.seeds, self.staleness = seeds, staleness
        (root / "killrewards.py").write_text(REWARDS)  # found in the attempts' directory
        self.exp.write_text(EXPERIMENT.format(steps=self.steps, seeds=seeds,
                                              staleness=staleness, reward=(
            "rljax_experiment_killexp:even_share" if seeds > 1 else "killrewards:digits")))
        self.records: list[dict] = []
        self.problems: dict[str, list[str]] = {}
        self.ref_rows: dict[int, dict] = {}
        self.delays = {"rollout": 0.02, "update": 0.02, "save": SAVE_DELAY_S}
        self.start_s: list[float] = []

    def _reference(self, attempt: Attempt) -> None:
        """Wait for the uninterrupted run; its metric lines and phase times."""
        rcs = attempt.wait()
        if rcs != [0] * self.processes:
            raise RuntimeError(f"the uninterrupted run failed ({rcs}):\n{attempt.log()[-3000:]}")
        self.ref_rows = metric_rows(self.root / "ref")
        from rljax.run.run_dir import read_metrics
        rows = [r for r in read_metrics(self.root / "ref") if r["phase"] == "rl"][self.seeds:]
        med = lambda *ks: float(np.median([sum(r[k] for k in ks) for r in rows]))  # noqa: E731
        if self.staleness:  # the learning program runs beside the next batch's scoring
            self.delays.update(rollout=med("time_rollout"),
                               update=med("time_reward", "time_learn"))
        elif "time_learn" in rows[0]:
            self.delays.update(rollout=med("time_rollout", "time_reward"),
                               update=med("time_learn"))
        else:  # one program a step (a device reward): the host only packs prompts first
            self.delays.update(update=med("time_step"))

    def _plan(self, kind: str, latest: int) -> dict | None:
        if kind == "external":
            return None
        step = min(latest + int(self.rng.integers(1, 4)), self.steps - 1)
        return {"phase": kind, "step": step,
                "delay_s": float(self.rng.uniform(0, self.delays[kind]))}

    def _kill_once(self, run_dir: pathlib.Path, n: int, kind: str, ref: Attempt | None):
        """One killed attempt and its checks; returns `(record, problems)`."""
        ckpt = run_dir / "checkpoints"
        before, latest = unfinished_checkpoints(str(ckpt)), (complete_steps(ckpt) or [0])[-1]
        plan = self._plan(kind, latest)
        after = None
        if plan is None:
            typical = float(np.median(self.start_s)) if self.start_s else 10.0
            after = float(self.rng.uniform(0, typical))
        attempt = Attempt(self, run_dir, n, plan)
        rcs = attempt.wait(after)
        if ref is not None:
            self._reference(ref)
        rec = {"run": run_dir.name, "attempt": n, "kind": kind, "plan": plan,
               "external_after_s": after, "exit": rcs, "wall_s": round(attempt.wall_s, 2),
               "latest_before": latest, "unfinished_before": before,
               "killed": [r for r in attempt.records()]}
        problems = self._check_resume(attempt, latest, before, bool(attempt.records()))
        rec["finished"] = rcs == [0] * self.processes  # done before an external kill came
        if not rec["finished"] and any(rc != -9 for rc in rcs):
            problems.append(f"attempt {n} ended {rcs}, not by SIGKILL:\n{attempt.log()[-2000:]}")
        rec["unfinished_after"] = unfinished_checkpoints(str(ckpt))
        rec["complete_after"] = complete_steps(ckpt)
        rec["phase"] = (rec["killed"][0]["phase"] if rec["killed"] else "external")
        rec["during_save"] = bool(fresh_unfinished(ckpt, attempt.started))
        rows = metric_rows(run_dir)
        problems += differences(rows, self.ref_rows)
        missing = sorted(set(range(1, rec["complete_after"][-1] + 1)) - {s for s, _ in rows}) \
            if rec["complete_after"] else []
        if missing:  # every checkpointed step keeps its metric line
            problems.append(f"metric lines of checkpointed steps {missing} are gone")
        return rec, problems

    def _check_resume(self, attempt: Attempt, latest: int, unfinished: list[str],
                      must_say: bool) -> list[str]:
        """The attempt resumed the latest complete checkpoint, never a half-written one
        (`must_say`: it got past its restore, so its log must say which step)."""
        got = resumed_step(attempt.log())
        if got is None:
            return [f"did not resume step {latest}"] if latest and must_say else []
        out = []
        if str(got) in unfinished:
            self.half_read += 1
            out.append(f"resumed half-written checkpoint {got}")
        if got != latest:
            out.append(f"resumed step {got}, the latest complete checkpoint was {latest}")
        return out

    def _one_run(self, r: int, kills: int, ref: Attempt | None) -> int:
        """Up to `kills` kills of run `r`, then a final attempt to the end and the
        comparisons; returns the kills delivered (fewer when the run finished first)."""
        run_dir, problems, n = self.root / f"run{r}", [], 0
        while n < kills:
            kind = self.kinds[len(self.records) % len(self.kinds)]
            if kind != "external" and (complete_steps(run_dir / "checkpoints") or [0])[-1] \
                    >= self.steps - 1:
                break  # no step left to plan a kill in: the final attempt ends the run
            rec, bad = self._kill_once(run_dir, n, kind, ref)
            ref, problems = None, problems + bad
            if rec["finished"]:
                self.finished += 1
                break
            self.start_s.append(rec["wall_s"])
            self.records.append(rec)
            n += 1
            with open(self.root / "campaign.jsonl", "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        latest = (complete_steps(run_dir / "checkpoints") or [0])[-1]
        final = Attempt(self, run_dir, n, None)
        rcs = final.wait()
        if rcs != [0] * self.processes:
            problems.append(f"the final attempt failed {rcs}:\n{final.log()[-2000:]}")
        problems += self._check_resume(final, latest, [], True)
        rows = metric_rows(run_dir)
        if sorted(rows) != sorted(self.ref_rows):
            problems.append(f"steps {sorted(rows)} != {sorted(self.ref_rows)}")
        problems += differences(rows, self.ref_rows)
        problems += checkpoint_differences(self.root / "ref", run_dir, self.steps)
        if problems:
            self.problems[run_dir.name] = problems
        return n

    def run(self) -> dict:
        """Every run of the campaign; the summary (RESULT keys)."""
        t0, self.half_read = time.perf_counter(), 0
        ref = Attempt(self, self.root / "ref", 0, None)  # runs beside the first attempt
        left, r, idle, self.finished = self.kills, 0, 0, 0
        while left:
            done = self._one_run(r, min(self.per_run, left), ref if r == 0 else None)
            idle = 0 if done else idle + 1
            if idle == 3:
                raise RuntimeError("three runs in a row finished before any kill")
            left, r = left - done, r + 1
        by = lambda key: {v: sum(rec[key] == v for rec in self.records)  # noqa: E731
                          for v in sorted({rec[key] for rec in self.records})}
        return {"kills": len(self.records), "runs": r, "lost_runs": len(self.problems),
                "half_checkpoints_read": self.half_read,
                "kills_during_save": sum(rec["during_save"] for rec in self.records),
                "finished_before_kill": self.finished,
                "processes": self.processes, "devices": self.devices, "seeds": self.seeds,
                "staleness": self.staleness,
                "phases": by("phase"), "worst_attempt_s": max(rec["wall_s"] for rec in
                                                             self.records),
                "wall_s": round(time.perf_counter() - t0, 1), "problems": self.problems}


def main(argv: list[str] | None = None) -> dict:
    """Parse the command line, run the campaign, print its RESULT line; the summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=50, help="SIGKILLs in all (default 50)")
    p.add_argument("--processes", type=int, default=1, choices=(1, 2),
                   help="1 (1 device) or 2 (x 4 CPU devices each)")
    p.add_argument("--kills-per-run", type=int, default=5, help="kills of one run (default 5)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0, help="the campaign's random moments")
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds trained in one program (run.seeds; one process)")
    p.add_argument("--staleness", type=int, default=0,
                   help="rl.max_staleness of the runs (0: synchronous; one seed)")
    p.add_argument("--root", default=None, help="work folder (default: a new temporary one)")
    a = p.parse_args(argv)
    root = pathlib.Path(a.root or tempfile.mkdtemp(prefix="kill_campaign_")).resolve()
    out = Campaign(root, kills=a.kills, processes=a.processes, kills_per_run=a.kills_per_run,
                   seed=a.seed, kinds=tuple(a.kinds.split(",")), seeds=a.seeds,
                   staleness=a.staleness).run()
    for name, problems in out["problems"].items():
        print(f"LOST {name}:\n  " + "\n  ".join(problems), file=sys.stderr)
    print(f"work folder {root}; phases at the kill {out['phases']}")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in out.items()
                               if k not in ("phases", "problems")))
    return out


if __name__ == "__main__":
    sys.exit(1 if main()["lost_runs"] else 0)
