"""The main demo: RL visibly improves a small model on a verifiable task, on 2 CPU cores.

2-digit addition ("12+34=" -> "46") with a character tokenizer and a small decoder trained
from scratch:
1. SFT warm-up on worked examples until greedy accuracy on 256 validation prompts reaches
   0.45, so the model has partial ability;
2. held-out greedy accuracy (512 prompts from their own stream, never trained on);
3. GRPO on fresh prompts with the verifier as the only reward (64 prompts x 8 samples a
   step at temperature 0.7, no KL term, lr 2e-4 after a warm-up with a cosine decay to 0.1x,
   60 steps);
4. held-out greedy accuracy again; then, for honesty, what continuing SFT for the RL
   phase's wall time reaches (with perfect worked examples SFT is very efficient here: the
   demo shows RL learning from a verifier, not that RL beats SFT).
Seeds 0-3 train at once, each program vmapped over them (`run.seeds=4`).

Targets: mean held-out accuracy after RL >= 0.75, every seed's gain >= +0.20, mean gain
>= +0.30, warm-up + RL + evaluations under 300 s, the whole command under 480 s. A single
seed's end point moves with the machine's float32 rounding (seed 1 ended at 0.725 on one
machine, 0.852 on another), so no seed's accuracy after RL is promised: the means and the
smallest gain are what hold with margin on every machine measured. The compute-matched
SFT baseline ends above RL (0.844 vs 0.835; 0.807 vs 0.786 on the other machine): the demo
shows RL learning from a verifier, not RL beating SFT. Figures on every machine, the
warm-up's reliability on other seeds and what was tried: docs/arithmetic_grpo.md.

Run: `rljax train arithmetic_grpo` (the RL run only) or
`python experiments/arithmetic_grpo.py [--no-baseline] [--set key=value ...]`.
The last line is `RESULT seeds=4 accuracy_before=<mean> accuracy_after=<mean>
accuracy_after_min=... gain_mean=... gain_min=... wall_s=... sft_baseline_accuracy=...
total_s=...` (no baseline accuracy with `--no-baseline`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np
from flax import nnx

from rljax.models import ModelConfig
from rljax.models.lora import LoraConfig
from rljax.run import builders
from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig
from rljax.run.experiment_files import load_experiment
from rljax.run.run_dir import read_metrics
from rljax.run.report import result_line
from rljax.run.runner import run_experiment
from rljax.run.seed_runs import seed_configs
from rljax.train.batching import encode_pairs
from rljax.train.config import (OptimConfig, RLConfig, SamplingConfig, SFTConfig,
                                algorithm_preset)
from rljax.train.programs import CompileLog
from rljax.train.rl import RLTrainer
from rljax.train.seeds import SeedRL, SeedSFT

VOCAB = 100  # rljax.models.tokenizer.build_char_tokenizer(): 4 specials + 96 characters


def config() -> ExperimentConfig:
    """The demo's frozen config (override any field with `--set a.b=value`)."""
    return ExperimentConfig(
        name="arithmetic_grpo",
        model=ModelConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                          num_layers=2, num_heads=4, num_kv_heads=4,
                          max_position_embeddings=64),
        tokenizer="char",
        task=TaskConfig(name="arithmetic", difficulty=2, ops=("+",), style="plain",
                        max_prompt_tokens=6, sft_template="{solution}"),
        reward=RewardConfig(kind="accuracy"),
        # The warm-up stops once greedy accuracy on 256 validation prompts reaches 0.45
        # (checked every 5 steps), not at a step count or a loss: a fixed count left seeds
        # at 0.22-0.35, and the loss target's starting accuracy moved with the machine's
        # rounding (0.40-0.62 on one VM).
        sft=SFTConfig(steps=500, batch_size=64, stop_accuracy=0.45, stop_every=5,
                      optim=OptimConfig(lr=1e-3, warmup_steps=20, schedule="constant")),
        # GRPO (group-normalised advantages, clip 0.2) without the KL term, as DAPO and
        # Dr.GRPO run it, with a learning-rate warm-up (a constant lr on a fresh Adam state
        # collapsed accuracy to 0). Two minibatch updates per rollout batch, the ratio's
        # denominator from the sampler's exact log-probs (no extra forward pass). Rollouts
        # at temperature 0.7: the samples sit nearer the greedy answer that is evaluated.
        # 64 prompts a step: with 32 and the DeepSeekMath KL 0.04 the gain fell short of
        # +0.30 on every seed once rounding moved (docs/arithmetic_grpo.md).
        algorithm=algorithm_preset("grpo", group_size=8, num_minibatches=2, kl_coef=0.0,
                                   old_logp="sampler"),
        # 60 steps with a cosine decay to 0.1 lr: held-out accuracy still rises at 40-60
        # steps on every seed, and the decay keeps the last steps from moving the end point
        # (at a constant lr one seed fell from 0.816 at step 80 to 0.764 at step 100). At
        # 50 steps seed 1 ended at 0.727 on an AVX-512 machine whose rounding differs
        # (0.777 at 60, 0.764 at 75; docs/arithmetic_grpo.md).
        optim=OptimConfig(lr=2e-4, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1),
        sampling=SamplingConfig(max_new_tokens=4, temperature=0.7),
        rl=RLConfig(steps=60, prompts_per_step=64, eval_prompts=512, logp_chunk=8),
        # Four seeds trained at once: every program is vmapped over them
        # (rljax.run.seed_runs), scored by the arithmetic verifier in JAX.
        run=RunConfig(dir="runs/arithmetic_grpo", seed=0, plots=False, seeds=4),
    )


def smoke(cfg: ExperimentConfig) -> ExperimentConfig:
    """Two RL steps with a tiny one-layer model (for tests of the recipe; each layer is
    compile time)."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, hidden_size=32, intermediate_size=64, num_layers=1),
        sft=dataclasses.replace(cfg.sft, steps=2, batch_size=8),
        rl=dataclasses.replace(cfg.rl, steps=2, prompts_per_step=2, eval_prompts=8),
        run=dataclasses.replace(cfg.run, seeds=min(cfg.run.seeds, 2)),
    )


def sft_baseline(cfg: ExperimentConfig, seconds: float, warm_state=None
                 ) -> tuple[list[float], int]:
    """Held-out accuracy of each seed's SFT continued for about `seconds`, all seeds in one
    program (as the RL phase trains them). With `warm_state` (the run's warm-up state,
    `SeedsResult.warm_state`) SFT continues from where the warm-up stopped, with its
    optimiser moments and each seed's next training examples: the point RL started from.
    Without it (a single-seed run) the warm-up's `sft.steps` are replayed first."""
    if cfg.warms_up_base:  # a LoRA run whose warm-up trained every weight: so does this
        cfg = dataclasses.replace(cfg, lora=LoraConfig(),
                                  sft=dataclasses.replace(cfg.sft, full_parameters=False))
    tok = builders.build_tokenizer(cfg)
    per = seed_configs(cfg) if cfg.run.seeds > 1 else [cfg]
    split = [nnx.split(builders.build_model(c, tok, None))
             for c in (per if warm_state is None else per[:1])]
    graphdef = split[0][0]
    tasks = [builders.build_task(c, tok) for c in per]
    sft = SeedSFT(graphdef, cfg.sft)
    if warm_state is None:
        state = sft.init_state([p for _, p in split], [c.run.seed for c in per])
        first, untimed = np.zeros(len(per), int), cfg.sft.steps
    else:  # each seed's next examples are those after its own warm-up steps
        state, first, untimed = warm_state, np.asarray(warm_state.step), 1
    bs, step, deadline = cfg.sft.batch_size, 0, None
    while deadline is None or time.perf_counter() < deadline:
        batches = [encode_pairs(tok, *t.sft(int(first[k] + step) * bs, bs),
                                cfg.task.max_prompt_tokens, cfg.sampling.max_new_tokens)
                   for k, t in enumerate(tasks)]
        state, _ = sft.step(state, batches, [True] * len(per))
        step += 1
        if step == untimed:  # warm-up replayed, or the update compiled: now RL's time
            deadline = time.perf_counter() + seconds
    ev = SeedRL(RLTrainer(graphdef, tok, builders.build_device_reward(cfg, tok),
                          algorithm=cfg.algorithm, optim=cfg.optim, sampling=cfg.sampling,
                          rl=cfg.rl, prompt_len=cfg.task.max_prompt_tokens))
    res = ev.evaluate(state.params["policy"], [t.eval_prompts for t in tasks],
                      [t.eval_metadata for t in tasks])
    return [r["accuracy"] for r in res], step - (cfg.sft.steps if warm_state is None else 0)


def main(argv=None) -> int:
    """Run the demo; print each seed's before/after accuracy, their mean and spread, the
    SFT baseline and the RESULT line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-baseline", action="store_true", help="skip the SFT baseline")
    args = ap.parse_args(argv)
    cfg = load_experiment(__file__, args.set)  # as `rljax train` reads it (smoke=true too)
    with CompileLog() as log:
        values = _run(cfg, args.no_baseline)
    print(f"compilations, whole command: {log.summary()}")
    print(result_line(values))
    return 0


def _run(cfg: ExperimentConfig, no_baseline: bool) -> dict:
    """The run, each seed's figures and the baseline; returns the RESULT line's values."""
    t0 = time.perf_counter()
    res = run_experiment(cfg)
    if res.seeds is not None:
        values, rl_seconds = res.seeds.result, res.seeds.rl_s
        before, after = np.array(res.seeds.accuracy_before), np.array(res.seeds.accuracy_after)
        for s, b, a in zip(res.seeds.seeds, before, after):
            print(f"seed {s}: held-out greedy accuracy {b:.3f} -> {a:.3f} ({a - b:+.3f})")
        print(f"mean over {len(before)} seeds: {before.mean():.3f} -> {after.mean():.3f} "
              f"(gain {values['gain_mean']:+.3f}, spread of the gain "
              f"{(after - before).std():.3f}); run {res.wall_s:.1f} s")
    else:
        values = {"accuracy_before": res.accuracy_before, "accuracy_after": res.accuracy_after,
                  "wall_s": res.wall_s}
        rl_seconds = _rl_seconds(res.run_dir)
        print(f"held-out greedy accuracy: before GRPO {res.accuracy_before:.3f}, after "
              f"{res.accuracy_after:.3f} (gain {res.accuracy_after - res.accuracy_before:+.3f}); "
              f"run {res.wall_s:.1f} s")
    if not no_baseline:
        t1 = time.perf_counter()
        warm = res.seeds.warm_state if res.seeds is not None else None
        accs, steps = sft_baseline(cfg, rl_seconds, warm)
        print(f"honesty baseline: SFT continued for the RL phase's {rl_seconds:.1f} s "
              f"({steps} more SFT steps, {time.perf_counter() - t1:.1f} s with its build and "
              f"evaluation) reaches {np.mean(accs):.3f} mean held-out accuracy (GRPO reached "
              f"{values['accuracy_after']:.3f} from the verifier alone)")
        values["sft_baseline_accuracy"] = float(np.mean(accs))
    values["total_s"] = time.perf_counter() - t0
    print(f"total wall time including baseline: {values['total_s']:.1f} s")
    return values


def _rl_seconds(run_dir: str) -> float:
    """Wall time of the RL steps, from the run's metrics (sum of per-phase times)."""
    rows = [r for r in read_metrics(run_dir) if r.get("phase") == "rl"]
    return float(sum(v for r in rows for k, v in r.items() if k.startswith("time_")))


if __name__ == "__main__":
    sys.exit(main())
