"""Errors are the last thing printed (issue 59 item 6): a refused resume, a config error
and a data error end `rljax train`'s stderr with their one message, without library
tracebacks (orbax's "Event loop is closed" from reads still in flight) or advice that
does not apply (orbax's `strict=False`). The commands run as a user runs them, in
subprocesses, side by side. About 15 s on 2 idle cores (a 0-step run, three launches)."""

import io
import json
import os
import subprocess
import sys

import pytest

from _own_task import write_task
from rljax.run.experiment_files import load_experiment
from rljax.run.runner import run_experiment


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A user's task folder (`_own_task`), a run of it (its step-0 checkpoint) and a JSONL
    file whose second line is cut short."""
    root = tmp_path_factory.mktemp("errors_last")
    write_task(root)
    (root / "data" / "cut.jsonl").write_text('{"q": "1+1"}\n{"q": "2+2", "x": \n')
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.syspath_prepend(str(root))
        run_experiment(load_experiment("own_exp.py", ["rl.steps=0"]), out=io.StringIO())
    return root


def _train(root, *sets: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as a user
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    argv = [sys.executable, "-m", "rljax", "train", "own_exp.py", "--set", "rl.steps=0"]
    for s in sets:
        argv += ["--set", s]
    return subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_each_error_is_the_last_line_of_stderr(work):
    cases = {  # what was wrong -> (overrides, what its message says)
        "refused resume": (("run.resume=true", "model.hidden_size=8"),
                           "run.resume: the checkpoint in {run}/checkpoints does not fit this "
                           "config (changed: model.hidden_size: 16 -> 8): params.policy."),
        "config error": (("run.dir=runs/new", "optim.lr=abc"),
                         "cannot set optim.lr: expected float, got 'abc'"),
        "data error": (("run.dir=runs/new", "task.split=data/cut.jsonl"),
                       "data/cut.jsonl:2: not valid JSON (Expecting value at column 19)"),
    }
    procs = {name: _train(work, *sets) for name, (sets, _) in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)  # a hang guard
        lines = err.rstrip("\n").splitlines()
        want = cases[name][1].format(run=work / "runs/own")
        assert proc.returncode == 2, (name, err[-2000:])
        assert lines[-1].startswith(f"rljax train: error: {want}"), (name, err[-2000:])
        assert "Traceback" not in err and "strict=False" not in err, (name, err[-2000:])
    config = json.loads((work / "runs/own/config.json").read_text())["config"]
    assert config["model"]["hidden_size"] == 16  # the refused resume changed nothing
    assert not (work / "runs/new").exists()  # the others made no run directory
