"""Corrections for the sampler-trainer gap, and truncated-completion masking.

The sampler (an inference engine, or rljax's own sampler in other numerics) draws tokens
from pi_sampler, while the objective assumes they came from pi_old, the trainer's policy
at the same weights. Per token the importance ratio is

  rho_t = pi_old(y_t) / pi_sampler(y_t),      log rho_t = old_logp_t - sampler_logp_t,

and per sequence rho_i = prod_t rho_t (the importance weight of the whole completion,
the only one that is unbiased for a sequence-level reward). Two ways to bound it
(Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch"; verl's rollout correction):

  truncate (TIS):  w = clip(rho, low, C)               Yao et al. 2025, "Your efficient RL
                                                        framework secretly brings you
                                                        off-policy RL training"; Ionides 2008
                                                        (low = 0: min(rho, C); a low > 0
                                                        raises small ratios to it, as TRL's
                                                        truncate modes clamp at clip_min)
  mask (MIS):      w = rho * 1[low <= rho <= C]         IcePop (Ling team 2025, "Every
                                                        step evolves", §2.2); verl's
                                                        sequence IS + rejection sampling

at the token level (rho_t) or the sequence level (rho_i, the same weight on every token
of the sequence). The weight multiplies each token's surrogate, under stop_gradient.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_choice, check_ndim, check_same_shape
from rljax.objectives.kl import kl_estimate

Array = Any
Metrics = dict[str, tuple[Array, Array]]
sg = jax.lax.stop_gradient

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")


def sampler_correction(
    old_logp_BxT: Array,
    sampler_logp_BxT: Array,
    mask_BxT: Array,
    *,
    level: str = "token",
    mode: str = "truncate",
    low: Any = 0.0,
    high: Any = jnp.inf,
) -> tuple[Array, Metrics]:
    """Importance weights pi_old / pi_sampler, truncated or masked (module docstring).

    Args:
      old_logp_BxT, sampler_logp_BxT: log pi_old and log pi_sampler of the taken tokens.
      mask_BxT: 0/1, 1 on real tokens; masked positions get weight 0 and no metric.
      level: "token" (rho_t) or "sequence" (rho_i = prod_t rho_t on every token of i).
      mode: "truncate" (clip(rho, low, high): ratios above `high` lowered to it, below
        `low` raised to it) or "mask" (rho inside [low, high], 0 outside: the token, or
        the whole sequence, contributes nothing).
      low, high: the band (traced; high = inf for no upper bound).

    Returns:
      (w_BxT, metrics): stop-gradient float32 weights and `(sum, count)` metric pairs:
        is_ratio: mean token ratio rho_t over real tokens (unbounded);
        is_truncated_frac / is_masked_frac: fraction of tokens (token level) or of
          sequences (sequence level) whose weight a bound changed;
        is_seq_log_ratio: mean over sequences of log rho_i = sum_t log rho_t;
        is_kl: KL(pi_sampler || pi_old) per token, the k3 estimate rho - 1 - log rho on
          tokens drawn from pi_sampler (unbiased, >= 0; Schulman 2020).
    """
    check_choice("level", level, IS_LEVELS)
    check_choice("mode", mode, IS_MODES)
    check_ndim("old_logp_BxT", old_logp_BxT, 2, "[B, T]")
    check_same_shape("sampler_logp_BxT", sampler_logp_BxT, "old_logp_BxT", old_logp_BxT)
    check_same_shape("mask_BxT", mask_BxT, "old_logp_BxT", old_logp_BxT)
    m = jnp.asarray(mask_BxT, jnp.float32) > 0
    log_rho_BxT = sg(jnp.where(m, jnp.asarray(old_logp_BxT, jnp.float32)
                               - jnp.asarray(sampler_logp_BxT, jnp.float32), 0.0))
    has_B = m.any(axis=1)
    seq_log_rho_B = log_rho_BxT.sum(axis=1)
    log_w = (log_rho_BxT if level == "token"
             else jnp.broadcast_to(seq_log_rho_B[:, None], m.shape))
    log_high = jnp.log(jnp.asarray(high, jnp.float32))
    log_low = jnp.log(jnp.asarray(low, jnp.float32))  # -inf for low = 0
    if mode == "truncate":
        changed = (log_w > log_high) | (log_w < log_low)
        w = jnp.exp(jnp.clip(log_w, log_low, log_high))
    else:
        inside = (log_w >= log_low) & (log_w <= log_high)
        changed = ~inside
        # exp only of in-band values, so an out-of-band huge ratio never overflows.
        w = jnp.where(inside, jnp.exp(jnp.where(inside, log_w, 0.0)), 0.0)
    w = jnp.where(m, w, 0.0)
    n_tok = m.sum().astype(jnp.float32)
    n_seq = has_B.sum().astype(jnp.float32)
    tok_sum = lambda x: jnp.where(m, x, 0.0).sum()  # noqa: E731
    frac = ((tok_sum(changed.astype(jnp.float32)), n_tok) if level == "token"
            else ((changed[:, 0] & has_B).sum().astype(jnp.float32), n_seq))
    metrics = {
        "is_ratio": (tok_sum(jnp.exp(log_rho_BxT)), n_tok),
        f"is_{'truncated' if mode == 'truncate' else 'masked'}_frac": frac,
        "is_seq_log_ratio": (jnp.where(has_B, seq_log_rho_B, 0.0).sum(), n_seq),
        # k3 with log r = log rho: KL(pi_sampler || pi_old) from tokens drawn by the sampler.
        "is_kl": (tok_sum(kl_estimate(jnp.zeros_like(log_rho_BxT), log_rho_BxT, "k3")), n_tok),
    }
    return sg(w), jax.tree.map(sg, metrics)


def mask_truncated_completions(mask_BxT: Array, truncated_B: Array) -> Array:
    """The completion mask with every truncated completion's row set to 0.

    DAPO (Yu et al. 2025, arXiv:2503.14476 §3.4, "overlong filtering"): a completion cut
    at the generation budget has no final answer, so its reward is noise; masking its loss
    is the alternative to overlong reward shaping (TRL's `mask_truncated_completions`).
    An all-zero row is padding for `aggregate` in every mode (no loss, no gradient, not
    counted in the token or sequence count), so this is exact under micro-batching.
    Advantages should be computed before masking: the truncated completions still count
    in their group's baseline.
    """
    check_ndim("mask_BxT", mask_BxT, 2, "[B, T]")
    check_ndim("truncated_B", truncated_B, 1, "[B]")
    keep_B = jnp.asarray(truncated_B, jnp.float32) <= 0
    return jnp.where(keep_B[:, None], jnp.asarray(mask_BxT, jnp.float32), 0.0)


def behaviour_gap(logp_BxT: Array, sampler_logp_BxT: Array, mask_BxT: Array) -> Metrics:
    """How far the learner's policy is from the one that drew the tokens (the behaviour
    policy, the sampler's log-probs), as metric pairs over real tokens. On a batch's
    first update the learner's policy is the proximal one (the weights before the
    update): in a synchronous step the gap is the sampler's numerics; in an asynchronous
    one (``RLConfig.max_staleness``) it is the policy lag too. With log rho_t =
    logp_t - sampler_logp_t (stop-gradient):

      sampler_gap:   mean |log rho_t|                        (sum, count)
      mismatch_kl:   KL(pi_behaviour || pi) per token, k3: rho - 1 - log rho (sum, count)
      is_weight_max / is_weight_min: max / min of rho_t      (value, count): combined by
                     max / min, not summed (``rljax.train.learn.update.accumulate``)
    """
    m = jnp.asarray(mask_BxT, jnp.float32) > 0
    log_rho = jnp.where(m, sg(jnp.asarray(logp_BxT, jnp.float32))
                        - jnp.asarray(sampler_logp_BxT, jnp.float32), 0.0)
    rho = jnp.exp(log_rho)
    n = m.sum().astype(jnp.float32)
    k3 = kl_estimate(jnp.zeros_like(log_rho), log_rho, "k3")
    return {"sampler_gap": (jnp.where(m, jnp.abs(log_rho), 0.0).sum(), n),
            "mismatch_kl": (jnp.where(m, k3, 0.0).sum(), n),
            "is_weight_max": (jnp.max(jnp.where(m, rho, 0.0)), n),
            "is_weight_min": (jnp.min(jnp.where(m, rho, jnp.inf)), n)}
