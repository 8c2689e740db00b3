"""A user's own task through the command line (issue 59): a JSONL task, a reward module
with no reference answers and a tiny 2-step run, made in a folder as a user has them.

- `rljax eval` scores with the run's own reward (item 4): the greedy reward mean and
  pass@k at a reward threshold, on the run's held-out file or another one, at any
  checkpoint step.
- Errors are the last thing printed (item 6): a refused resume, a config error and a data
  error end `rljax train`'s stderr with their one message, without library tracebacks
  (orbax's "Event loop is closed" from reads still in flight) or advice that does not
  apply (orbax's `strict=False`).
- A second `rljax eval` reads its programs from JAX's persistent compilation cache
  (item 9).

Commands run in this process through `rljax.cli.main`, or as a user runs them (one
device, a process of their own) where that is the point: the run, three evaluations in
process, four commands; 48 s (46 CPU-s) on 2 cores with other work running."""

import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import TEST_XLA_FLAGS
from rljax.cli import main
from rljax.run.artifacts import PASS_THRESHOLD, sample_texts
from rljax.run.compile_cache import use_compile_cache
from rljax.run.experiment_files import load_experiment
from rljax.run.runner import run_experiment

# Spreads over [0, 1] whatever a tiny random policy writes (a record's `shift` moves it),
# so thresholds separate samples and greedy rewards differ from prompt to prompt.
REWARD = textwrap.dedent('''
    def score(completions, metadata):
        return [(ord(c[0]) + m["shift"]) % 5 / 4 if c else 0.0
                for c, m in zip(completions, metadata)]
''')

EXPERIMENT = textwrap.dedent('''
    from rljax.models import ModelConfig
    from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig
    from rljax.train.config import AlgorithmConfig, RLConfig, SamplingConfig


    def config():
        return ExperimentConfig(
            name="own_reward",
            model=ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                              num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=32),
            tokenizer="char",
            task=TaskConfig(name="jsonl", path="data", prompt_field="q",
                            prompt_template="{q}=", max_prompt_tokens=8),
            reward=RewardConfig(function="own_reward:score", workers=0),
            algorithm=AlgorithmConfig(name="grpo", group_size=2),
            sampling=SamplingConfig(max_new_tokens=2),
            rl=RLConfig(steps=2, prompts_per_step=8, eval_prompts=4, logp_chunk=4),
            run=RunConfig(dir="runs/own", plots=False, tensorboard=False, save_every=1),
        )
''')

#: Record ranges of the data files.
SPLITS = {"train": (0, 24), "test": (30, 34), "other": (40, 46)}


def records(lo: int, hi: int) -> list[dict]:
    """Records ``lo..hi``: a prompt field ``q`` and the reward's ``shift``."""
    return [{"q": f"{i}+{i % 3}", "shift": i % 5} for i in range(lo, hi)]


def write_task(root) -> None:
    """Write ``data/``, ``own_reward.py`` and ``own_exp.py`` into the folder ``root``."""
    (root / "data").mkdir()
    for name, (lo, hi) in SPLITS.items():
        (root / "data" / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records(lo, hi)))
    (root / "own_reward.py").write_text(REWARD)
    (root / "own_exp.py").write_text(EXPERIMENT)


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


def _command(run, *args: str, **env: str) -> subprocess.Popen:
    """`rljax ARGS` (or `python -c CODE ...`) started as a user starts it in the task's
    folder: one device (the suite's cheap-compile flags only), the reward module found as
    `python -m` finds it."""
    env = {**os.environ, **env, "XLA_FLAGS": TEST_XLA_FLAGS,
           "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, *(args if args[0] == "-c" else ("-m", "rljax", *args))]
    return subprocess.Popen(argv, cwd=run, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_each_error_is_the_last_line_of_stderr(run):
    (run / "data" / "cut.jsonl").write_text('{"q": "1+1"}\n{"q": "2+2", "x": \n')
    cases = {  # what was wrong -> (overrides, what its message says)
        "refused resume": (("run.resume=true", "model.hidden_size=8"),
                           f"run.resume: the checkpoint in {run / 'runs/own'}/checkpoints does "
                           "not fit this config (changed: model.hidden_size: 16 -> 8): "
                           "params.policy."),
        "config error": (("run.dir=runs/new", "optim.lr=abc"),
                         "cannot set optim.lr: expected float, got 'abc'"),
        "data error": (("run.dir=runs/new", "task.split=data/cut.jsonl"),
                       "data/cut.jsonl:2: not valid JSON (Expecting value at column 19)"),
    }
    procs = {name: _command(run, "train", "own_exp.py", *[a for s in sets for a in ("--set", s)])
             for name, (sets, _) in cases.items()}  # side by side
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)  # a hang guard
        assert proc.returncode == 2, (name, err[-2000:])
        last = err.rstrip("\n").splitlines()[-1]
        assert last.startswith(f"rljax train: error: {cases[name][1]}"), (name, err[-2000:])
        assert "Traceback" not in err and "strict=False" not in err, (name, err[-2000:])
    config = json.loads((run / "runs/own/config.json").read_text())["config"]
    assert config["model"]["hidden_size"] == 16  # the refused resume changed nothing
    assert not (run / "runs/new").exists()  # the others made no run directory


# Two `rljax eval` calls in one process of a user's kind (one device), the compiled
# programs held in memory dropped in between (one import instead of two: ~5 s here).
TWICE = textwrap.dedent('''
    import contextlib, io, json, pathlib, sys
    import jax
    from rljax.cli import main

    cache, outs, entries = pathlib.Path(sys.argv[1]), [], []
    for _ in range(2):
        jax.clear_caches()
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["eval", "runs/own", "--k", "2"]) == 0
        outs.append(json.loads(out.getvalue()))
        entries.append(sorted(p.name for p in cache.iterdir()))
    print(json.dumps({"outs": outs, "entries": entries}))
''')


def test_a_second_eval_reads_its_programs_from_the_compile_cache(run, tmp_path):
    """The first `rljax eval` fills the cache folder; the second compiles nothing new
    (no entry added) and scores the same."""
    cache = tmp_path / "cache"
    proc = _command(run, "-c", TWICE, str(cache), RLJAX_COMPILE_CACHE=str(cache))
    out, err = proc.communicate(timeout=300)  # a hang guard
    assert proc.returncode == 0, err[-2000:]
    res = json.loads(out.splitlines()[-1])
    assert res["entries"][0] and res["entries"][1] == res["entries"][0]
    assert res["outs"][1] == res["outs"][0]


def test_the_compile_cache_stays_off_where_it_must(monkeypatch):
    monkeypatch.delenv("RLJAX_COMPILE_CACHE", raising=False)
    assert use_compile_cache() is None  # this suite's 8 CPU devices: restored programs hang
    monkeypatch.setenv("RLJAX_COMPILE_CACHE", "0")
    assert use_compile_cache() is None
