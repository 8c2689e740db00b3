"""`rljax train --profile-steps` and `run.profile_steps`: parsing, errors, config hash
(the traces themselves: tests/test_cli_train.py and tests/test_throughput.py)."""

import json

import pytest

from rljax.cli import main
from rljax.run.experiment import RunConfig
from test_cli_train import EXPERIMENT  # the tiny experiment (only dry runs here)


def test_run_config_refuses_bad_profile_steps():
    assert RunConfig(profile_steps="3-5,8").profile_steps == "3-5,8"
    with pytest.raises(ValueError, match=r"RunConfig.profile_steps='3-x' is invalid; allowed"):
        RunConfig(profile_steps="3-x")


@pytest.fixture
def exp(tmp_path, monkeypatch):
    (tmp_path / "tiny.py").write_text(EXPERIMENT)
    monkeypatch.chdir(tmp_path)
    return str(tmp_path / "tiny.py")


def test_cli_profile_steps_options(exp, capsys):
    assert main(["train", exp, "--profile-steps", "3-x"]) == 2
    err = capsys.readouterr().err
    assert "profile_steps='3-x' is invalid; allowed: step numbers from 1" in err
    assert main(["train", exp, "--dry-run"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["train", exp, "--dry-run", "--profile-steps", "3-5"]) == 0
    flag = json.loads(capsys.readouterr().out)
    assert main(["train", exp, "--dry-run", "--set", "run.profile_steps=2,4"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["run"]["profile_steps"] == "2,4"
    assert plain["config"]["run"]["profile_steps"] == ""
    assert flag["config"]["run"]["profile_steps"] == "3-5"
    assert flag["config_hash"] == plain["config_hash"]  # a resumed run may change it

