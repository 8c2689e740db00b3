"""rljax.objectives: pure, jit-able RL post-training math (layer 1: no model, no I/O).

The objective contract (docs/design.md): `objective(batch: ObjectiveBatch, coef: Coef) ->
(loss_sum, count, metrics)`, metrics a dict `name -> (sum, count)`; static choices are
bound with `functools.partial`. Building blocks: advantages, KL estimators, surrogates,
value loss, aggregation, the sampler-gap correction, truncation masking, Clip-Cov /
KL-Cov selection. Objectives: reinforce, grpo, gspo, ppo (`library`); cispo, sapo, gmpo,
clip_cov, kl_cov (`recent`); distill, on-policy distillation from a teacher's
log-probs (`distill`). `rljax.testing.check_objective` checks any objective;
`token_separable` says which ones the trainer may differentiate in one pass over the
output head (`rljax.train.learn.onepass`).
"""

from rljax.objectives.advantages import (
    STD_MODES,
    broadcast_to_tokens,
    final_token_rewards,
    gae,
    group_advantages,
    rloo_advantages,
    whiten,
    zero_variance_fraction,
)
from rljax.objectives.aggregation import AGGREGATIONS, aggregate, masked_mean_pair
from rljax.objectives.batch import DIFFERENTIABLE_FIELDS, Coef, ObjectiveBatch
from rljax.objectives.correction import (IS_LEVELS, IS_MODES, behaviour_gap,
                                         mask_truncated_completions,
                                         sampler_correction)
from rljax.objectives.distill import distill, distill_advantages
from rljax.objectives.entropy_control import (COV_RULES, cov_selection, ppo_clipped_tokens,
                                              token_covariance)
from rljax.objectives.kl import KL_KINDS, kl_estimate, kl_penalized_rewards
from rljax.objectives.library import grpo, gspo, ppo, reinforce
from rljax.objectives.logits import token_entropy, token_logprobs
from rljax.objectives.recent import (clip_cov, cispo, cispo_objective, gmpo, gmpo_token_ratio,
                                     kl_cov, sapo, sapo_objective)
from rljax.objectives.separable import token_separable
from rljax.objectives.surrogates import (
    clip_indicators,
    gspo_token_ratio,
    policy_gradient_objective,
    ppo_clip_objective,
    truncated_is_weights,
)
from rljax.objectives.value import (clipped_value_loss, explained_variance,
                                    explained_variance_from_sums)

__all__ = [
    "AGGREGATIONS",
    "COV_RULES",
    "DIFFERENTIABLE_FIELDS",
    "IS_LEVELS",
    "IS_MODES",
    "KL_KINDS",
    "STD_MODES",
    "Coef",
    "ObjectiveBatch",
    "aggregate",
    "broadcast_to_tokens",
    "cispo",
    "cispo_objective",
    "clip_cov",
    "clip_indicators",
    "clipped_value_loss",
    "cov_selection",
    "distill",
    "distill_advantages",
    "explained_variance",
    "explained_variance_from_sums",
    "final_token_rewards",
    "gae",
    "gmpo",
    "gmpo_token_ratio",
    "group_advantages",
    "grpo",
    "gspo",
    "gspo_token_ratio",
    "kl_cov",
    "kl_estimate",
    "kl_penalized_rewards",
    "mask_truncated_completions",
    "masked_mean_pair",
    "policy_gradient_objective",
    "ppo",
    "ppo_clip_objective",
    "ppo_clipped_tokens",
    "reinforce",
    "rloo_advantages",
    "sampler_correction",
    "behaviour_gap",
    "sapo",
    "sapo_objective",
    "token_covariance",
    "token_entropy",
    "token_logprobs",
    "token_separable",
    "truncated_is_weights",
    "whiten",
    "zero_variance_fraction",
]
