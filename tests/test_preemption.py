"""Issue 17's acceptance for preemption and export on 2 processes x 4 CPU devices.

Phase 1 (together): "mp", a 2 x 4 run of 6 steps; once step 1 is logged, process 1 alone
gets SIGTERM; both processes must stop after the same step K, save it and exit 0.
Meanwhile "ref", the same run uninterrupted on 1 x 8, in this process.

Phase 2 (together): "kill", a 2 x 4 run whose process 1 is SIGKILLed once the run has
started (its tokenizer is saved; killing it later costs two more compilations on these 2
cores and exercises the same path: a failed collective or JAX's heartbeat timeout): process
0 must exit within 60 s with a message. `rljax export --distributed` of mp's checkpoint K
on 2 x 4. In this process: a copy of mp resumed to the end (its metrics must equal ref's),
and the 1-process exports of checkpoint K (float32, and bf16 in several files).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import _multiprocess as mp
import ml_dtypes
import numpy as np
import pytest

from rljax import cli
from rljax.models.safetensors_io import SafetensorsFile
from rljax.run.preemption import StopSignal

pytestmark = pytest.mark.slow
STEPS = 6
NUMERIC = ("loss", "grad_norm", "kl_ref")
EXIT_BOUND_S = 60  # a guard against a hang (the bound), not a speed assertion
HEARTBEAT_S = 10  # the kill run's --heartbeat-timeout: its worst case stays well inside


def _pair(root, tag, args, extra=()):
    """Start `rljax ARGS --distributed ...` as processes 0 and 1 (4 devices each)."""
    port, procs = mp.free_port(), []
    for i in range(2):
        log = open(root / f"{tag}.p{i}.log", "w")
        cmd = [sys.executable, "-m", "rljax", *args, *extra, "--distributed", "--coordinator",
               f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        procs.append(subprocess.Popen(cmd, cwd=root, env=mp._env(4), stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def _finish(root, tag, procs, timeout=mp.TIMEOUT_S):
    """Wait for a pair; `(exit codes, logs)`."""
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append(p.wait())
    return rcs, [(root / f"{tag}.p{i}.log").read_text() for i in range(2)]


def _step_1_logged(run_dir):
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and '"step": 1, "phase": "rl"' in metrics.read_text()


def _signal_when(ready, proc, sig, sent: dict):
    """A thread that sends `sig` to `proc` once `ready()` is true."""
    def watch():
        while proc.poll() is None:
            if ready():
                proc.send_signal(sig)
                sent["t"] = time.monotonic()
                return
            time.sleep(0.1)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _cli(*argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = cli.main(list(argv))
    assert rc == 0, buf.getvalue()[-3000:]
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    exp = root / "preempt.py"
    exp.write_text(mp.EXPERIMENT.format(name="preempt", algorithm='name="grpo", group_size=4',
                                        prompts=4))
    train = lambda run, *sets: ["train", str(exp), "--set", f"run.dir={root / run}",  # noqa: E731
                                "--set", f"rl.steps={STEPS}", "--set", f"run.save_every={STEPS}",
                                *[a for s in sets for a in ("--set", s)]]
    t0, out = time.perf_counter(), {"root": root}
    term = {}
    procs = _pair(root, "mp", train("mp"))
    _signal_when(lambda: _step_1_logged(root / "mp"), procs[1], signal.SIGTERM, term)
    try:
        _cli(*train("ref"))
    finally:
        out["mp"] = _finish(root, "mp", procs)
    step = int(re.search(r"stopped by SIGTERM at step (\d+)", out["mp"][1][0]).group(1))
    out["step"], out["phase1_s"] = step, time.perf_counter() - t0

    kill = {}
    killed = _pair(root, "kill", train("kill"), ("--heartbeat-timeout", str(HEARTBEAT_S)))
    _signal_when((root / "kill" / "tokenizer").exists, killed[1], signal.SIGKILL, kill)
    export = _pair(root, "export", ["export", str(root / "mp"), str(root / "ex2"),
                                    "--step", str(step)])
    try:
        shutil.copytree(root / "mp", root / "resumed")
        out["resume_log"] = _cli(*train("resumed", "run.resume=true"))
        _cli("export", str(root / "mp"), str(root / "ex1"), "--step", str(step))
        _cli("export", str(root / "mp"), str(root / "bf16"), "--step", str(step),
             "--dtype", "bfloat16", "--max-shard-size", "20KB")
    finally:
        out["export"] = _finish(root, "export", export)
        out["kill"] = _finish(root, "kill", killed[:1], timeout=EXIT_BOUND_S + 30)
        killed[1].wait()
        out["kill_exit_s"] = time.monotonic() - kill.get("t", time.monotonic())
    out["wall_s"] = time.perf_counter() - t0
    print(f"\npreemption tests: phase 1 {out['phase1_s']:.1f} s, all {out['wall_s']:.1f} s; "
          f"SIGTERM stop at step {step}; survivor exited {out['kill_exit_s']:.1f} s after SIGKILL")
    return out


def test_sigterm_stops_both_processes_at_the_same_step(runs):
    rcs, logs = runs["mp"]
    assert rcs == [0, 0], "\n".join(log[-3000:] for log in logs)
    k = runs["step"]
    for log in logs:  # the one signalled and the one that was not
        assert f"stopped by SIGTERM at step {k};" in log and "run.resume=true" in log, log[-2000:]
    assert 2 <= k < STEPS
    ck = runs["root"] / "mp" / "checkpoints"
    assert max(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == k
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (ck / str(k) / "state").iterdir()}
    assert json.loads((ck / str(k) / "meta" / "metadata").read_text())["phase"] == "preempted"
    assert sorted(mp.rl_rows(runs["root"] / "mp")) == list(range(1, k + 1))


def test_resumed_run_equals_uninterrupted(runs):
    assert f"at step {runs['step']}" in runs["resume_log"]
    ref, resumed = mp.rl_rows(runs["root"] / "ref"), mp.rl_rows(runs["root"] / "resumed")
    assert sorted(ref) == sorted(resumed) == list(range(1, STEPS + 1))
    assert ref[1]["grad_norm"] > 0 and ref[1]["reward_std"] > 0  # real updates
    for step in range(1, STEPS + 1):
        mp.assert_close(resumed[step], ref[step], NUMERIC, mp.LATER_RTOL, f"step {step}")
        mp.assert_close(resumed[step], ref[step], mp.ROLLOUT, mp.TOKEN_RTOL, f"rollout {step}")


def test_sigkilled_peer_ends_the_survivor_with_a_message(runs):
    (rc,), (log, _) = runs["kill"]
    assert rc != 0, log[-2000:]
    assert runs["kill_exit_s"] < EXIT_BOUND_S, runs["kill_exit_s"]
    assert ("another process died or was killed" in log
            or "another task died" in log), log[-3000:]  # rljax's message or JAX's


def _tensors(folder):
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    return {n: np.array(f.get(n)) for f in map(SafetensorsFile, (folder / x for x in files))
            for n in f.names()}


def test_two_process_export_equals_one_process_and_loads(runs):
    rcs, logs = runs["export"]
    assert rcs == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "exported to" in logs[0] and "exported to" not in logs[1]  # process 0 writes
    one, two = _tensors(runs["root"] / "ex1"), _tensors(runs["root"] / "ex2")
    assert sorted(one) == sorted(two) and len(one) == 12
    for name in one:
        np.testing.assert_array_equal(two[name], one[name], err_msg=name)
    bf16 = _tensors(runs["root"] / "bf16")  # several files with an index
    assert len(set(json.loads((runs["root"] / "bf16" / "model.safetensors.index.json")
                              .read_text())["weight_map"].values())) > 1
    for name in one:
        np.testing.assert_array_equal(bf16[name], one[name].astype(ml_dtypes.bfloat16))
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    for folder, dtype, want in (("ex2", torch.float32, one), ("bf16", torch.bfloat16, bf16)):
        model = transformers.AutoModelForCausalLM.from_pretrained(runs["root"] / folder)
        state = model.state_dict()
        assert state["model.embed_tokens.weight"].dtype == dtype
        for name in one:
            np.testing.assert_array_equal(state[name].to(torch.float32).numpy(),
                                          want[name].astype(np.float32), err_msg=name)
        with torch.no_grad():  # and it runs
            assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_one_process_sigterm_sets_a_flag_until_the_block_ends():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        assert not stop.distributed and not stop.reached(0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reached(1)
    assert signal.getsignal(signal.SIGTERM) is before
