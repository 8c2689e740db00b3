"""rljax.objectives: pure, jit-able RL post-training math (layer 1: no model, no I/O).

The objective contract (DESIGN.md): `objective(batch: ObjectiveBatch, coef: Coef) ->
(loss_sum, count, metrics)`, metrics a dict `name -> (sum, count)`; static choices are
bound with `functools.partial`. Building blocks: advantages, KL estimators, surrogates,
value loss, aggregation. `rljax.testing.check_objective` checks any objective.
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
from rljax.objectives.kl import KL_KINDS, kl_estimate, kl_penalized_rewards
from rljax.objectives.logits import token_entropy, token_logprobs

__all__ = [
    "AGGREGATIONS",
    "Coef",
    "DIFFERENTIABLE_FIELDS",
    "KL_KINDS",
    "ObjectiveBatch",
    "STD_MODES",
    "aggregate",
    "broadcast_to_tokens",
    "final_token_rewards",
    "gae",
    "group_advantages",
    "kl_estimate",
    "kl_penalized_rewards",
    "masked_mean_pair",
    "rloo_advantages",
    "token_entropy",
    "token_logprobs",
    "whiten",
    "zero_variance_fraction",
]
