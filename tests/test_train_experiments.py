"""The arithmetic demos' configs build and their smoke settings run end to end on the
8-device mesh through the same call as `rljax train` (tiny model, two steps)."""

import io

import pytest

from rljax.run.experiment import load_experiment
from rljax.run.runner import run_experiment


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
    assert grpo.algorithm.name == "grpo" and grpo.algorithm.old_logp == "sampler"
    assert grpo.sampling.temperature < 1.0 and grpo.rl.prompts_per_step == 64
    assert grpo.optim.warmup_steps > 0 and grpo.sft is not None
    ppo = load_experiment("arithmetic_ppo")
    assert ppo.algorithm.resolve().kl_in == "reward" and ppo.algorithm.name == "ppo"
    assert ppo.sampling.temperature == 1.0  # PPO keeps its measured setting


@pytest.mark.slow
def test_ppo_value_model_starts_from_the_warmed_up_policy(tmp_path, monkeypatch):
    import numpy as np
    from flax import nnx

    from rljax.train.rl import RLTrainer

    seen = {}
    orig = RLTrainer.init_state

    def spy(self, policy_params, seed=0, value_params=None):
        flat = lambda s: {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(s)}
        seen["policy"], seen["value"] = flat(policy_params), flat(value_params)
        return orig(self, policy_params, seed=seed, value_params=value_params)

    monkeypatch.setattr(RLTrainer, "init_state", spy)
    cfg = load_experiment("arithmetic_ppo", ["smoke=true", f"run.dir={tmp_path / 'run'}",
                                             "run.plots=false", "run.tensorboard=false",
                                             "rl.steps=1", "sft.optim.lr=0.01"])
    run_experiment(cfg, out=io.StringIO())
    pol, val = seen["policy"], seen["value"]
    backbone = {k[1:]: v for k, v in val.items() if k[0] == "backbone"}
    assert backbone and set(backbone) <= set(pol)
    for k, v in backbone.items():  # a copy of the policy AFTER the SFT warm-up
        np.testing.assert_array_equal(v, pol[k], err_msg=str(k))
