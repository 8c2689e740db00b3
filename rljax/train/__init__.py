"""rljax.train: SFT and the colocated RL loop (layer 6), plus runs, checkpoints and plots.

The trainer core (Python API first):
- configs: `OptimConfig`, `AlgorithmConfig` (+ `algorithm_preset(name)` for each paper's
  defaults), `SamplingConfig`, `RLConfig`, `SFTConfig`;
- `RLTrainer(policy_graphdef, tokenizer, reward_fns, ...)`: `init_state`, `step(state,
  source) -> (state, metrics)`, `evaluate`; one loop for reinforce, rloo, grpo, dr_grpo,
  dapo, gspo and ppo (value model, GAE, KL in the reward, adaptive controller);
- `SFTTrainer`: masked next-token loss on completions;
- `TrainState` (everything a checkpoint holds) and `Learner`, the jitted, sharded, donated
  update with exact micro-batch accumulation and non-finite skipping;
- `chunked_logprobs` / `policy_logprobs`: log-probs from hidden states in rematerialised
  chunks, never the whole float32 ``[B, T, V]``.

Runs (the run/CLI layer): `ExperimentConfig`, `load_experiment`, `apply_overrides`,
`run_experiment`, `Checkpointer`, `RunDir`, `plot_metrics`, the reward model.
"""

from rljax.train.algorithms import (make_coef, make_objective, overlong_shaping,
                                    sequence_advantages)
from rljax.train.batching import decode_completions, encode_pairs, encode_prompts
from rljax.train.config import (ALGORITHMS, AlgorithmConfig, OptimConfig, RLConfig,
                                SamplingConfig, SFTConfig, algorithm_preset)
from rljax.train.logprobs import chunked_logprobs, completion_hidden, policy_logprobs
from rljax.train.ppo import AdaptiveKLController, ppo_advantages, value_predictions
from rljax.train.rl import RLTrainer, rl_loss
from rljax.train.rollout import Rollout, Rollouts
from rljax.train.sft import SFTTrainer, sft_loss
from rljax.train.step import (Learner, NonFiniteError, TrainState, accumulate,
                              make_optimizer, make_schedule, make_update, new_train_state)

# The run/CLI engineer's public names (run directories, overrides, checkpoints, plots).
from rljax.train.checkpoint import Checkpointer, abstract_like, pure_params
from rljax.train.experiment import (ExperimentConfig, RewardConfig, RunConfig, TaskConfig,
                                    load_experiment, load_run_config)
from rljax.train.overrides import OverrideError, apply_overrides
from rljax.train.plots import plot_metrics
from rljax.train.run_dir import RunDir, RunDirError, format_summary, read_metrics, result_line
from rljax.train.runner import RunResult, run_experiment

__all__ = [
    "ALGORITHMS", "AdaptiveKLController", "AlgorithmConfig", "Checkpointer",
    "ExperimentConfig", "Learner", "NonFiniteError", "OptimConfig", "OverrideError",
    "RLConfig", "RLTrainer", "RewardConfig", "Rollout", "Rollouts", "RunConfig", "RunDir",
    "RunDirError", "RunResult", "SFTConfig", "SFTTrainer", "SamplingConfig", "TaskConfig",
    "TrainState", "abstract_like", "accumulate", "algorithm_preset", "apply_overrides",
    "chunked_logprobs", "completion_hidden", "decode_completions", "encode_pairs",
    "encode_prompts", "format_summary", "load_experiment", "load_run_config", "make_coef",
    "make_objective", "make_optimizer", "make_schedule", "make_update", "new_train_state",
    "overlong_shaping", "plot_metrics", "policy_logprobs", "ppo_advantages", "pure_params",
    "read_metrics", "result_line", "rl_loss", "run_experiment", "sequence_advantages", "sft_loss",
    "value_predictions",
]
