"""The `rljax` command line, run in-process: train --dry-run, errors, plot."""

import json
import textwrap

import pytest

from rljax.cli import main
from rljax.run.run_dir import RunDir

EXPERIMENT = textwrap.dedent('''
    from rljax.models import ModelConfig
    from rljax.run.experiment import ExperimentConfig

    def config():
        model = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                            num_layers=1, num_heads=2, num_kv_heads=1)
        return ExperimentConfig(name="demo", model=model)
''')


@pytest.fixture
def exp_dir(tmp_path, monkeypatch):
    d = tmp_path / "experiments"
    d.mkdir()
    (d / "demo.py").write_text(EXPERIMENT)
    monkeypatch.chdir(tmp_path)
    return d


def test_train_dry_run_prints_resolved_config(exp_dir, capsys):
    rc = main(["train", "demo", "--dry-run", "--set", "optim.lr=2e-5", "--set",
               "run.dir=runs/x", "--set", "algorithm.group_size=4"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    cfg = out["config"]
    assert cfg["optim"]["lr"] == 2e-5 and cfg["run"]["dir"] == "runs/x"
    assert cfg["algorithm"]["group_size"] == 4 and len(out["config_hash"]) == 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "nope", "--dry-run"], "no experiment 'nope'.*available experiments: \\['demo'\\]"),
        (["train", "demo", "--dry-run", "--set", "optim.lrr=1"], "unknown key 'optim.lrr'.*'lr'"),
        (["train", "demo", "--dry-run", "--set", "rl.steps=ten"],
         "cannot set rl.steps: expected int, got 'ten'"),
        (["train", "demo", "--dry-run", "--set", "rl.steps"], "key.path=value"),
        (["plot", "no_such_dir"], "no metrics file"),
    ],
)
def test_bad_input_is_one_clear_error(exp_dir, capsys, argv, message):
    import re

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rljax {argv[0]}: error:") and len(err.splitlines()) == 1
    assert re.search(message, err), err


def test_unknown_command_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_plot_command(tmp_path, capsys):
    with RunDir(tmp_path / "run", {"x": 1}) as rd:
        for s in range(4):
            rd.log(s, {"reward_mean": s * 0.25, "kl": 0.01 * s})
    assert main(["plot", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(p.rsplit("/", 1)[1] for p in printed) == ["kl.png", "overview.png", "reward.png"]
    with RunDir(tmp_path / "empty", {"x": 1}) as rd:
        rd.log(0, {"note": "text only"})
    assert main(["plot", str(tmp_path / "empty")]) == 1


def test_plot_seed_and_runtime_failures_exit_1(tmp_path, capsys, monkeypatch):
    with RunDir(tmp_path / "run", {"x": 1}) as rd:
        for s in range(3):
            for k in (0, 1):
                rd.log(s, {"reward_mean": s * 0.25 * (k + 1), "seed": k})
    assert main(["plot", str(tmp_path / "run"), "--seed", "1"]) == 0
    assert main(["plot", str(tmp_path / "run"), "--seed", "7"]) == 2
    assert "hold seeds [0, 1]" in capsys.readouterr().err

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("rljax.cli.plot_metrics", boom)
    assert main(["plot", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "rljax plot: error: RuntimeError: disk on fire" in err
