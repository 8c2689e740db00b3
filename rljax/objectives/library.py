"""Complete objectives: `reinforce`, `grpo`, `gspo`, `ppo`.

Each follows the objective contract, `objective(batch, coef, *, static options) ->
(loss_sum, count, metrics)`, with metrics `name -> (sum, count)` (token-level pairs unless
noted), computed under stop_gradient. Bind static options with `functools.partial`:

  dapo = functools.partial(grpo, aggregation="token-mean", kl_kind=None)  # + Coef(clip_high=0.28)
  dr_grpo = functools.partial(grpo, aggregation="seq-mean-token-sum-norm", norm_const=1024)
  rloo = reinforce  # with rloo_advantages in adv_BxT

Optional batch fields switch terms on: `ref_logp_BxT` the KL-to-reference term (when a
`kl_kind` is set), `sampler_logp_BxT` the sampler-gap correction (`sampler_correction`:
token- or sequence-level, truncated or masked, chosen by the static `is_level` /
`is_mode`; bounds `coef.is_low`, `coef.tis_cap`), `entropy_BxT` the
entropy bonus (weight `coef.entropy`) and its metric. Whatever masked positions hold is
replaced by 0 first, so junk padding never reaches exp or log and gets zero gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_choice
from rljax.objectives.aggregation import AGGREGATIONS, aggregate
from rljax.objectives.batch import Coef, ObjectiveBatch
from rljax.objectives.correction import IS_LEVELS, IS_MODES, sampler_correction
from rljax.objectives.kl import KL_KINDS, kl_estimate
from rljax.objectives.surrogates import (
    clip_indicators,
    gspo_token_ratio,
    policy_gradient_objective,
    ppo_clip_objective,
)
from rljax.objectives.value import clipped_value_loss

Array = Any
Metrics = dict[str, tuple[Array, Array]]
sg = jax.lax.stop_gradient


def _clean(batch: ObjectiveBatch) -> tuple[ObjectiveBatch, Array]:
    """Validate shapes; zero every field at masked positions; return (batch, bool mask)."""
    batch.validate()
    m = jnp.asarray(batch.mask_BxT, jnp.float32) > 0
    fields = {
        f.name: jnp.where(m, jnp.asarray(getattr(batch, f.name), jnp.float32), 0.0)
        for f in dataclasses.fields(batch)
        if f.name != "mask_BxT" and getattr(batch, f.name) is not None
    }
    return dataclasses.replace(batch, mask_BxT=m.astype(jnp.float32), **fields), m


class _Terms:
    """Accumulates the per-token loss and the metric pairs of one objective call."""

    def __init__(self, m: Array, correction: tuple[str, str] = ("token", "truncate")):
        self.m = m
        self.correction = correction
        self.n_tokens = m.sum().astype(jnp.float32)
        self.loss = jnp.zeros(m.shape, jnp.float32)
        self.metrics: Metrics = {}

    def metric(self, name: str, x: Array) -> None:
        self.metrics[name] = (jnp.where(self.m, sg(x), 0.0).sum(), self.n_tokens)

    def finish(self, aggregation: str, norm_const: Any) -> tuple[Array, Array, Metrics]:
        loss_sum, count = aggregate(self.loss, self.m, aggregation, norm_const=norm_const)
        self.metrics["loss"] = (sg(loss_sum), sg(count))
        return loss_sum, sg(count), self.metrics


def _common_terms(t: _Terms, b: ObjectiveBatch, coef: Coef, kl_kind: str | None, kl_clamp: Any) -> None:
    """KL-to-reference loss term, entropy bonus, and their metrics (when present)."""
    if b.ref_logp_BxT is not None:
        if kl_kind is not None:
            kl = kl_estimate(b.logp_BxT, b.ref_logp_BxT, kl_kind, clamp=kl_clamp,
                             old_logp=b.old_logp_BxT)
            t.loss = t.loss + coef.kl * kl
        # Reported as k3 whatever the loss uses: unbiased and non-negative.
        t.metric("kl_ref", kl_estimate(b.logp_BxT, b.ref_logp_BxT, "k3"))
    if b.entropy_BxT is not None:
        t.loss = t.loss - coef.entropy * b.entropy_BxT
        t.metric("entropy", b.entropy_BxT)
    # KL(old || new) from tokens sampled by pi_old: k3 with log r = logp - old_logp.
    t.metric("approx_kl_old", kl_estimate(b.old_logp_BxT, b.logp_BxT, "k3"))
    zero_adv_B = jnp.all(jnp.where(t.m, b.adv_BxT == 0, True), axis=1) & t.m.any(axis=1)
    t.metrics["zero_adv_seq_frac"] = (zero_adv_B.sum().astype(jnp.float32), t.m.any(axis=1).sum().astype(jnp.float32))


def tis_weighted(t: _Terms, b: ObjectiveBatch, coef: Coef, obj: Array) -> Array:
    """Weight a per-token objective by the sampler-gap correction (`sampler_correction`,
    level and mode from ``t.correction``) when sampler log-probs exist."""
    if b.sampler_logp_BxT is None:
        return obj
    level, mode = t.correction
    w, metrics = sampler_correction(b.old_logp_BxT, b.sampler_logp_BxT, t.m, level=level,
                                    mode=mode, low=coef.is_low, high=coef.tis_cap)
    t.metrics.update(metrics)
    t.metric("tis_weight", w)
    return obj * w


def token_ratio(b: ObjectiveBatch) -> Array:
    """The token ratio r = pi / pi_old, exp(logp - old_logp)."""
    return jnp.exp(b.logp_BxT - b.old_logp_BxT)


def clipped_surrogate(t: _Terms, b: ObjectiveBatch, coef: Coef, ratio: Array = None) -> Array:
    """PPO clipped surrogate of ``ratio`` (default `token_ratio`) with Coef's clip range and
    dual clip, plus clip metrics, then weighted by `tis_weighted`."""
    ratio = token_ratio(b) if ratio is None else ratio
    opts = dict(eps_low=coef.clip_low, eps_high=coef.clip_high, dual_clip=coef.dual_clip)
    obj = ppo_clip_objective(ratio, b.adv_BxT, **opts)
    low, high, dual = clip_indicators(ratio, b.adv_BxT, **opts)
    t.metric("clip_frac_low", low)
    t.metric("clip_frac_high", high)
    t.metric("dual_clip_frac", dual)
    t.metric("ratio", ratio)
    return tis_weighted(t, b, coef, obj)


def objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                    is_level, is_mode, extra=None) -> tuple[Array, Array, Metrics]:
    """The shared frame of every library objective, given its options.

    ``surrogate(t, b) -> obj_BxT`` is the per-token objective to maximise; the loss is its
    negative, plus ``extra(t, b)`` (the value loss for PPO), the common KL / entropy
    terms, then aggregation.
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_choice("is_level", is_level, IS_LEVELS)
    check_choice("is_mode", is_mode, IS_MODES)
    check_choice("kl_kind", kl_kind, KL_KINDS + (None,))
    b, m = _clean(batch)
    t = _Terms(m, (is_level, is_mode))
    t.loss = -surrogate(t, b)
    if extra is not None:
        extra(t, b)
    _common_terms(t, b, coef, kl_kind, kl_clamp)
    return t.finish(aggregation, norm_const)


def reinforce(
    batch: ObjectiveBatch,
    coef: Coef,
    *,
    aggregation: str = "token-mean",
    kl_kind: str | None = "k3",
    kl_clamp: float | None = None,
    norm_const: float | None = None,
    is_level: str = "token",
    is_mode: str = "truncate",
) -> tuple[Array, Array, Metrics]:
    """REINFORCE with a baseline: loss = -A_t log pi(a_t) [+ beta KL_t - alpha H_t].

    The advantage carries the baseline (R - b, e.g. `rloo_advantages`: RLOO,
    arXiv:2402.14740). On-policy: no ratio, no clipping, so one update per batch (the
    trainer's config refuses more); with `sampler_logp_BxT` each token is weighted by
    truncated IS weights pi_old / pi_sampler.
    """
    def surrogate(t, b):
        obj = tis_weighted(t, b, coef, policy_gradient_objective(b.logp_BxT, b.adv_BxT))
        t.metric("pg_objective", obj)
        return obj

    return objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                           is_level, is_mode)


def grpo(
    batch: ObjectiveBatch,
    coef: Coef,
    *,
    aggregation: str = "seq-mean-token-mean",
    kl_kind: str | None = "k3",
    kl_clamp: float | None = None,
    norm_const: float | None = None,
    is_level: str = "token",
    is_mode: str = "truncate",
) -> tuple[Array, Array, Metrics]:
    """GRPO (DeepSeekMath arXiv:2402.03300 §4.1, Eq. 3), to minimise:

      L = -1/G sum_i 1/|o_i| sum_t [ min(r_it A_it, clip(r_it, 1-eps_lo, 1+eps_hi) A_it)
                                      - beta * KL_t(pi || ref) ],
      r_it = pi(o_it) / pi_old(o_it),

    with the k3 estimator of Eq. 4 by default (as a loss term its gradient follows
    KL(ref || pi); `kl_kind="k3_ratio"` weights it by r_it, DeepSeek-V3.2's form whose
    gradient follows KL(pi || ref); see `rljax.objectives.kl`). Variants by options:
    DAPO (token-mean, kl_kind=None, clip_high 0.28; arXiv:2503.14476), Dr.GRPO
    ("seq-mean-token-sum-norm" with `norm_const` and group_advantages(std="none");
    arXiv:2503.20783), dual clip via `coef.dual_clip`, TIS via `sampler_logp_BxT`.
    """
    return objective_frame(batch, coef, lambda t, b: clipped_surrogate(t, b, coef), aggregation,
                           kl_kind, kl_clamp, norm_const, is_level, is_mode)


def gspo(
    batch: ObjectiveBatch,
    coef: Coef,
    *,
    aggregation: str = "seq-mean-token-mean",
    kl_kind: str | None = None,
    kl_clamp: float | None = None,
    norm_const: float | None = None,
    is_level: str = "token",
    is_mode: str = "truncate",
) -> tuple[Array, Array, Metrics]:
    """GSPO (arXiv:2507.18071): GRPO with the length-normalised sequence ratio.

      L = -1/G sum_i min(s_i A_i, clip(s_i, 1-eps_lo, 1+eps_hi) A_i),
      s_i = exp(1/|y_i| sum_t log(pi(y_it) / pi_old(y_it))),

    computed per token in the GSPO-token form (`gspo_token_ratio`), so the gradient flows
    through each token's log-prob. The paper uses far smaller clip ranges than GRPO
    (3e-4 / 4e-4): set them in `Coef`. No KL term by default (the paper drops it).
    """
    def surrogate(t, b):
        ratio = gspo_token_ratio(b.logp_BxT, b.old_logp_BxT, b.mask_BxT)
        return clipped_surrogate(t, b, coef, ratio)

    return objective_frame(batch, coef, surrogate, aggregation, kl_kind, kl_clamp, norm_const,
                           is_level, is_mode)


def _value_terms(t: _Terms, b: ObjectiveBatch, coef: Coef) -> None:
    b.require("values_BxT", "old_values_BxT", "returns_BxT", by="ppo")
    vloss, vclipped = clipped_value_loss(b.values_BxT, b.old_values_BxT, b.returns_BxT, coef.value_clip)
    t.loss = t.loss + coef.value * vloss
    t.metric("value_loss", vloss)
    t.metric("value_clip_frac", vclipped)
    residual = b.returns_BxT - b.values_BxT
    t.metric("ev_returns", b.returns_BxT)
    t.metric("ev_returns_sq", jnp.square(b.returns_BxT))
    t.metric("ev_residual", residual)
    t.metric("ev_residual_sq", jnp.square(residual))


def ppo(
    batch: ObjectiveBatch,
    coef: Coef,
    *,
    aggregation: str = "token-mean",
    kl_kind: str | None = None,
    kl_clamp: float | None = None,
    norm_const: float | None = None,
    is_level: str = "token",
    is_mode: str = "truncate",
) -> tuple[Array, Array, Metrics]:
    """PPO with a value model; the loss is minus the objective of arXiv:1707.06347 Eq. 9:

      L_t = -min(r_t A_t, clip(r_t, 1-eps_lo, 1+eps_hi) A_t) + c_v * L^V_t - c_e * H_t,

    with the PPO2 clipped value loss L^V (`clipped_value_loss`) on `values_BxT`,
    `old_values_BxT`, `returns_BxT` (required). The KL to the reference normally enters
    the reward (`kl_penalized_rewards`, DeepSeekMath Eq. 2) before GAE, so by default it
    is only reported; `kl_kind` adds it as a loss term too. Metrics include the pieces
    of the value model's explained variance (`explained_variance_from_sums`).
    """
    return objective_frame(batch, coef, lambda t, b: clipped_surrogate(t, b, coef), aggregation,
                           kl_kind, kl_clamp, norm_const, is_level, is_mode,
                           extra=lambda t, b: _value_terms(t, b, coef))
