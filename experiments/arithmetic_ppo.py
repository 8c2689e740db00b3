"""The arithmetic demo with PPO: a value model, GAE and the KL penalty in the reward.

Same task, tokenizer and SFT warm-up as `arithmetic_grpo`, with a 1024-wide MLP (the
model its figures were measured with); the RL phase is PPO as in InstructGPT / Ziegler et al. 2019: one completion
per prompt, the verifier's reward on the last token, a per-token k1 KL penalty to the SFT
reference in the reward, GAE (gamma 1, lambda 0.95), whitened advantages, a separate value
model (the policy backbone with a scalar head) trained with the clipped value loss, two
epochs of two minibatches.
Target: held-out greedy accuracy rises by at least 0.10. Measured figures:
docs/arithmetic_ppo.md.

Run: `rljax train arithmetic_ppo` or `python experiments/arithmetic_ppo.py [--set k=v ...]`.
The last line is `RESULT accuracy_before=... accuracy_after=... wall_s=...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import arithmetic_grpo  # noqa: E402  (the shared task, model and SFT warm-up)

from rljax.run.experiment import ExperimentConfig  # noqa: E402
from rljax.run.overrides import apply_overrides  # noqa: E402
from rljax.run.runner import run_experiment  # noqa: E402
from rljax.train.config import OptimConfig, algorithm_preset  # noqa: E402


def config() -> ExperimentConfig:
    """`arithmetic_grpo`'s config with PPO for the RL phase."""
    base = arithmetic_grpo.config()
    return dataclasses.replace(
        base,
        name="arithmetic_ppo",
        # The model its figures were measured with (the GRPO demo's MLP is 512 wide; PPO
        # has not been measured with that one).
        model=dataclasses.replace(base.model, intermediate_size=1024),
        algorithm=algorithm_preset("ppo", group_size=1, kl_coef=0.02, num_epochs=2,
                                   num_minibatches=2),
        optim=OptimConfig(lr=1e-4, warmup_steps=10, schedule="constant"),
        # Rollouts at temperature 1 (as measured), not GRPO's 0.7.
        sampling=dataclasses.replace(base.sampling, temperature=1.0),
        rl=dataclasses.replace(base.rl, steps=100, prompts_per_step=128, value_lr_ratio=3.0),
        # One seed: several-seed programs have no value model (rljax.run.seed_runs).
        run=dataclasses.replace(base.run, dir="runs/arithmetic_ppo", seeds=1, plots=True),
    )


def smoke(cfg: ExperimentConfig) -> ExperimentConfig:
    """Two PPO steps with a tiny model; 16 prompts so minibatches split over 8 devices."""
    cfg = arithmetic_grpo.smoke(cfg)
    return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, prompts_per_step=16))


def main(argv=None) -> int:
    """Run the PPO demo and print before/after accuracy and the RESULT line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    res = run_experiment(apply_overrides(config(), args.set))
    print(f"held-out greedy accuracy: before PPO {res.accuracy_before:.3f}, after "
          f"{res.accuracy_after:.3f} (gain {res.accuracy_after - res.accuracy_before:+.3f})")
    print(f"RESULT accuracy_before={res.accuracy_before:.4f} "
          f"accuracy_after={res.accuracy_after:.4f} wall_s={res.wall_s:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
