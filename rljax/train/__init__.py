"""rljax.train: the trainer core (layer 6): SFT, the colocated RL loop, checkpoints.

The trainer core (Python API first):
- configs: `OptimConfig`, `AlgorithmConfig` (+ `algorithm_preset(name)` for each paper's
  defaults), `SamplingConfig`, `RLConfig`, `SFTConfig`;
- `RLTrainer(policy_graphdef, tokenizer, reward_fns, ...)`: `init_state`, `step(state,
  source) -> (state, metrics)`, `evaluate`; one driver (`rljax.train.driver.rl_step`) for
  every rollout source (`rljax.train.sources`) and all 13 algorithms of
  `ALGORITHMS` (grpo, dr_grpo, dapo, gspo, rloo, reinforce, ppo with its value model and
  KL in the reward, cispo, sapo, gmpo, clip_cov, kl_cov, distill; each one's settings in
  docs/reference.md);
- `MultiTurnConfig` (`RLTrainer(..., multiturn=...)`) and `MultiTurnRollouts`: episodes
  with an environment per row (`rljax.envs`), observations in the completion with loss
  mask 0 (docs/environments.md);
- `SFTTrainer`: masked next-token loss on completions;
- `TrainState` (everything a checkpoint holds) and `Learner`, the jitted, sharded, donated
  update with exact micro-batch accumulation and non-finite skipping;
- `chunked_logprobs` / `policy_logprobs`: log-probs from hidden states in rematerialised
  chunks, never the whole float32 ``[B, T, V]``.
- `Checkpointer` (orbax, every process), `abstract_like`, `pure_params`.

Experiment configs, overrides, run directories, plots and the runner are the run layer
above this one: `rljax.run`.

Where the trainer (`rl.py`), the one step driver (`driver.py`), the rollout sources
(`sources/`), the learning program and its loss (`learn/`) and the configs (`config/`)
live: docs/design.md, "Where things are in rljax/train".
"""

from rljax.train.batching import decode_completions, encode_pairs, encode_prompts, encode_traces
from rljax.train.checkpoint import Checkpointer, abstract_like, pure_params
from rljax.train.config import (ALGORITHMS, AlgorithmConfig, OptimConfig, RLConfig,
                                SamplingConfig, SFTConfig, algorithm_preset)
from rljax.train.learn.algorithms import (make_coef, make_objective, overlong_shaping,
                                          sequence_advantages)
from rljax.train.learn.logprobs import chunked_logprobs, completion_hidden, policy_logprobs
from rljax.train.learn.ppo import AdaptiveKLController, ppo_advantages, value_predictions
from rljax.train.learn.update import (Learner, NonFiniteError, TrainState, accumulate,
                                      make_optimizer, make_schedule, make_update, new_train_state)
from rljax.train.multiturn import MultiTurnConfig, MultiTurnRollouts
from rljax.train.rl import RLTrainer, rl_loss
from rljax.train.batch import Rollout
from rljax.train.sources.host import Rollouts
from rljax.train.sft import SFTTrainer, sft_loss

__all__ = [
    "ALGORITHMS", "AdaptiveKLController", "AlgorithmConfig", "Checkpointer", "Learner",
    "MultiTurnConfig", "MultiTurnRollouts", "NonFiniteError", "OptimConfig", "RLConfig", "RLTrainer", "Rollout", "Rollouts",
    "SFTConfig", "SFTTrainer", "SamplingConfig", "TrainState", "abstract_like",
    "accumulate", "algorithm_preset", "chunked_logprobs", "completion_hidden",
    "decode_completions", "encode_pairs", "encode_prompts", "encode_traces", "make_coef", "make_objective",
    "make_optimizer", "make_schedule", "make_update", "new_train_state", "overlong_shaping",
    "policy_logprobs", "ppo_advantages", "pure_params", "rl_loss", "sequence_advantages",
    "sft_loss", "value_predictions",
]
