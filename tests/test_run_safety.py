"""Runs are never lost (issue 46): the run-directory lock (a live owner refuses a second
process by name; a `kill -9`, here during a checkpoint save, leaves a lock the next
process takes over), `run.resume=true` / `auto`, a resume that does not fit its checkpoint
changing nothing and naming the fields, and SIGTERM / Ctrl-C during the SFT warm-up
saving a checkpoint that a resume continues exactly."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from rljax.cli import main
from rljax.run.experiment import RunConfig
from rljax.run.experiment_files import load_experiment
from rljax.run.preemption import Preempted
from rljax.run.run_dir import RunDir, RunDirError, read_metrics
from rljax.run.runner import run_experiment
from rljax.train.checkpoint import Checkpointer
from rljax.train.sft import SFTTrainer

CFG = {"lr": 1.0, "run": {"dir": "x"}}

HOLDER = textwrap.dedent("""
    import sys, jax.numpy as jnp
    from rljax.run.run_dir import RunDir
    from rljax.train.checkpoint import Checkpointer
    rd = RunDir(sys.argv[1], {"lr": 1.0, "run": {"dir": "x"}})
    ck = Checkpointer(rd.checkpoint_dir)
    ck.save(1, {"w": jnp.ones((4,))})
    ck.wait_until_finished()
    ck.save(2, {"w": jnp.ones((64, 1024, 1024))})  # 256 MB, written in the background
    print("saving", flush=True)
    import time; time.sleep(120)
""")


def test_lock_refuses_a_live_owner_and_is_taken_over_after_kill_9(tmp_path, capsys):
    path = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "saving"
        with pytest.raises(RunDirError) as refused:
            RunDir(path, CFG, resume=True)
        msg = str(refused.value)
        assert f"in use by process {proc.pid} on host {socket.gethostname()}" in msg
        assert "run.lock" in msg
    finally:
        proc.kill()  # SIGKILL, most likely while orbax still writes step 2
        proc.wait()
    during_save = not (path / "checkpoints" / "2" / "commit_success.txt").exists()
    with RunDir(path, CFG, resume=True) as rd:
        assert rd.resumed
        assert f"taking over the stale lock of process {proc.pid}" in capsys.readouterr().err
        with Checkpointer(rd.checkpoint_dir) as ck:  # a half-written step is never read
            latest = ck.latest_step()
            state, _ = ck.restore_raw()
        assert latest == (1 if during_save else 2)
        assert np.asarray(state["w"]).shape == ((4,) if during_save else (64, 1024, 1024))
        with pytest.raises(RunDirError, match=f"in use by process {os.getpid()}"):
            RunDir(path, CFG, resume=True)  # the lock holds within a process too
    assert not (path / "run.lock").exists()  # released at the end
    print(f"\nkill -9 struck during the save: {during_save}")


def test_resume_true_needs_a_run_and_auto_starts_one(tmp_path):
    missing = tmp_path / "misspelt"
    for where in (missing, tmp_path / "empty"):
        with pytest.raises(RunDirError, match="holds no run to continue.*run.resume=auto"):
            RunDir(where, CFG, resume=True)
    assert not missing.exists()  # nothing made for a misspelt path
    with RunDir(missing, CFG, resume="auto") as rd:
        assert not rd.resumed
        rd.log(1, {"loss": 1.0})
    with RunDir(missing, {**CFG, "lr": 2.0}, resume="auto") as rd:
        assert rd.resumed and rd.changed == ["lr: 1.0 -> 2.0"]
    with pytest.raises(RunDirError) as other:
        RunDir(missing, {**CFG, "lr": 3.0})
    assert "lr: 1.0 -> 3.0" in str(other.value)  # a resume that wrote nothing kept 1.0
    assert "run.resume=true" in str(other.value) and "run.overwrite=true" in str(other.value)
    assert RunConfig(resume="auto").resume == "auto"
    with pytest.raises(ValueError, match="RunConfig.resume='yes'.*'auto'"):
        RunConfig(resume="yes")


# rljax is imported inside config(): the reward worker that imports this file for
# hangs_when_marked (again after each time limit) then loads numpy only, not JAX.
EXPERIMENT = textwrap.dedent('''
    import os, pathlib, signal, time
    import numpy as np

    def hangs_when_marked(completions, metadata):
        """The share of digits; once a file `hang` lies beside this one, it sends SIGTERM
        to the process whose pid the file holds (the run), then hangs."""
        marker = pathlib.Path(__file__).with_name("hang")
        if marker.exists():
            os.kill(int(marker.read_text()), signal.SIGTERM)
            time.sleep(600)
        return np.array([sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions])

    def config():
        from rljax.models import ModelConfig
        from rljax.train.config import (AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig,
                                        SFTConfig)
        from rljax.run.experiment import ExperimentConfig, RunConfig, TaskConfig

        return ExperimentConfig(
            name="tiny_sft",
            model=ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=32),
            task=TaskConfig(name="arithmetic", difficulty=1, max_prompt_tokens=8),
            algorithm=AlgorithmConfig(name="grpo", group_size=2),
            optim=OptimConfig(lr=3e-3),
            sampling=SamplingConfig(max_new_tokens=2),
            sft=SFTConfig(steps=4, batch_size=8, optim=OptimConfig(lr=1e-2)),
            rl=RLConfig(steps=0, prompts_per_step=4, eval_prompts=8, logp_chunk=8),
            run=RunConfig(dir="runs/tiny", plots=False, tensorboard=False),
        )
''')


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    (root / "tiny_sft.py").write_text(EXPERIMENT)
    return root


def _cfg(exp, name, *extra):
    return load_experiment(str(exp / "tiny_sft.py"), [f"run.dir={exp / name}", *extra])


def _sft_losses(run_dir):
    rows = [r for r in read_metrics(run_dir) if r["phase"] == "sft"]
    return [r["step"] for r in rows], [r["sft/loss"] for r in rows]


def _stopping_at(n, sig, calls):
    orig = SFTTrainer.step

    def step(self, state, batch):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), sig)
        return orig(self, state, batch)
    return step


def test_sigterm_and_ctrl_c_in_the_warm_up_save_and_resume_continues(exp, capsys):
    run_experiment(_cfg(exp, "ref"), out=io.StringIO())
    cut = exp / "cut"
    with pytest.MonkeyPatch.context() as mp, pytest.raises(Preempted) as stopped:
        mp.setattr(SFTTrainer, "step", _stopping_at(2, signal.SIGTERM, []))
        run_experiment(_cfg(exp, "cut"), out=io.StringIO())
    assert stopped.value.step == 2 and "at SFT warm-up step 2" in str(stopped.value)
    assert capsys.readouterr().err.count("SIGTERM received") == 1  # acknowledged, once
    with Checkpointer(cut / "sft_checkpoints") as ck:
        assert ck.latest_step() == 2
    assert _sft_losses(cut)[0] == [1, 2]
    out = io.StringIO()
    # Python's own Ctrl-C handler: a suite started in the background ignores SIGINT (and
    # a run keeps ignoring it, by design)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):
            mp.setattr(SFTTrainer, "step", _stopping_at(1, signal.SIGINT, []))  # its step 3
            run_experiment(_cfg(exp, "cut", "run.resume=true"), out=out)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "resumed the SFT warm-up" in out.getvalue() and "at step 2" in out.getvalue()
    with Checkpointer(cut / "sft_checkpoints") as ck:
        assert ck.latest_step() == 3
    run_experiment(_cfg(exp, "cut", "run.resume=true"), out=io.StringIO())
    steps, losses = _sft_losses(cut)
    ref_steps, ref_losses = _sft_losses(exp / "ref")
    assert steps == ref_steps == [1, 2, 3, 4]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)  # continued, not restarted


def test_sigterm_while_a_reward_hangs_stops_within_its_time_limit(exp, capsys, caplog):
    """SIGTERM arrives while a pooled reward call hangs (the reward sends it, then sleeps
    600 s): the call is cut at `reward.timeout_s`, its step ends, is saved, and the run
    stops there."""
    marker, run = exp / "hang", exp / "hang_run"
    cfg = _cfg(exp, "hang_run", "sft.steps=0", "rl.steps=4", "reward.kind=custom",
               "reward.function=rljax_experiment_tiny_sft:hangs_when_marked",
               "reward.workers=1", "reward.timeout_s=1")

    def mark_after_step_1():
        while not (run / "metrics.jsonl").exists() or not any(
                r["phase"] == "rl" for r in read_metrics(run)):
            time.sleep(0.05)
        marker.write_text(str(os.getpid()))
        marked.append(time.monotonic())

    marked: list = []
    threading.Thread(target=mark_after_step_1, daemon=True).start()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a late signal is harmless
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(Preempted) as stopped:
            run_experiment(cfg, out=io.StringIO())
        took = time.monotonic() - marked[0]
    finally:
        signal.signal(signal.SIGTERM, previous)
        marker.unlink(missing_ok=True)
    step = stopped.value.step
    assert stopped.value.phase == "rl" and 2 <= step < 4, str(stopped.value)
    assert took < 60, took  # a hang guard: the reward sleeps 600 s
    assert "timed out" in caplog.text
    assert capsys.readouterr().err.count("SIGTERM received") == 1
    with Checkpointer(run / "checkpoints") as ck:
        assert ck.latest_step() == step
    rl = [r for r in read_metrics(run) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == list(range(1, step + 1))
    # the batch call that hung scored every row of its step: reward/timeouts says so
    assert [r["reward/timeouts"] for r in rl] == [0.0] * (step - 1) + [1.0]


def test_a_resume_that_does_not_fit_changes_nothing_and_names_the_fields(exp, capsys):
    ref = exp / "ref"
    if not (ref / "checkpoints").exists():
        run_experiment(_cfg(exp, "ref"), out=io.StringIO())
    before = {p: (ref / p).read_bytes() for p in ("config.json", "metrics.jsonl")}
    rc = main(["train", str(exp / "tiny_sft.py"), "--set", f"run.dir={ref}", "--set",
               "run.resume=true", "--set", "model.intermediate_size=48"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "does not fit this config (changed: model.intermediate_size: 64 -> 48)" in err
    assert "Nothing was written" in err
    assert {p: (ref / p).read_bytes() for p in before} == before
    assert json.loads((ref / "config.json").read_text())["config"]["model"][
        "intermediate_size"] == 64
    assert not (ref / "run.lock").exists()
    fresh = exp / "mesh"
    assert main(["train", str(exp / "tiny_sft.py"), "--set", f"run.dir={fresh}",
                 "--set", "mesh.data=3", "--set", "mesh.fsdp=1"]) == 2
    err = capsys.readouterr().err
    assert "mesh.data=3" in err and "needs 3 devices" in err, err
    assert not fresh.exists()  # checked before the run directory is made
