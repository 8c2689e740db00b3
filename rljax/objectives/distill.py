"""On-policy distillation: the teacher's per-token log-probs on the student's own samples
as a dense reward, optimised with the policy-gradient estimator.

The student pi samples y ~ pi(. | x); a teacher q scores every sampled token. The reward
of token t is minus the k1 estimate of the reverse KL (Schulman 2020),

  k1_t = log pi_old(y_t | y_<t) - log q(y_t | y_<t),       r_t = -k1_t,

taken at the policy that sampled (``old_logp_BxT``; no gradient), and the advantage of
token t is its discounted reward-to-go, A_t = sum_{s >= t} gamma^(s-t) r_s. The loss is
the same clipped importance-ratio surrogate as GRPO / PPO on these per-token advantages
(on-policy, ratio 1: plain REINFORCE, A_t grad log pi(y_t)).

Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD, arXiv:2306.13649): the student learns on its own samples
from a teacher's token-level divergence, without back-propagating through the sampling;
Lu and Thinking Machines Lab 2025, "On-Policy Distillation" (blog post): the per-token
reverse KL against the teacher's log-probs as the negative reward of an RL step, with
discount 0 (each token optimises only its own next-token KL).

What the estimator's expectation is (``tests/test_distillation.py`` checks both exactly by
enumerating every sequence of a small policy), with ``seq-mean-token-sum`` aggregation:
- discount 1: the gradient of the sequence-level reverse KL,
  grad KL(pi(. | x) || q(. | x)) = grad E_pi[sum_t k1_t];
- discount 0: the gradient of sum_t E_{y_<t ~ pi}[KL(pi(. | y_<t) || q(. | y_<t))] with the
  prefix distribution held fixed (GKD's "no gradient through the sampling"), i.e. the
  per-token reverse KLs along the student's own prefixes.
Both vanish when teacher == student (k1 = 0 on every token).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_same_shape
from rljax.objectives.advantages import gae
from rljax.objectives.batch import Coef, ObjectiveBatch
from rljax.objectives.kl import kl_estimate
from rljax.objectives.library import clipped_surrogate, objective_frame

Array = Any
Metrics = dict[str, tuple[Array, Array]]
sg = jax.lax.stop_gradient


def _check_discount(discount: Any) -> None:
    if isinstance(discount, bool) or not isinstance(discount, (int, float)) or not 0 <= discount <= 1:
        raise ValueError(f"discount={discount!r} is not supported; allowed: a number in [0, 1] "
                         "(0: per-token reverse KL, 1: sequence-level reverse KL)")


def distill_advantages(student_logp_BxT: Array, teacher_logp_BxT: Array, mask_BxT: Array, *,
                       discount: float = 0.0) -> Array:
    """Per-token advantages of on-policy distillation, A_t = -sum_{s>=t} gamma^(s-t) k1_s.

    k1_s = log pi(y_s) - log q(y_s) is the reverse-KL estimate of token s (the negative
    reward of Lu / Thinking Machines 2025); ``discount`` gamma in [0, 1] sums the future
    tokens' rewards (0: each token's own, 1: the rest of the sequence). Right-padded
    masks; masked positions get 0. Everything is data: no gradient flows.

    Args:
      student_logp_BxT: log-probs of the sampled tokens under the sampling policy.
      teacher_logp_BxT: the teacher's log-probs of the same tokens.
      mask_BxT: 0/1, 1 on real completion tokens.
      discount: gamma, a Python number in [0, 1] (static).

    Returns:
      ``[B, T]`` float32 advantages.
    """
    _check_discount(discount)
    check_same_shape("teacher_logp_BxT", teacher_logp_BxT, "student_logp_BxT", student_logp_BxT)
    check_same_shape("mask_BxT", mask_BxT, "student_logp_BxT", student_logp_BxT)
    m = jnp.asarray(mask_BxT, jnp.float32) > 0
    k1_BxT = jnp.where(m, kl_estimate(sg(student_logp_BxT), sg(teacher_logp_BxT), "k1"), 0.0)
    if discount == 0:
        return -k1_BxT
    # Reward-to-go is GAE with zero values and lambda 1: A_t = r_t + gamma A_{t+1}.
    adv_BxT, _ = gae(-k1_BxT, jnp.zeros_like(k1_BxT), m, gamma=float(discount), lam=1.0)
    return adv_BxT


def distill(
    batch: ObjectiveBatch,
    coef: Coef,
    *,
    aggregation: str = "seq-mean-token-sum",
    kl_kind: str | None = None,
    kl_clamp: float | None = None,
    norm_const: float | None = None,
    is_level: str = "token",
    is_mode: str = "truncate",
    discount: float = 0.0,
) -> tuple[Array, Array, Metrics]:
    """On-policy distillation (GKD, Agarwal et al. 2024; Lu / Thinking Machines 2025):

      L = -agg_t min(r_t A_t, clip(r_t, 1 - eps_lo, 1 + eps_hi) A_t),
      A_t = adv_t - sum_{s>=t} gamma^(s-t) (log pi_old(y_s) - log q(y_s)),

    with r_t = pi(y_t) / pi_old(y_t) and q the teacher (``teacher_logp_BxT``, required).
    ``adv_BxT`` adds a task-reward advantage on top (the trainer passes zeros for pure
    distillation). The default ``seq-mean-token-sum`` makes the expected gradient the
    exact gradient of the reverse KL (see the module docstring); ``discount`` is gamma.
    Metrics: ``teacher_kl`` (k1, the reverse-KL estimate per token; its sum over a
    completion estimates KL(pi || q) of the sequence), ``teacher_kl_k3`` (k3, >= 0) and
    ``teacher_logp`` (mean teacher log-prob of the student's tokens).
    """
    _check_discount(discount)
    batch.require("teacher_logp_BxT", by="distill")

    def surrogate(t, b):
        a = b.adv_BxT + distill_advantages(b.old_logp_BxT, b.teacher_logp_BxT, t.m,
                                           discount=discount)
        b = dataclasses.replace(b, adv_BxT=a)
        t.metric("teacher_kl", kl_estimate(b.old_logp_BxT, b.teacher_logp_BxT, "k1"))
        t.metric("teacher_kl_k3", kl_estimate(b.old_logp_BxT, b.teacher_logp_BxT, "k3"))
        t.metric("teacher_logp", b.teacher_logp_BxT)
        return clipped_surrogate(t, b, coef)

    return objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                           is_level, is_mode)
