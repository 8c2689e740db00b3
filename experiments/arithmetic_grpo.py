"""The main job: RL visibly improves a small model on a verifiable task, on 2 CPU cores.

2-digit addition ("12+34=" -> "46"), a character tokenizer and a small decoder trained
from scratch:

1. a short SFT warm-up on worked examples (until greedy accuracy on 256 validation
   prompts reaches 0.45), so the model has partial ability;
2. held-out greedy accuracy (512 prompts from their own stream, never trained on);
3. GRPO (clipped, group-normalised, no KL term, 64 prompts x 8 samples at temperature 0.7
   a step, with a learning-rate warm-up) on fresh prompts (RL reads its own prompt
   stream, not the warm-up's), with only the verifier as reward: no reference completions;
4. held-out greedy accuracy again.

For honesty it then measures what continuing SFT for the same wall time reaches (with
perfect worked examples SFT is very efficient on a task like this; the demo shows RL
learning from a verifier, not that RL beats SFT here). The SFT schedule is constant after
its warm-up, so a longer SFT run from the same seed *is* the continuation.

Why 2 digits: on 3-digit addition the warm-up sits on a loss plateau (~1.2-1.5 nats,
accuracy ~0) for a seed-dependent 300-600+ steps -- seeds 1 and 2 had not left it after
400-500 steps with lr 1e-3 / 2e-3 / 3e-3, b2 0.98, batch 32 / 64, hidden 128 x 4 layers x
8 heads, or the answer written least-significant digit first (`task.style=reversed`), and
after leaving it accuracy rose slowly (0.09-0.11 after 800 steps). 2-digit addition leaves
the plateau within ~150-250 steps on every seed tried.

Measured 2026-12-02, seeds run one after another, `--no-baseline` (wall = the whole run,
compilation included), 512 held-out prompts:

  seed 0: 0.352 -> 0.834 (+0.482); 0.65 / 0.77 / 0.73 after 25 / 50 / 75 steps; 136 s
          (load average 4-5: another engineer's benchmark was running)
  seed 1: 0.350 -> 0.801 (+0.451); 0.69 / 0.79 / 0.81; 153 s (load average ~3.5-4)
  seed 2: 0.217 -> 0.568 (+0.351); 0.45 / 0.51 / 0.55; 96 s (load average ~2, mostly this
          run) -- NOT meeting the 0.75 target: from its weaker start GRPO gains slowly.
          More RL steps do not rescue it: with rl.steps=250 it reads 0.57 / 0.62 / 0.56
          after 150 / 175 / 200 steps and 0.643 after 250 (249 s). A seed-robust
          start (an SFT length set by the training loss rather than a step count) is
          the open fix.

That was with a fixed 250-step warm-up. The config then stopped the warm-up once the mean
training loss of the last 20 steps was below 0.45 (`sft.stop_loss`, at most 400 steps).
Measured 2026-12-02 15:00-15:07 UTC, seeds one after another, machine otherwise idle
(load ~1, this run only), `--no-baseline`:

  seed 0: warm-up stops at step 260; 0.459 -> 0.816 (+0.357); 100 s
  seed 1: warm-up stops at step 265; 0.473 -> 0.850 (+0.377); 100 s
  seed 2: warm-up stops at step 318; 0.443 -> 0.801 (+0.357); 109 s

So the target (>= 0.75 and >= +0.30 on each of 3 seeds, < 5 minutes) was met on all three
with that config on that VM. (Fixed 280 / 320 steps: seed 2 0.381 -> 0.645 / 0.459 ->
0.785; seeds 0 and 1 at 320 steps start at 0.73 / 0.70 and gain only +0.16 / +0.23.)
Runs are reproducible on one machine: seed 2 gave the same 0.2168 -> 0.5684 twice.
GRPO lr 2e-4 was worse than 1e-4 (seed 2: 0.49, seed 0: 0.77 after 120 steps, noisier).
The SFT honesty baseline (seed 0, with the baseline on): SFT continued for the RL phase's
63.5 s (603 more steps) reaches 0.910 held-out accuracy; GRPO reached 0.816.
The trajectories are sensitive to rounding: storing lm_head as [V, D] (same values, a
differently ordered logits dot) moved the warm-up's stop and the starting accuracy, and
seeds 1 / 2 then gained only +0.21 / +0.24 (0.619 -> 0.824, 0.504 -> 0.740).

On a second VM the same evening (about half as fast, a different CPU, so different
rounding) the loss target stopped seeds 0 / 1 / 2 at steps 249 / 293 / 322 and they went
0.5625 -> 0.832 (+0.270), 0.617 -> 0.873 (+0.256), 0.400 -> 0.772 (+0.371): the target
missed on seeds 0 and 1, because the loss at which the model reaches a given accuracy
moved. So the warm-up now stops at an accuracy target instead: greedy accuracy on 256
validation prompts (their own stream, never the held-out ones) >= 0.45, checked every 5
steps (`sft.stop_accuracy`). Measured on that VM, seeds one after another:

  seed 0: stops at step 240 (validation 0.473); 0.459 -> 0.777 (+0.318); 276 s beside a
          test run; re-run alone later: the same accuracies in 129 s (the VM sped up)
  seed 1: stops at step 280 (0.461); 0.447 -> 0.877 (+0.430); 223 s
  seed 2: stops at step 290 (0.465); 0.393 -> 0.672 (+0.279); 237 s -- NOT meeting the
          0.75 target

The start is now held within 0.39-0.46 (the loss target gave 0.40-0.62 there); seed 2's
RL phase is the weak part on that VM: 0.73 after 140 steps, and KL 0 / lr 1.5e-4 / two
epochs per batch reach 0.727 / 0.695 / 0.645 after 100. Stopping at 0.50 started it at
0.543 and reached 0.77 (+0.23). Not measured on the first VM.

Later the same evening, after attention changes that alter float32 rounding (same VM,
same config), the trajectories moved: seeds 0 / 1 / 2 stop the warm-up at steps 255 / 295
/ 290 (validation 0.496 / 0.578 / 0.461) and go 0.514 -> 0.797 (+0.283), 0.541 -> 0.799
(+0.258), 0.469 -> 0.690 (+0.221): no seed meets both targets (re-run of seed 0 with the
final code: identical). No tried change helped (seeds 0-1): 130 RL steps (0.785), 130
steps at lr 1.5e-4 (0.789), a warm-up stop at 0.40 checked every 2 steps (0.348 -> 0.734,
0.434 -> 0.662). Closest: rl.prompts_per_step=64, seeds 0 / 1 / 2 0.514 -> 0.822, 0.541 ->
0.891, 0.469 -> 0.738 (seed 2 still short; 322-487 s, over budget). The open fix is an RL
phase stronger than the spread of its starts.

The current config (2026-12-03, same VM, seeds one after another, machine otherwise idle,
`--no-baseline`) makes the RL phase stronger: 64 prompts a step, no KL term (so no
reference model), lr 2e-4, the sampler's log-probs as the ratio's denominator, rollouts at
temperature 0.7. The warm-up is unchanged, so the starts are the same as above:

  seed 0: 0.514 -> 0.844 (+0.330); 175 s
  seed 1: 0.541 -> 0.859 (+0.318); 189 s
  seed 2: 0.469 -> 0.779 (+0.311); 178 s
  seed 3: 0.516 -> 0.871 (+0.355); 180 s (not used while choosing the config)
  seeds 4 and 5 (not used either; the next day, slower VM): 0.486 -> 0.922 (+0.436), 212 s;
  0.385 -> 0.758 (+0.373), 219 s

With the sampler's CPU kernels (rljax.kernels, 2026-12-03, same config; only float32
rounding in the rollouts changes, the warm-up stops at the same steps), seeds 0-5:
0.514 -> 0.816 (+0.303), 0.541 -> 0.885 (+0.344), 0.469 -> 0.752 (+0.283, short of +0.30
by 0.017), 0.516 -> 0.883 (+0.367), 0.486 -> 0.918 (+0.432), 0.385 -> 0.750 (+0.365);
208-230 s each, rollouts 18-20 s of them. Not re-tuned.

Steps on the way, seed 2 only: 64 prompts + sampler log-probs, 0.746; then KL 0 and lr
2e-4, 0.750; then temperature 0.7, 0.779. The margins over +0.30 are 0.01-0.03 on the
seeds that chose the config: a future change in rounding can still move a seed under it.
The end point is noisy: 120 steps instead of 100 gave seed 2 0.754 (lower than at 100)
and seed 1 0.897, 200 s each. The RL phase is ~115 s of the ~180 s, nearly all of it
policy updates (100 s for 200 updates of 256 sequences; ~60 GFLOP/s on the 2 cores).

Run: `rljax train arithmetic_grpo` (the RL run only) or
`python experiments/arithmetic_grpo.py [--no-baseline] [--set key=value ...]`.
The last line is `RESULT accuracy_before=... accuracy_after=... wall_s=...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from rljax.models import ModelConfig
from rljax.train.config import (OptimConfig, RLConfig, SamplingConfig, SFTConfig,
                                algorithm_preset)
from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig

VOCAB = 100  # rljax.models.tokenizer.build_char_tokenizer(): 4 specials + 96 characters


def config() -> ExperimentConfig:
    """The demo's frozen config (override any field with `--set a.b=value`)."""
    return ExperimentConfig(
        name="arithmetic_grpo",
        model=ModelConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024,
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
        sft=SFTConfig(steps=400, batch_size=64, stop_accuracy=0.45, stop_every=5,
                      optim=OptimConfig(lr=1e-3, warmup_steps=20, schedule="constant")),
        # GRPO (group-normalised advantages, clip 0.2) without the KL term, as DAPO and
        # Dr.GRPO run it, with a learning-rate warm-up (a constant lr on a fresh Adam state
        # collapsed accuracy to 0). Two minibatch updates per rollout batch, the ratio's
        # denominator from the sampler's exact log-probs (no extra forward pass). Rollouts
        # at temperature 0.7: the samples sit nearer the greedy answer that is evaluated.
        # 64 prompts a step: with 32 and the DeepSeekMath KL 0.04 the gain fell short of
        # +0.30 on every seed once rounding moved (see the docstring).
        algorithm=algorithm_preset("grpo", group_size=8, num_minibatches=2, kl_coef=0.0,
                                   old_logp="sampler"),
        optim=OptimConfig(lr=2e-4, warmup_steps=10, schedule="constant"),
        sampling=SamplingConfig(max_new_tokens=4, temperature=0.7),
        rl=RLConfig(steps=100, prompts_per_step=64, eval_prompts=512, logp_chunk=8),
        run=RunConfig(dir="runs/arithmetic_grpo", seed=0, overwrite=True, plots=True),
    )


def smoke(cfg: ExperimentConfig) -> ExperimentConfig:
    """Two RL steps with a tiny model (for tests of the recipe)."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, hidden_size=32, intermediate_size=64),
        sft=dataclasses.replace(cfg.sft, steps=2, batch_size=8),
        rl=dataclasses.replace(cfg.rl, steps=2, prompts_per_step=2, eval_prompts=8),
    )


def sft_baseline(cfg: ExperimentConfig, seconds: float) -> tuple[float, int]:
    """Held-out accuracy of SFT continued for about `seconds` past the warm-up."""
    from flax import nnx

    from rljax.run import builders
    from rljax.train.batching import encode_pairs
    from rljax.train.rl import RLTrainer
    from rljax.train.sft import SFTTrainer

    tok = builders.build_tokenizer(cfg)
    mesh = builders.build_mesh(cfg)
    graphdef, params = nnx.split(builders.build_model(cfg, tok, mesh))
    task = builders.build_task(cfg, tok)
    sft = SFTTrainer(graphdef, cfg.sft, mesh=mesh)
    state = sft.init_state(params, seed=cfg.run.seed)
    bs, step, deadline = cfg.sft.batch_size, 0, None
    while deadline is None or time.perf_counter() < deadline:
        prompts, targets = task.sft(step * bs, bs)
        state, _ = sft.step(state, encode_pairs(tok, prompts, targets, cfg.task.max_prompt_tokens,
                                                cfg.sampling.max_new_tokens))
        step += 1
        if step == cfg.sft.steps:  # the warm-up is done: now the same time as RL took
            deadline = time.perf_counter() + seconds
    reward_fns, accuracy_fn = builders.build_reward(cfg)
    ev = RLTrainer(graphdef, tok, reward_fns, algorithm=cfg.algorithm, optim=cfg.optim,
                   sampling=cfg.sampling, rl=cfg.rl, prompt_len=cfg.task.max_prompt_tokens,
                   accuracy_fn=accuracy_fn, mesh=mesh)
    res = ev.evaluate(state.params["policy"], task.eval_prompts, task.eval_metadata)
    return res["accuracy"], step - cfg.sft.steps


def main(argv=None) -> int:
    """Run the demo; print before/after accuracy, the SFT baseline and the RESULT line."""
    from rljax.run.overrides import apply_overrides
    from rljax.run.runner import run_experiment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-baseline", action="store_true", help="skip the SFT baseline")
    args = ap.parse_args(argv)
    cfg = apply_overrides(config(), args.set)
    t0 = time.perf_counter()
    res = run_experiment(cfg)
    print(f"held-out greedy accuracy: before GRPO {res.accuracy_before:.3f}, after "
          f"{res.accuracy_after:.3f} (gain {res.accuracy_after - res.accuracy_before:+.3f}); "
          f"run {res.wall_s:.1f} s")
    extra = ""
    if not args.no_baseline:
        rl_seconds = _rl_seconds(res.run_dir)
        acc, steps = sft_baseline(cfg, rl_seconds)
        print(f"honesty baseline: SFT continued for the RL phase's {rl_seconds:.1f} s "
              f"({steps} more SFT steps) reaches {acc:.3f} held-out accuracy "
              f"(GRPO reached {res.accuracy_after:.3f} from the verifier alone)")
        extra = f" sft_baseline_accuracy={acc:.4f}"
    print(f"total wall time including baseline: {time.perf_counter() - t0:.1f} s")
    print(f"RESULT accuracy_before={res.accuracy_before:.4f} "
          f"accuracy_after={res.accuracy_after:.4f} wall_s={res.wall_s:.1f}{extra}")
    return 0


def _rl_seconds(run_dir: str) -> float:
    """Wall time of the RL steps, from the run's metrics (sum of per-phase times)."""
    from rljax.run.run_dir import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("phase") == "rl"]
    return float(sum(v for r in rows for k, v in r.items() if k.startswith("time_")))


if __name__ == "__main__":
    sys.exit(main())
