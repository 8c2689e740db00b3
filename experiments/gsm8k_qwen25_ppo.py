"""PPO on GSM8K with Qwen2.5-Instruct (0.5B or 1.5B): the GRPO recipe's PPO counterpart.

PPO for language models (Schulman et al. 2017; Ouyang et al. 2022): a value model
initialised from the policy's backbone with a fresh scalar head, GAE (gamma 1, lambda
0.95), clip 0.2, clipped value loss, and the KL to the reference as a per-token penalty in
the reward (k1, beta = 0.04; an adaptive controller is one override away:
`--set algorithm.adaptive_kl_target=6.0`). One completion per prompt (G = 1), 256
prompts per step, 2 epochs x 2 minibatches. Policy learning rate 1e-6; the value model's
is 10x (verl's GSM8K PPO uses 1e-6 / 1e-5), via `rl.value_lr_ratio`.

Same task, reward and inputs as `gsm8k_qwen25_grpo.py` (verl: Qwen2.5-0.5B-Instruct
49.6% -> 56.7% on GSM8K with PPO).

    rljax train gsm8k_qwen25_ppo --set hf_path=$HOME/models/Qwen2.5-0.5B-Instruct
    rljax train gsm8k_qwen25_ppo --set recipe=1.5b-v5e8     # a named TPU recipe (RECIPES)
    rljax train gsm8k_qwen25_ppo --set smoke=true       # 2 steps on CPU, tiny random Qwen2

TPU recipes: the GRPO recipes' meshes, scanned layers and remat (see there) with PPO's
micro-batches: a minibatch is 128 completions (256 prompts, 2 minibatches) and each update
also runs the value model, whose float32 weights and Adam moments double the trained state.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

from rljax.train.config import algorithm_preset
from rljax.run.experiment import ExperimentConfig


def _grpo_recipe():
    """The GRPO recipe module next to this file (experiments are files, not a package)."""
    path = pathlib.Path(__file__).with_name("gsm8k_qwen25_grpo.py")
    spec = importlib.util.spec_from_file_location("rljax_experiment_gsm8k_qwen25_grpo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config() -> ExperimentConfig:
    """The GRPO recipe with PPO: value model, GAE, KL 0.04 in the reward, lr 1e-6."""
    base = _grpo_recipe().config()
    return dataclasses.replace(
        base,
        name="gsm8k_qwen25_ppo",
        algorithm=algorithm_preset("ppo", kl_coef=0.04, kl_kind="k1", kl_in="reward",
                                   num_epochs=2, num_minibatches=2, micro_batch_size=32),
        rl=dataclasses.replace(base.rl, prompts_per_step=256, value_lr_ratio=10.0),
        run=dataclasses.replace(base.run, dir="runs/gsm8k_qwen25_ppo"),
    )


# The 1.5B on v5e-8 at micro 32 compiled to a 14.40 GiB learning program on 16 GiB chips
# (memory_budget.py, TPU AOT; policy + value state): micro 16 for headroom.
_MICRO = {"1.5b-v5e8": 16}


def _recipes() -> dict:
    """The GRPO recipes' meshes with PPO's micro-batch of 32 (a quarter of a minibatch; 16
    where `_MICRO` says); not the LoRA ones (compiled for GRPO only) nor the packed ones
    (packing needs one minibatch; PPO takes 2)."""
    return {name: dataclasses.replace(r, micro_batch_size=_MICRO.get(name, 32),
                                      why=r.why.split(";")[0]
                                      + f"; micro {_MICRO.get(name, 32)} of 128")
            for name, r in _grpo_recipe().RECIPES.items()
            if r.lora is None and not r.tokens_per_micro_batch}


RECIPES = _recipes()


def recipe(cfg: ExperimentConfig) -> ExperimentConfig:
    """`--set recipe=NAME`: the named TPU recipe of `RECIPES` on top of `cfg`."""
    from rljax.run.recipes import apply_recipe

    if cfg.recipe not in RECIPES:
        raise ValueError(f"recipe={cfg.recipe!r}; allowed: {sorted(RECIPES)}")
    return apply_recipe(cfg, RECIPES[cfg.recipe])


def smoke(cfg: ExperimentConfig) -> ExperimentConfig:
    """`--set smoke=true`: two PPO steps on CPU with a tiny random Qwen2 checkpoint."""
    cfg = _grpo_recipe().smoke_inputs(cfg)
    return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, prompts_per_step=16))


def main(argv: list[str] | None = None) -> int:
    """`python experiments/gsm8k_qwen25_ppo.py [--set k=v ...]` = `rljax train` of this file."""
    from rljax.cli import main as cli_main

    return cli_main(["train", __file__, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
