"""The arithmetic demos' configs build and their smoke settings run end to end on the
8-device mesh through the same call as `rljax train` (tiny model, two steps); PPO's value
model starts from the warmed-up policy."""

import io
import json

import numpy as np
import pytest
from _experiments import load_experiment as experiment_module
from flax import nnx

from rljax.run import builders
from rljax.run.experiment_files import load_experiment
from rljax.run.run_dir import read_metrics
from rljax.run.runner import run_experiment
from rljax.train.programs import CompileLog
from rljax.train.rl import RLTrainer


@pytest.mark.slow
@pytest.mark.parametrize("name, algo", [("arithmetic_grpo", "grpo"), ("arithmetic_ppo", "ppo")])
def test_demo_smoke_runs_and_reports(tmp_path, name, algo, monkeypatch):
    seen = _spy_on_init_state(monkeypatch)
    cfg = load_experiment(name, ["smoke=true", f"run.dir={tmp_path / 'run'}", "run.plots=false",
                                 "run.tensorboard=false"])
    assert cfg.algorithm.name == algo and cfg.rl.steps == 2
    out = io.StringIO()
    res = run_experiment(cfg, out=out)
    assert 0.0 <= res.accuracy_before <= 1.0 and 0.0 <= res.accuracy_after <= 1.0
    last = out.getvalue().strip().splitlines()[-1]
    if name == "arithmetic_grpo":  # two seeds in one program: each program compiled once
        assert last.startswith("RESULT seeds=2 accuracy_before=") and "gain_min=" in last
        assert res.seeds.compiled == {"sft_update": 1, "rl_step": 1, "evaluate": 1}
        _check_baseline_continues_the_warm_up(cfg, res.seeds.warm_state)
    else:
        assert last.startswith("RESULT accuracy_before=")
    if algo == "ppo":  # the value model starts from the policy after the SFT warm-up
        pol, val = seen["policy"], seen["value"]
        backbone = {k[1:]: v for k, v in val.items() if k[0] == "backbone"}
        assert backbone and set(backbone) <= set(pol)
        for k, v in backbone.items():
            np.testing.assert_array_equal(v, pol[k], err_msg=str(k))
        changed = [k for k in backbone if not np.array_equal(pol[k], seen["random"][k])]
        assert changed, "the SFT warm-up changed no weight: the check above proves nothing"


def _check_baseline_continues_the_warm_up(cfg, warm_state):
    """The demo's SFT baseline starts from the warm-up's state (each seed at its own step),
    not from a fresh model: with no time budget it runs exactly the one untimed step, with
    the run's own SFT update and evaluation programs (the demo compiles each once)."""
    assert np.asarray(warm_state.step).tolist() == [cfg.sft.steps] * cfg.run.seeds
    with CompileLog() as log:
        accs, steps = experiment_module("arithmetic_grpo").sft_baseline(cfg, 0.0, warm_state)
    assert steps == 1 and len(accs) == cfg.run.seeds and all(0.0 <= a <= 1.0 for a in accs)
    assert not {"jit(seeds_sft_update)", "jit(seeds_evaluate)"} & set(log.by_name()), log.summary()


def _spy_on_init_state(monkeypatch) -> dict:
    """Records the policy and value parameters `RLTrainer.init_state` receives, and the
    random-init policy `build_model` returned before the warm-up."""
    seen = {}
    flat = lambda s: {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(s)}
    orig_init, orig_build = RLTrainer.init_state, builders.build_model

    def init_state(self, policy_params, seed=0, value_params=None):
        seen["policy"] = flat(policy_params)
        seen["value"] = flat(value_params) if value_params is not None else None
        return orig_init(self, policy_params, seed=seed, value_params=value_params)

    def build_model(*a, **kw):
        model = orig_build(*a, **kw)
        seen["random"] = flat(nnx.state(model))
        return model

    monkeypatch.setattr(RLTrainer, "init_state", init_state)
    monkeypatch.setattr(builders, "build_model", build_model)
    return seen


def test_full_demo_configs_are_valid():
    grpo = load_experiment("arithmetic_grpo")
    assert grpo.algorithm.name == "grpo" and grpo.algorithm.old_logp == "sampler"
    assert grpo.sampling.temperature < 1.0 and grpo.rl.prompts_per_step == 64
    assert grpo.optim.warmup_steps > 0 and grpo.sft is not None
    ppo = load_experiment("arithmetic_ppo")
    assert ppo.algorithm.resolve().kl_in == "reward" and ppo.algorithm.name == "ppo"
    assert ppo.sampling.temperature == 1.0  # PPO keeps its measured setting


@pytest.mark.slow
def test_arithmetic_tool_quick_runs_the_seed_and_the_control(capsys, tmp_path):
    """experiments/arithmetic_tool.py end to end at its smoke size, each run by the run
    loop of `rljax train`: warm-up on tool-use traces, multi-turn GRPO with the calculator,
    the control without it (the same warm-up steps), the RESULT line."""
    tool = experiment_module("arithmetic_tool")
    assert tool.main(["--seeds", "1", "--quick", "--set", f"run.dir={tmp_path}/seed0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("RESULT seeds=1 success_before=") and "control_success=" in lines[-1]
    seed = json.loads(next(ln for ln in lines if ln.startswith("SEED "))[5:])
    ctrl = json.loads(next(ln for ln in lines if ln.startswith("CONTROL "))[8:])
    assert ctrl["sft_steps"] == seed["sft_steps"] >= 1
    assert (tmp_path / "seed0" / "checkpoints").is_dir()
    sft_loss = [[r["sft/loss"] for r in read_metrics(tmp_path / d) if r["phase"] == "sft"]
                for d in ("seed0", "control")]
    assert sft_loss[0] == sft_loss[1]  # the control's warm-up is seed 0's
    with pytest.raises(SystemExit):
        tool.main(["--seeds", "0"])
