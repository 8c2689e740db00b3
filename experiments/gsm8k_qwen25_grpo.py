"""GRPO on GSM8K with Qwen2.5-Instruct (0.5B or 1.5B), DeepSeekMath-style: a Cloud TPU recipe.

Settings (DeepSeekMath, Shao et al. 2024, §4.1 and §4.2): group-normalised advantages,
clip 0.2, KL to the reference in the loss with the k3 estimator and beta = 0.04, learning
rate 1e-6 (constant after a short warm-up). DeepSeekMath samples 64 outputs per question;
this recipe uses a group size of G = 8 with 64 questions per step (512 completions per
step) to fit one v5litepod-8 host; raise `algorithm.group_size` on bigger slices.

Reward: 1 when the answer extracted from the completion (last `\\boxed{}`, else GSM8K's
`#### n`, else "the answer is ...") equals the reference (`rljax.rewards.math_equal`),
else 0. Reference points (verl's published runs): Qwen2.5-0.5B-Instruct scores 49.6% on
GSM8K before RL and 56.7% after PPO.

Inputs (nothing is downloaded): the HF checkpoint folder at `hf_path` and GSM8K's JSONL
release (`train.jsonl`, `test.jsonl`) at `task.path`; see tpu_setup/README.md.

    rljax train gsm8k_qwen25_grpo --set hf_path=$HOME/models/Qwen2.5-1.5B-Instruct
    rljax train gsm8k_qwen25_grpo --set recipe=1.5b-v5e16   # a named TPU recipe (RECIPES)
    rljax train gsm8k_qwen25_grpo --set smoke=true      # 2 steps on CPU, tiny random Qwen2

TPU recipes (`RECIPES`; per-chip memory of each program checked by compiling it for the
slice ahead of time: `experiments/memory_budget.py`, figures in docs/performance.md).
Common to all: bfloat16 matmuls (float32 master weights, Adam moments and log-probs),
splash attention,
scanned layers (`scan_layers=True`: the 24 / 28 layers are one `[L, ...]` stack run as one
`lax.scan`, so the programs compile in the time of one layer, not of 24-28 unrolled ones;
the config and its checkpoints use that layout, HF folders load and export unchanged),
each layer rematerialised in the backward pass (`remat="full"`: the scan keeps only each
layer's input of a 832-token micro-batch, not its attention and MLP activations), the lm
head in 128-position chunks (a [rows, 128, 151936] float32 block instead of
[rows, 832, 151936]).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

from rljax.models.lora import LoraConfig
from rljax.run.recipes import Recipe, apply_recipe
from rljax.sharding import MeshConfig
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig

INSTRUCTION = "{prompt}\nLet's think step by step and output the final answer after \"####\"."


def config() -> ExperimentConfig:
    """Qwen2.5-0.5B-Instruct, GRPO, G = 8, KL 0.04 (k3, in the loss), lr 1e-6."""
    return ExperimentConfig(
        name="gsm8k_qwen25_grpo",
        hf_path=os.path.expanduser("~/models/Qwen2.5-0.5B-Instruct"),
        compute_dtype="bfloat16",
        scan_layers=True,  # 24-28 layers: one scanned body compiles fast (module docstring)
        remat="full",
        tokenizer=None,  # the checkpoint's own tokenizer and chat template
        task=TaskConfig(name="gsm8k", path=os.path.expanduser("~/data/gsm8k"), split="train",
                        eval_split="test", prompt_field="question", answer_field="answer",
                        prompt_template=INSTRUCTION, chat_template=True, max_prompt_tokens=320),
        reward=RewardConfig(kind="accuracy", answer_mode="auto"),
        algorithm=algorithm_preset("grpo", group_size=8, kl_coef=0.04, kl_kind="k3",
                                   micro_batch_size=32),
        optim=OptimConfig(lr=1e-6, warmup_steps=10, schedule="constant", weight_decay=0.0,
                          clip_norm=1.0),
        sampling=SamplingConfig(max_new_tokens=512, temperature=1.0),
        rl=RLConfig(steps=200, prompts_per_step=64, eval_every=25, eval_prompts=1319,
                    remat=True, logp_chunk=128),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        run=RunConfig(dir="runs/gsm8k_qwen25_grpo", seed=0, save_every=25, keep=3),
    )


# 512 completions per step split over data x fsdp. Qwen2.5's 14 (0.5B) or 12 (1.5B) query
# heads and 2 kv heads split over tensor <= 2 only (rljax replicates what does not divide),
# so the 0.5B runs pure FSDP: its float32 state with the reference (~8 GB) is 1 GB per
# chip on 8 chips, and tensor parallelism would only add collectives.
RECIPES = {
    # Micro 64 (8 rows/chip) compiled to a 15.79 GiB learning program on 16 GiB chips with
    # unrolled layers, hence 32. The scanned, shared-prompt program (memory_budget.py, TPU
    # AOT): micro 32 3.29, 64 4.47, 128 7.09 GiB a chip; 32 kept until the larger ones
    # are timed on a TPU.
    "0.5b-v5e8": Recipe("Qwen2.5-0.5B-Instruct", "v5e-8", MeshConfig(1, 8, 1), 32,
                        why="pure FSDP: state 1 GB/chip; micro 32 = 4 rows/chip"),
    # The sampler's inference copy is replicated over fsdp: 3.31 GiB/chip with pure FSDP
    # (1, 8, 1), its matmul weights in bfloat16 (docs/recipes.md). Tensor 2 splits it
    # (and the head) in two: 1.66 GiB/chip, and half the weight bytes a decode step reads
    # per chip. (1, 8, 1) fits too (decode 6.18 + 2.88 GiB resident); tensor 2 kept until
    # the two are timed on a TPU.
    "1.5b-v5e8": Recipe("Qwen2.5-1.5B-Instruct", "v5e-8", MeshConfig(1, 4, 2), 32,
                        why="fsdp 4 x tensor 2: the sampler's inference copy is split over "
                            "tensor (1.66 GiB/chip, not 3.31); micro 32 = 8 rows per fsdp "
                            "group"),
    "0.5b-v5e16": Recipe("Qwen2.5-0.5B-Instruct", "v5e-16", MeshConfig(1, 16, 1), 64,
                         why="pure FSDP over 16 chips; micro 64 = 4 rows/chip"),
    "1.5b-v5e16": Recipe("Qwen2.5-1.5B-Instruct", "v5e-16", MeshConfig(1, 8, 2), 64,
                         why="fsdp 8 x tensor 2 (the 2 kv heads split): half the weight "
                             "gathers per decode step; micro 64 = 8 rows per fsdp shard"),
    # Two v5e-16 slices over DCN (a multislice job): the data axis splits over the slices,
    # so parameters are replicated across them and the gradient crosses DCN once a step.
    "0.5b-v5e16x2": Recipe("Qwen2.5-0.5B-Instruct", "v5e-16x2", MeshConfig(2, 16, 1), 64,
                           why="data 2 (one per slice, over DCN) x fsdp 16; micro 64 = 2 "
                               "rows/chip"),
    # Packed (docs/packing.md): each completion's real tokens packed into rows of 320 + 512
    # slots; a micro-batch is 32 packed rows (26,624 slots, as micro 32 padded) that hold
    # ~2-3 GSM8K completions each, so fewer micro-batches a step.
    "0.5b-v5e8-packed": Recipe("Qwen2.5-0.5B-Instruct", "v5e-8", MeshConfig(1, 8, 1), 0,
                               tokens_per_micro_batch=32 * 832,
                               why="pure FSDP; packed rows, 26,624 token slots a micro-batch "
                                   "= 4 packed rows/chip"),
    # LoRA (docs/lora.md): the base frozen in bfloat16 (3.1 GB), Adam for the adapters
    # only, the KL reference a copy of the adapters on the base. Set optim.lr for LoRA.
    "1.5b-lora-v5e4": Recipe("Qwen2.5-1.5B-Instruct", "v5e-4", MeshConfig(1, 2, 2), 32,
                             lora=LoraConfig(rank=32, alpha=64.0),
                             why="LoRA rank 32: frozen bfloat16 base, reference = adapters copy; fsdp "
                                 "2 x tensor 2; micro 32 = 16 rows per fsdp group"),
}


def recipe(cfg: ExperimentConfig) -> ExperimentConfig:
    """`--set recipe=NAME`: the named TPU recipe of `RECIPES` on top of `cfg`."""
    if cfg.recipe not in RECIPES:
        raise ValueError(f"recipe={cfg.recipe!r}; allowed: {sorted(RECIPES)}")
    return apply_recipe(cfg, RECIPES[cfg.recipe])


def smoke_inputs(cfg: ExperimentConfig, root: str | None = None,
                 architecture: str = "qwen2") -> ExperimentConfig:
    """`cfg` pointed at a tiny random `architecture` checkpoint and a small GSM8K-format set, made
    now in a temporary folder, with two RL steps of a few short completions."""
    from rljax.run.smoke import make_tiny_hf_checkpoint, write_gsm8k_like

    root = root or tempfile.mkdtemp(prefix="rljax_smoke_")
    ckpt = make_tiny_hf_checkpoint(os.path.join(root, f"tiny-{architecture}"),
                                   architecture=architecture)
    data = write_gsm8k_like(os.path.join(root, "gsm8k"))
    return dataclasses.replace(
        cfg, hf_path=str(ckpt), compute_dtype="float32", attention="xla", remat="none",
        # A recipe's mesh on the CPU's devices: fsdp takes what tensor (at most 2) leaves.
        mesh=MeshConfig(data=1, fsdp=-1, tensor=min(cfg.mesh.tensor, 2)),
        task=dataclasses.replace(cfg.task, path=str(data), max_prompt_tokens=144),
        algorithm=dataclasses.replace(
            cfg.algorithm, group_size=min(cfg.algorithm.resolve().group_size, 4),
            micro_batch_size=0),
        sampling=dataclasses.replace(cfg.sampling, max_new_tokens=8),
        rl=dataclasses.replace(cfg.rl, steps=2, prompts_per_step=4, eval_every=0,
                               eval_prompts=8, remat=False, logp_chunk=8),
        run=dataclasses.replace(cfg.run, dir=cfg.run.dir + "_smoke", save_every=1),
    )


def smoke(cfg: ExperimentConfig) -> ExperimentConfig:
    """`--set smoke=true`: two steps on CPU with a tiny random Qwen2 checkpoint."""
    return smoke_inputs(cfg)


def main(argv: list[str] | None = None) -> int:
    """`python experiments/gsm8k_qwen25_grpo.py [--set k=v ...]` = `rljax train` of this file."""
    from rljax.cli import main as cli_main

    return cli_main(["train", __file__, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
