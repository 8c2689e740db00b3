"""Countdown with DeepSeek-R1-Zero-style rewards, on CPU with a small char-level model.

Task (TinyZero's Countdown): given numbers and a target, write an equation that reaches
the target using each number at most once. The prompt ends inside `<think>` (TinyZero's
template); a completion must close the reasoning and give the equation in tags:

    [7, 4] 28 <think>7 * 4</think><answer>7 * 4</answer>

Reward (R1-Zero, DeepSeek-AI 2025 §2.2.2): an accuracy reward (1 when the tagged equation
evaluates to the target with the given numbers: `rljax.run.tasks.CountdownReward`, which
parses it with `rljax.data.check_countdown`, never `eval`) plus a format reward (0.5 x 1
when the tag layout is followed). Both terms are logged as `reward/accuracy` and
`reward/format`.

A model that has never seen the tags cannot stumble on them by chance within a CPU
budget, so a short SFT warm-up on worked examples gives it partial ability first; then GRPO
(group size 8, no KL, as in R1-Zero-like recipes) learns from the rewards alone.

    rljax train countdown_r1zero                 # or: python experiments/countdown_r1zero.py
    rljax train countdown_r1zero --set smoke=true

A starting point, not a tuned result; measured figures: docs/countdown_r1zero.md.
"""

from __future__ import annotations

import dataclasses
import sys

from rljax.models import ModelConfig
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, SFTConfig, algorithm_preset
from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig

# The char tokenizer's vocabulary: 4 special tokens + printable ASCII + " " and "\n".
CHAR_VOCAB = 100


def config() -> ExperimentConfig:
    """The CPU demo: 2 numbers up to 10, a 4-layer 128-wide char model."""
    return ExperimentConfig(
        name="countdown_r1zero",
        model=ModelConfig(vocab_size=CHAR_VOCAB, hidden_size=128, intermediate_size=384,
                          num_layers=4, num_heads=4, num_kv_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=True),
        tokenizer="char",
        task=TaskConfig(name="countdown", difficulty=2, max_number=10,
                        prompt_template="{numbers} {target} ", assistant_prefix="<think>",
                        sft_template="{solution}</think><answer>{solution}</answer>",
                        max_prompt_tokens=24),
        reward=RewardConfig(kind="accuracy+format", accuracy_weight=1.0, format_weight=0.5,
                            think_in_prompt=True),
        algorithm=algorithm_preset("grpo", group_size=8, kl_coef=0.0, kl_in="none"),
        optim=OptimConfig(lr=5e-5, warmup_steps=10, schedule="constant", clip_norm=1.0),
        sampling=SamplingConfig(max_new_tokens=40, temperature=1.0),
        sft=SFTConfig(steps=120, batch_size=32,
                      optim=OptimConfig(lr=2e-3, warmup_steps=10, schedule="cosine",
                                        min_lr_ratio=0.1)),
        rl=RLConfig(steps=60, prompts_per_step=16, eval_every=20, eval_prompts=128,
                    logp_chunk=64),
        run=RunConfig(dir="runs/countdown_r1zero", seed=0, save_every=20),
    )


def smoke(cfg: ExperimentConfig) -> ExperimentConfig:
    """Two RL steps with a 1-layer model and no SFT warm-up: a quick end-to-end check."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, hidden_size=32, intermediate_size=64, num_layers=1),
        sampling=dataclasses.replace(cfg.sampling, max_new_tokens=12),
        sft=None,
        rl=dataclasses.replace(cfg.rl, steps=2, prompts_per_step=4, eval_every=0, eval_prompts=8),
        algorithm=dataclasses.replace(cfg.algorithm, group_size=4),
        run=dataclasses.replace(cfg.run, dir=cfg.run.dir + "_smoke", save_every=1),
    )


def main(argv: list[str] | None = None) -> int:
    """`python experiments/countdown_r1zero.py [--set k=v ...]` = `rljax train countdown_r1zero`."""
    from rljax.cli import main as cli_main

    return cli_main(["train", __file__, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
