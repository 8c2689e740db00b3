"""The recipes' smoke settings: `rljax train RECIPE --set smoke=true` runs two RL steps on
CPU (the GSM8K recipes with a tiny random Qwen2 checkpoint and GSM8K-format data made on
the fly) and ends with the RESULT line."""

import pathlib
import re

import pytest

from rljax.cli import main
from rljax.run.experiment_files import load_experiment
from rljax.run.run_dir import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_recipe_configs_state_their_settings():
    grpo = load_experiment(ROOT / "experiments/gsm8k_qwen25_grpo.py")
    assert (grpo.algorithm.name, grpo.algorithm.group_size, grpo.algorithm.kl_coef,
            grpo.algorithm.kl_kind, grpo.optim.lr) == ("grpo", 8, 0.04, "k3", 1e-6)
    assert "Qwen2.5-0.5B-Instruct" in grpo.hf_path and grpo.task.name == "gsm8k"
    ppo = load_experiment(ROOT / "experiments/gsm8k_qwen25_ppo.py")
    assert (ppo.algorithm.name, ppo.algorithm.kl_in, ppo.algorithm.kl_coef, ppo.optim.lr) == \
        ("ppo", "reward", 0.04, 1e-6)
    # Overrides pick the 1.5B model and the mesh.
    big = load_experiment(ROOT / "experiments/gsm8k_qwen25_grpo.py",
                          ["hf_path=/m/Qwen2.5-1.5B-Instruct", "mesh.fsdp=4", "mesh.tensor=2"])
    assert big.hf_path.endswith("1.5B-Instruct") and (big.mesh.fsdp, big.mesh.tensor) == (4, 2)


@pytest.mark.parametrize("recipe", ["gsm8k_qwen25_grpo", "gsm8k_qwen25_ppo", "countdown_r1zero"])
def test_smoke_runs_two_steps(recipe, tmp_path, capsys):
    run_dir = tmp_path / recipe
    rc = main(["train", str(ROOT / f"experiments/{recipe}.py"), "--set", "smoke=true",
               "--set", f"run.dir={run_dir}"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT accuracy_before=\S+ accuracy_after=\S+ wall_s=\S+", last), last
    rl = [r for r in read_metrics(run_dir) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    if recipe == "gsm8k_qwen25_ppo":
        assert {"value_loss", "grad_norm_value", "kl_coef"} <= set(rl[0])
    if recipe == "countdown_r1zero":
        assert {"reward/accuracy", "reward/format"} <= set(rl[0])


@pytest.mark.parametrize("experiment", ["gsm8k_qwen25_grpo", "gsm8k_qwen25_ppo",
                                        "gsm8k_llama3_grpo"])
def test_tpu_recipes_cover_their_slice(experiment):
    """Each named TPU recipe: a mesh over exactly its slice's chips, micro-batches that
    divide the minibatch and split over data x fsdp; its smoke version runs on CPU."""
    from rljax.run.experiment_files import experiment_module

    recipes = experiment_module(ROOT / f"experiments/{experiment}.py").RECIPES
    assert recipes
    for name, rec in recipes.items():
        cfg = load_experiment(ROOT / f"experiments/{experiment}.py", [f"recipe={name}"])
        data, fsdp, tensor = cfg.mesh.resolve(rec.tpu.chips)
        assert cfg.hf_path.endswith(rec.model) and cfg.attention == "splash"
        # Scanned layers: 24-32 layers compile as one body; remat as the recipe's sizing
        # chose it (memory_budget.py), "none" only where it fits.
        assert (cfg.scan_layers, cfg.remat, cfg.rl.remat) == (True, rec.remat,
                                                              rec.remat != "none")
        assert rec.model_config().scan_layers and rec.model_config().remat == rec.remat
        a = cfg.algorithm.resolve()
        minibatch = cfg.rl.prompts_per_step * a.group_size // a.num_minibatches
        if rec.tokens_per_micro_batch:  # packed: whole packed rows per batch shard
            width = cfg.task.max_prompt_tokens + cfg.sampling.max_new_tokens
            assert a.micro_batch_size == 0 and a.num_minibatches == 1
            assert cfg.rl.tokens_per_micro_batch == rec.tokens_per_micro_batch
            assert (rec.tokens_per_micro_batch // width) % (data * fsdp) == 0
        else:
            assert minibatch % a.micro_batch_size == 0
            assert a.micro_batch_size % (data * fsdp) == 0
        smoke = load_experiment(ROOT / f"experiments/{experiment}.py",
                                [f"recipe={name}", "smoke=true"])
        assert smoke.attention == "xla" and 8 % smoke.mesh.tensor == 0
        assert smoke.scan_layers and smoke.remat == "none"  # the smoke runs scanned on CPU
