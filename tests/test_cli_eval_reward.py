"""`rljax eval` of a run whose custom reward has no verifier (issue 59 item 4): the greedy
reward mean and pass@k at a reward threshold, on the run's held-out file or another one,
at any checkpoint step, through the command line; a second `rljax eval` reads its programs
from JAX's persistent compilation cache (issue 59 item 9). About 35 s on 2 idle cores (a
2-step run, three evaluations in process and two as commands)."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _own_task import records, write_task
from rljax.cli import main
from rljax.run.artifacts import PASS_THRESHOLD, sample_texts
from rljax.run.compile_cache import use_compile_cache
from rljax.run.experiment_files import load_experiment
from rljax.run.runner import run_experiment


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run (checkpoints 1 and 2) of a reward module with no reference answers."""
    root = tmp_path_factory.mktemp("own_reward")
    write_task(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.syspath_prepend(str(root))
        run_experiment(load_experiment("own_exp.py", []), out=io.StringIO())
    return root


def _eval(run, capsys, *args) -> dict:
    assert main(["eval", str(run / "runs/own"), *args]) == 0
    return json.loads(capsys.readouterr().out)


def _greedy_reward_mean(run, step, lo, hi) -> float:
    """What the eval must report: the run's reward of its greedy completions of records
    ``lo..hi``."""
    import own_reward

    recs = records(lo, hi)
    texts = [c[0] for c in sample_texts(run / "runs/own", [r["q"] + "=" for r in recs],
                                        temperature=0.0, step=step)]
    return float(np.mean(own_reward.score(texts, recs)))


def test_eval_scores_with_the_runs_own_reward(run, capsys, monkeypatch):
    monkeypatch.chdir(run)
    monkeypatch.syspath_prepend(str(run))
    res = _eval(run, capsys, "--k", "2")  # every call alike in shapes: one compilation
    assert res["verifier"] is None and res["reward"] == "own_reward:score"
    assert res["pass_threshold"] == PASS_THRESHOLD == 0.5 and res["n"] == 4
    assert 0.0 <= res["sample_pass"] <= res["pass@2"] <= 1.0  # any-of-k >= mean-of-k
    assert 0.0 <= res["sample_reward_mean"] <= 1.0
    np.testing.assert_allclose(res["reward_mean"], _greedy_reward_mean(run, None, 30, 34),
                               rtol=1e-6)
    # Another held-out file, the first checkpoint, a threshold every reward reaches.
    res = _eval(run, capsys, "--step", "1", "--set", "task.eval_split=data/other.jsonl",
                "--k", "2", "--pass-threshold", "-1")
    assert res["n"] == 4 and res["pass_threshold"] == -1.0
    assert res["pass@2"] == res["sample_pass"] == 1.0
    np.testing.assert_allclose(res["reward_mean"], _greedy_reward_mean(run, 1, 40, 44), rtol=1e-6)
    # A threshold above every reward passes nothing.
    res = _eval(run, capsys, "--k", "2", "--pass-threshold", "1.5")
    assert res["pass@2"] == res["sample_pass"] == 0.0


def test_eval_threshold_refusals(run, capsys, monkeypatch):
    monkeypatch.chdir(run)
    monkeypatch.syspath_prepend(str(run))
    assert main(["eval", str(run / "runs/own"), "--pass-threshold", "nan"]) == 2
    assert "--pass-threshold must be a finite number" in capsys.readouterr().err


def test_a_second_eval_reads_its_programs_from_the_compile_cache(run, tmp_path):
    """`rljax eval` as a user runs it (one device, a process of its own), twice: the first
    call fills the cache folder, the second compiles nothing new and scores the same."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([str(run), *sys.path]), RLJAX_COMPILE_CACHE=str(cache))
    argv = [sys.executable, "-m", "rljax", "eval", "runs/own", "--k", "2"]
    outs, entries = [], []
    for _ in range(2):
        done = subprocess.run(argv, cwd=run, env=env, capture_output=True, text=True,
                              timeout=300)  # a hang guard
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(json.loads(done.stdout))
        entries.append(sorted(p.name for p in cache.iterdir()))
    assert entries[0] and entries[1] == entries[0]
    assert outs[1] == outs[0]


def test_the_compile_cache_stays_off_where_it_must(monkeypatch):
    monkeypatch.delenv("RLJAX_COMPILE_CACHE", raising=False)
    assert use_compile_cache() is None  # this suite's 8 CPU devices: restored programs hang
    monkeypatch.setenv("RLJAX_COMPILE_CACHE", "0")
    assert use_compile_cache() is None
