"""GRPO on GSM8K with Llama-3-8B-Instruct on a TPU v5p-64 slice (32 chips): the GSM8K GRPO
recipe (`gsm8k_qwen25_grpo.py`: G = 8, 64 prompts per step, k3 KL 0.04 in the loss,
lr 1e-6, 512 new tokens) at 8B scale.

Mesh fsdp 8 x tensor 4 (`RECIPES["8b-v5p64"]`): Llama-3-8B's 32 query and 8 kv heads and
its 14336-wide MLP split over tensor 4, so a decode step gathers a quarter of the weights
over the 8-way FSDP axis instead of all of them over 32 chips, while the float32 state
(weights 32 GB, Adam 64 GB, reference 32 GB) is still spread over all 32 chips, ~4 GB per
chip. The 512 completions split over the 8 fsdp groups; the learning program
peaks at 19.5 of 95 GiB a chip, so no remat and micro-batches of
128 completions (16 rows per group); 32 layers scanned (`scan_layers=True`, one compiled
layer body), bfloat16 matmuls, splash attention.
Per-chip memory: `experiments/memory_budget.py` (docs/performance.md).

    rljax train gsm8k_llama3_grpo --set hf_path=$HOME/models/Meta-Llama-3-8B-Instruct
    rljax train gsm8k_llama3_grpo --set smoke=true      # 2 steps on CPU, tiny random Llama
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

from rljax.models.lora import LoraConfig
from rljax.run.experiment import ExperimentConfig
from rljax.run.experiment_files import experiment_module
from rljax.run.recipes import Recipe, apply_recipe
from rljax.sharding import MeshConfig

RECIPES = {
    # Sized by memory_budget.py (TPU AOT, --set remat=none rl.remat=false
    # algorithm.micro_batch_size=128): learn peaks at 19.50 of 95 GiB a chip (was 12.53 with
    # remat "full" and micro 64): no recomputed forward, half the per-layer weight gathers.
    "8b-v5p64": Recipe("Meta-Llama-3-8B-Instruct", "v5p-64", MeshConfig(1, 8, 4), 128,
                       remat="none",
                       why="fsdp 8 x tensor 4: heads 32/8 kv and MLP split 4 ways, state "
                           "~4 GB/chip; micro 128 = 16 rows per fsdp group, no remat "
                           "(learn 19.5 of 95 GiB)"),
    # LoRA (docs/lora.md) on 8 v5e chips: the frozen bfloat16 base (16 GB) is 2 GB a chip,
    # no Adam for it, and the reference copies the adapters only. Tensor 8: the sampler's inference copy (split
    # over tensor only) is 2.1 GB a chip; with fsdp 2 x tensor 4 it was 4.2 and the decode
    # program did not fit (19.02 GiB of 16 with the state beside it). Set optim.lr for LoRA.
    "8b-lora-v5e8": Recipe("Meta-Llama-3-8B-Instruct", "v5e-8", MeshConfig(1, 1, 8), 8,
                           lora=LoraConfig(rank=32, alpha=64.0),
                           why="LoRA rank 32: frozen bfloat16 base, reference = adapters copy; tensor "
                               "8 (heads 32/8 kv, MLP split 8 ways); micro 8 rows"),
}


def _grpo_recipe():
    """The Qwen2.5 GRPO recipe module next to this file (experiments are files)."""
    return experiment_module(pathlib.Path(__file__).with_name("gsm8k_qwen25_grpo.py"))


def config() -> ExperimentConfig:
    """The GSM8K GRPO settings with Llama-3-8B-Instruct on v5p-64 (`RECIPES["8b-v5p64"]`)."""
    base = _grpo_recipe().config()
    cfg = dataclasses.replace(base, name="gsm8k_llama3_grpo", recipe="8b-v5p64",
                              run=dataclasses.replace(base.run, dir="runs/gsm8k_llama3_grpo"))
    return apply_recipe(cfg, RECIPES["8b-v5p64"])


def recipe(cfg: ExperimentConfig) -> ExperimentConfig:
    """`--set recipe=NAME`: the named TPU recipe of `RECIPES` on top of `cfg`."""
    if cfg.recipe not in RECIPES:
        raise ValueError(f"recipe={cfg.recipe!r}; allowed: {sorted(RECIPES)}")
    return apply_recipe(cfg, RECIPES[cfg.recipe])


def smoke(cfg: ExperimentConfig) -> ExperimentConfig:
    """`--set smoke=true`: two steps on CPU with a tiny random Llama checkpoint."""
    return _grpo_recipe().smoke_inputs(cfg, architecture="llama")


def main(argv: list[str] | None = None) -> int:
    """`python experiments/gsm8k_llama3_grpo.py [--set k=v ...]` = `rljax train` of this file."""
    from rljax.cli import main as cli_main

    return cli_main(["train", __file__, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
