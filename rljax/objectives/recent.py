"""Objectives of 2025: CISPO, SAPO, GMPO, and the Clip-Cov / KL-Cov entropy controls.

Same contract and options as `rljax.objectives.library` (`objective(batch, coef, *,
aggregation, kl_kind, kl_clamp, norm_const, is_level, is_mode) -> (loss_sum, count,
metrics)`), same frame: masked positions zeroed first, the sampler-gap correction when
`sampler_logp_BxT` is present, KL-to-reference and entropy terms when asked for. With
r_t = pi(y_t) / pi_old(y_t) and advantages A_t (GRPO's group advantages broadcast over
each completion's tokens):

  cispo    sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t)    MiniMax-M1 Eq. 4-5
  sapo     (4 / tau) sigmoid(tau (r_t - 1)) A_t, tau by the sign of A   arXiv:2511.20347
  gmpo     A_t exp(1/|y| sum_t clip_log(log r_t))                       arXiv:2507.20673
  clip_cov PPO's clipped surrogate; Clip-Cov's tokens contribute 0       arXiv:2505.22617
  kl_cov   r_t A_t - beta |log r_t| on KL-Cov's tokens                   arXiv:2505.22617
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_same_shape
from rljax.objectives.batch import Coef, ObjectiveBatch
from rljax.objectives.library import clipped_surrogate, objective_frame, tis_weighted, token_ratio

Array = Any
Metrics = dict[str, tuple[Array, Array]]
sg = jax.lax.stop_gradient


def cispo_objective(logp: Array, ratio: Array, advantages: Array, *, eps_low: Any,
                    eps_high: Any) -> Array:
    """CISPO's per-token objective, sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi.

    MiniMax-M1 (arXiv:2506.13585 §3.1, Eq. 4-5): clip the importance weight, not the
    update, and keep it as a stop-gradient coefficient of the REINFORCE term, so every
    token (the rare "fork" tokens that PPO's clip drops after the first update included)
    keeps a gradient r_hat * A * grad log pi. The paper sets no lower bound (eps_low = 1
    here: r >= 0) and tunes eps_high only.
    """
    check_same_shape("ratio", ratio, "logp", logp)
    check_same_shape("advantages", advantages, "logp", logp)
    w = sg(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    return w * sg(advantages) * logp


def sapo_objective(ratio: Array, advantages: Array, *, tau_pos: Any, tau_neg: Any) -> Array:
    """SAPO's soft-gated surrogate f(r) * A with f(r) = (4 / tau) sigmoid(tau (r - 1)).

    Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347, the SAPO objective):
    tau = tau_pos where A > 0, tau_neg otherwise. The gate's slope
    f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1)), is 1 at r = 1 (the on-policy gradient)
    and decays smoothly as r leaves 1, replacing the hard clip; tau_neg > tau_pos damps
    negative-advantage updates faster (paper: 1.0 and 1.05).
    """
    check_same_shape("advantages", advantages, "ratio", ratio)
    adv = sg(advantages)
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    return 4.0 / tau * jax.nn.sigmoid(tau * (ratio - 1.0)) * adv


def gmpo_token_ratio(logp_BxT: Array, old_logp_BxT: Array, adv_BxT: Array, mask_BxT: Array,
                     *, eps_low: Any, eps_high: Any) -> tuple[Array, Array]:
    """GMPO's geometric-mean ratio of each sequence on its tokens, and the clip indicator.

    Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673, the GMPO objective):

      J = 1/G sum_i sgn(A_i) prod_t |min(r_it A_i, clip(r_it, e^-eps_low, e^eps_high) A_i)|^(1/|o_i|)
        = 1/G sum_i A_i exp(1/|o_i| sum_t log r~_it),

    with the clip in log space: log r~ = min(log r, eps_high) where A > 0 and
    max(log r, -eps_low) where A < 0 (PPO's pessimistic side; paper: eps = 0.4 both). A
    clipped token gets no gradient; the others get A_i s_i / |o_i| grad log pi. Returns
    (s_BxT: exp(mean log r~) on every token of the row, clipped_BxT: float 0/1).
    """
    m = jnp.asarray(mask_BxT, jnp.float32) > 0
    adv = sg(adv_BxT)
    log_r = jnp.where(m, logp_BxT - jnp.where(m, old_logp_BxT, 0.0), 0.0)
    log_rc = jnp.where(adv > 0, jnp.minimum(log_r, eps_high),
                       jnp.where(adv < 0, jnp.maximum(log_r, -eps_low), log_r))
    clipped = m & (sg(log_rc) != sg(log_r))
    len_B = jnp.maximum(m.sum(axis=1), 1)
    s_B = jnp.exp(jnp.where(m, log_rc, 0.0).sum(axis=1) / len_B)
    return jnp.broadcast_to(s_B[:, None], m.shape), clipped.astype(jnp.float32)


def cispo(batch: ObjectiveBatch, coef: Coef, *, aggregation: str = "token-mean",
          kl_kind: str | None = None, kl_clamp: float | None = None,
          norm_const: float | None = None, is_level: str = "token",
          is_mode: str = "truncate") -> tuple[Array, Array, Metrics]:
    """CISPO (MiniMax-M1, arXiv:2506.13585 Eq. 4), to minimise:

      L = -1/sum_i |o_i| sum_i sum_t sg(r^_it) A_it log pi(o_it),
      r^_it = clip(r_it, 1 - eps_low, 1 + eps_high)   (`coef.clip_low`, `coef.clip_high`),

    token-mean by default (the paper's 1 / sum |o_i|). Metrics: `ratio`, and
    `is_weight_clip_frac`, the fraction of tokens whose weight the clip bounds.
    """
    def surrogate(t, b):
        r = token_ratio(b)
        t.metric("ratio", r)
        t.metric("is_weight_clip_frac", (r < 1.0 - coef.clip_low) | (r > 1.0 + coef.clip_high))
        obj = cispo_objective(b.logp_BxT, r, b.adv_BxT, eps_low=coef.clip_low,
                              eps_high=coef.clip_high)
        return tis_weighted(t, b, coef, obj)

    return objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                           is_level, is_mode)


def sapo(batch: ObjectiveBatch, coef: Coef, *, aggregation: str = "seq-mean-token-mean",
         kl_kind: str | None = None, kl_clamp: float | None = None,
         norm_const: float | None = None, is_level: str = "token",
         is_mode: str = "truncate") -> tuple[Array, Array, Metrics]:
    """SAPO (arXiv:2511.20347), to minimise:

      L = -1/G sum_i 1/|y_i| sum_t f_it(r_it) A_it,   f(r) = (4/tau) sigmoid(tau (r - 1)),

    tau = `coef.sapo_tau_pos` (A > 0) or `coef.sapo_tau_neg` (A <= 0). Per-sequence token
    mean by default, as in the paper's equation. Metric `ratio`, and `gate_slope`, the mean
    of f'(r) = 4 s (1 - s) (1 = an unattenuated on-policy gradient).
    """
    def surrogate(t, b):
        r = token_ratio(b)
        t.metric("ratio", r)
        tau = jnp.where(b.adv_BxT > 0, coef.sapo_tau_pos, coef.sapo_tau_neg)
        s = jax.nn.sigmoid(tau * (r - 1.0))
        t.metric("gate_slope", 4.0 * s * (1.0 - s))
        obj = sapo_objective(r, b.adv_BxT, tau_pos=coef.sapo_tau_pos, tau_neg=coef.sapo_tau_neg)
        return tis_weighted(t, b, coef, obj)

    return objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                           is_level, is_mode)


def gmpo(batch: ObjectiveBatch, coef: Coef, *, aggregation: str = "seq-mean-token-mean",
         kl_kind: str | None = None, kl_clamp: float | None = None,
         norm_const: float | None = None, is_level: str = "token",
         is_mode: str = "truncate") -> tuple[Array, Array, Metrics]:
    """GMPO (arXiv:2507.20673), to minimise:

      L = -1/G sum_i A_i exp(1/|o_i| sum_t log r~_it)      (`gmpo_token_ratio`),

    the clip in log space with `coef.clip_low` / `coef.clip_high` as eps (paper: 0.4 / 0.4,
    i.e. ratios in (e^-0.4, e^0.4)). Each token carries its sequence's value, so the
    default "seq-mean-token-mean" gives exactly the paper's 1/G sum_i. Metrics: `ratio`
    (the geometric mean per token) and `clip_frac` (tokens clipped in log space).
    """
    def surrogate(t, b):
        s, clipped = gmpo_token_ratio(b.logp_BxT, b.old_logp_BxT, b.adv_BxT, b.mask_BxT,
                                      eps_low=coef.clip_low, eps_high=coef.clip_high)
        t.metric("ratio", s)
        t.metric("clip_frac", clipped)
        return tis_weighted(t, b, coef, s * sg(b.adv_BxT))

    return objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                           is_level, is_mode)


def _selected(t, b: ObjectiveBatch, by: str) -> Array:
    b.require("cov_select_BxT", by=by)
    sel = b.cov_select_BxT > 0
    t.metric("cov_selected_frac", sel)
    return sel


def clip_cov(batch: ObjectiveBatch, coef: Coef, *, aggregation: str = "token-mean",
             kl_kind: str | None = None, kl_clamp: float | None = None,
             norm_const: float | None = None, is_level: str = "token",
             is_mode: str = "truncate") -> tuple[Array, Array, Metrics]:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617 §4): PPO's clipped surrogate
    (`coef.clip_low` / `clip_high`), except that the tokens of `cov_select_BxT`
    (`cov_selection(rule="clip-cov")`, drawn among the tokens PPO's clip leaves alone:
    `ppo_clipped_tokens`) contribute nothing: zero loss and gradient, still counted in
    the normaliser, as in the authors' code. Token-mean by default.
    """
    def surrogate(t, b):
        sel = _selected(t, b, "clip_cov")
        return jnp.where(sel, 0.0, clipped_surrogate(t, b, coef))

    return objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                           is_level, is_mode)


def kl_cov(batch: ObjectiveBatch, coef: Coef, *, aggregation: str = "token-mean",
           kl_kind: str | None = None, kl_clamp: float | None = None,
           norm_const: float | None = None, is_level: str = "token",
           is_mode: str = "truncate") -> tuple[Array, Array, Metrics]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617 §4), to minimise per token:

      -r_t A_t + beta |log r_t| * 1[t selected],     beta = `coef.kl_cov`,

    with the unclipped ratio (the paper replaces the clip by the penalty) and the tokens
    of `cov_select_BxT` (`cov_selection(rule="kl-cov")`). Token-mean by default. Metric
    `kl_cov_penalty`: mean |log r| over all real tokens' selected part.

    The penalty is written log r * sign(sg(log r)): the value |log r|, the gradient
    sign(log r) grad log pi with sign(0) = 0, the subgradient torch's `abs` takes in the
    authors' code (verl `compute_policy_loss_kl_cov`). `jnp.abs` would give 1 at
    log r = 0, so on-policy (the first update of each batch, r = 1) every selected token
    would get a constant push of -beta grad log pi where KL(pi_old || pi)'s gradient is 0.
    The penalty's gradient is 0 exactly where `old_logp_BxT` equals `logp_BxT` bitwise:
    rljax's learning program makes it so on the first update of each batch, for any
    number of epochs and minibatches (`rljax.train.learn`: pi_old = sg(logp) there).
    """
    def surrogate(t, b):
        sel = _selected(t, b, "kl_cov")
        r = token_ratio(b)
        t.metric("ratio", r)
        log_r = b.logp_BxT - b.old_logp_BxT
        penalty = jnp.where(sel, log_r * jnp.sign(sg(log_r)), 0.0)
        t.metric("kl_cov_penalty", penalty)
        return tis_weighted(t, b, coef, r * sg(b.adv_BxT)) - coef.kl_cov * penalty

    return objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                           is_level, is_mode)
