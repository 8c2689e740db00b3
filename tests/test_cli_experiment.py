"""ExperimentConfig validation and load_experiment (file import, overrides, smoke hook, errors)."""

import dataclasses
import textwrap

import pytest

from rljax.models import ModelConfig
from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig
from rljax.run.experiment_files import available_experiments, load_experiment
from rljax.run.overrides import OverrideError

TINY = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                   num_heads=2, num_kv_heads=1)

EXPERIMENT = textwrap.dedent('''
    import dataclasses
    from rljax.models import ModelConfig
    from rljax.run.experiment import ExperimentConfig, RunConfig

    def config():
        model = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                            num_layers=2, num_heads=2, num_kv_heads=1)
        return ExperimentConfig(name="demo", model=model, run=RunConfig(dir="runs/demo"))

    def smoke(cfg):
        return dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, num_layers=1),
            rl=dataclasses.replace(cfg.rl, steps=2))
''')


def test_validation_names_fields():
    cfg = ExperimentConfig(model=TINY)
    assert cfg.algorithm.name == "grpo" and cfg.sft is None and cfg.tokenizer == "char"
    with pytest.raises(ValueError, match="exactly one of model"):
        ExperimentConfig()
    with pytest.raises(ValueError, match="exactly one of model"):
        ExperimentConfig(model=TINY, hf_path="/x")
    with pytest.raises(ValueError, match="ExperimentConfig.task"):
        ExperimentConfig(model=TINY, task="arithmetic")
    with pytest.raises(ValueError, match="RewardConfig.kind='magic'"):
        RewardConfig(kind="magic")
    with pytest.raises(ValueError, match="model_path"):
        RewardConfig(kind="reward_model")
    with pytest.raises(ValueError, match="RunConfig.overwrite"):
        RunConfig(resume=True, overwrite=True)
    with pytest.raises(ValueError, match="TaskConfig.max_prompt_tokens"):
        TaskConfig(max_prompt_tokens=0)


def test_load_by_path_with_overrides_and_smoke(tmp_path, monkeypatch):
    exp_dir = tmp_path / "experiments"
    exp_dir.mkdir()
    (exp_dir / "demo.py").write_text(EXPERIMENT)
    (exp_dir / "_helper.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    assert available_experiments() == ["demo"]

    cfg = load_experiment(exp_dir / "demo.py", ["optim.lr=3e-4", "rl.steps=50"])
    assert cfg.name == "demo" and cfg.optim.lr == 3e-4 and cfg.rl.steps == 50
    assert cfg.model.num_layers == 2

    # By name; smoke() shrinks the model and steps, explicit overrides still win.
    cfg = load_experiment("demo", ["smoke=true", "optim.lr=1e-5"])
    assert cfg.smoke and cfg.model.num_layers == 1 and cfg.rl.steps == 2 and cfg.optim.lr == 1e-5
    cfg = load_experiment("demo.py", ["smoke=true", "rl.steps=3"])
    assert cfg.rl.steps == 3
    # A smoke run draws no end-of-run plots, unless asked for.
    assert load_experiment("demo", []).run.plots and not cfg.run.plots
    assert load_experiment("demo", ["smoke=true", "run.plots=true"]).run.plots

    with pytest.raises(OverrideError, match=r"valid keys at optim are \[.*'lr'"):
        load_experiment("demo", ["optim.learning_rate=1"])
    with pytest.raises(OverrideError, match="cannot set rl.steps: expected int, got 'many'"):
        load_experiment("demo", ["rl.steps=many"])
    with pytest.raises(OverrideError, match="AlgorithmConfig.name='sgd'"):
        load_experiment("demo", ["algorithm.name=sgd"])


def test_missing_and_malformed_experiments(tmp_path, monkeypatch):
    exp_dir = tmp_path / "experiments"
    exp_dir.mkdir()
    (exp_dir / "demo.py").write_text(EXPERIMENT)
    (exp_dir / "noconfig.py").write_text("x = 1\n")
    (exp_dir / "wrong.py").write_text("def config():\n    return 3\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no experiment 'nope'.*available experiments: \['demo', 'wrong'\]"):
        load_experiment("nope")
    with pytest.raises(TypeError, match="must define config"):
        load_experiment("noconfig")
    with pytest.raises(TypeError, match="returned int"):
        load_experiment("wrong")


def test_config_is_replaceable_and_hashable():
    cfg = ExperimentConfig(model=TINY)
    cfg2 = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, steps=3))
    assert cfg2.rl.steps == 3 and hash(cfg2) != hash(cfg)


def test_config_round_trips_through_run_dir_json(tmp_path):
    import math

    from rljax.train.config import SFTConfig
    from rljax.run.experiment import config_from_dict, load_run_config
    from rljax.run.run_dir import RunDir, config_to_dict

    cfg = ExperimentConfig(model=TINY, sft=SFTConfig(steps=7),
                           run=RunConfig(dir=str(tmp_path / "r")))
    assert math.isinf(cfg.algorithm.dual_clip)  # written as "inf" in JSON
    assert config_from_dict(ExperimentConfig, config_to_dict(cfg)) == cfg
    RunDir(tmp_path / "r", cfg).close()
    assert load_run_config(tmp_path / "r") == cfg
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        config_from_dict(RunConfig, {"bogus": 1})
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        load_run_config(tmp_path)
