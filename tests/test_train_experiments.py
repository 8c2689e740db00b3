"""The arithmetic demos' configs build and their smoke settings run end to end on the
8-device mesh through the same call as `rljax train` (tiny model, two steps)."""

import io

import pytest

from rljax.train.experiment import load_experiment
from rljax.train.runner import run_experiment


@pytest.mark.slow
@pytest.mark.parametrize("name, algo", [("arithmetic_grpo", "grpo"), ("arithmetic_ppo", "ppo")])
def test_demo_smoke_runs_and_reports(tmp_path, name, algo):
    cfg = load_experiment(name, ["smoke=true", f"run.dir={tmp_path / 'run'}", "run.plots=false",
                                 "run.tensorboard=false"])
    assert cfg.algorithm.name == algo and cfg.rl.steps == 2
    out = io.StringIO()
    res = run_experiment(cfg, out=out)
    assert 0.0 <= res.accuracy_before <= 1.0 and 0.0 <= res.accuracy_after <= 1.0
    assert out.getvalue().strip().splitlines()[-1].startswith("RESULT accuracy_before=")


def test_full_demo_configs_are_valid():
    grpo = load_experiment("arithmetic_grpo")
    assert grpo.algorithm.kl_coef == 0.04 and grpo.algorithm.kl_kind == "k3"
    assert grpo.optim.warmup_steps > 0 and grpo.sft is not None
    ppo = load_experiment("arithmetic_ppo")
    assert ppo.algorithm.kl_in == "reward" and ppo.algorithm.name == "ppo"
