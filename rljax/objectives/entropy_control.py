"""Clip-Cov and KL-Cov token selection (Cui et al. 2025, arXiv:2505.22617, §4).

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" shows that
policy entropy falls in proportion to the covariance between a token's log-probability and
its advantage, and that a small fraction of tokens with large covariance drives the
collapse. Per token i of the batch (N real tokens),

  Cov_i = (log pi(y_i) - mean_j log pi(y_j)) * (A_i - mean_j A_j)

and two rules pick the tokens to restrain:

  Clip-Cov: draw r * N tokens uniformly at random among those with
            omega_low < Cov_i < omega_high that PPO's clip has not already clipped;
            their gradient is detached (paper: r = 2e-4, omega_low = 1, omega_high = 5);
  KL-Cov:   the top k * N tokens by Cov_i; they get a KL penalty
            beta * |log pi - log pi_old|
            (paper: k = 2e-3 for Qwen2.5-7B, 2e-4 for 32B; beta = 1).

The strict band and the candidates left after PPO's clip follow the authors' code
(PRIME-RL/Entropy-Mechanism-of-RL, adapted as verl's `compute_policy_loss_clip_cov` in
`verl/trainer/ppo/core_algos.py`: `clip_by_origin` tokens get covariance -inf, then
`(cov > clip_cov_lb) & (cov < clip_cov_ub)`): a clipped token's gradient is already 0,
so a draw spent on it would restrain nothing. KL-Cov takes the top k * N of all real
tokens (`torch.topk` there), clipped or not: its surrogate has no clip.

Both use statistics of the whole (mini)batch, and Clip-Cov randomness, so the trainer
computes the selection once per minibatch, before the objective, and passes it as the
array `ObjectiveBatch.cov_select_BxT`: the objectives (`clip_cov`, `kl_cov`) stay exact
under micro-batching. The count r * N is rounded down, with at least one token (as in
the authors' verl code).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_choice, check_ndim, check_same_shape
from rljax.objectives.surrogates import clip_indicators

Array = Any
sg = jax.lax.stop_gradient

COV_RULES = ("clip-cov", "kl-cov")


def token_covariance(logp_BxT: Array, adv_BxT: Array, mask_BxT: Array) -> Array:
    """Cov_i = (log pi_i - mean log pi)(A_i - mean A), means over the real tokens; 0 at
    masked positions; stop-gradient."""
    check_ndim("logp_BxT", logp_BxT, 2, "[B, T]")
    check_same_shape("adv_BxT", adv_BxT, "logp_BxT", logp_BxT)
    check_same_shape("mask_BxT", mask_BxT, "logp_BxT", logp_BxT)
    m = jnp.asarray(mask_BxT, jnp.float32) > 0
    n = jnp.maximum(m.sum(), 1).astype(jnp.float32)
    logp = jnp.where(m, sg(jnp.asarray(logp_BxT, jnp.float32)), 0.0)
    adv = jnp.where(m, sg(jnp.asarray(adv_BxT, jnp.float32)), 0.0)
    cov = (logp - logp.sum() / n) * (adv - adv.sum() / n)
    return jnp.where(m, cov, 0.0)


def _lowest_ranks(score_N: Array, k: Array) -> Array:
    """bool[N]: the k entries with the smallest score (ties broken by position)."""
    order = jnp.argsort(score_N, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return rank < k


def cov_selection(
    logp_BxT: Array,
    adv_BxT: Array,
    mask_BxT: Array,
    *,
    rule: str,
    ratio: float,
    low: float = 1.0,
    high: float = 5.0,
    key: Array | None = None,
    exclude_BxT: Array | None = None,
) -> Array:
    """float32 0/1 ``[B, T]``: the tokens Clip-Cov or KL-Cov restrains (module docstring).

    Args:
      logp_BxT: log pi of the taken tokens under the policy being updated (no gradient).
      adv_BxT: advantages per token. mask_BxT: 1 on real tokens.
      rule: "clip-cov" or "kl-cov".
      ratio: fraction of the real tokens to select (r or k), in (0, 1].
      low, high: Clip-Cov's covariance band (omega_low, omega_high), bounds excluded
        (KL-Cov ignores it).
      key: PRNG key, required for Clip-Cov's random draw.
      exclude_BxT: Clip-Cov only: 0/1, tokens that may not be drawn: those whose PPO clip
        is already active at the current ratio (`ppo_clipped_tokens`); None = none.
    """
    check_choice("rule", rule, COV_RULES)
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1]; got {ratio!r}")
    cov_N = token_covariance(logp_BxT, adv_BxT, mask_BxT).reshape(-1)
    real_N = (jnp.asarray(mask_BxT, jnp.float32) > 0).reshape(-1)
    # r * N rounded down (at least 1); the 1e-4 guards float32 rounding of exact products.
    k = jnp.maximum(jnp.floor(ratio * real_N.sum().astype(jnp.float32) + 1e-4), 1.0)
    if rule == "kl-cov":
        chosen = _lowest_ranks(jnp.where(real_N, -cov_N, jnp.inf), k) & real_N
    else:
        if key is None:
            raise ValueError("cov_selection(rule='clip-cov') needs a PRNG key")
        cand_N = real_N & (cov_N > low) & (cov_N < high)
        if exclude_BxT is not None:
            check_same_shape("exclude_BxT", exclude_BxT, "logp_BxT", logp_BxT)
            cand_N = cand_N & ~(jnp.asarray(exclude_BxT, jnp.float32) > 0).reshape(-1)
        u_N = jax.random.uniform(key, cov_N.shape)
        chosen = _lowest_ranks(jnp.where(cand_N, u_N, 2.0), k) & cand_N
    return chosen.reshape(jnp.shape(mask_BxT)).astype(jnp.float32)


def ppo_clipped_tokens(logp_BxT: Array, old_logp_BxT: Array, adv_BxT: Array, *,
                       eps_low: Any, eps_high: Any, dual_clip: Any = None) -> Array:
    """float32 0/1 ``[B, T]``: tokens whose PPO clip (or dual clip) is active at the ratio
    r = pi / pi_old, so their surrogate's gradient is already 0 (`clip_indicators`): the
    tokens Clip-Cov may not draw (verl's `clip_by_origin`, the clipped loss above the
    unclipped one: A > 0 with r > 1 + eps_high, A < 0 with r < 1 - eps_low)."""
    check_same_shape("old_logp_BxT", old_logp_BxT, "logp_BxT", logp_BxT)
    ratio = jnp.exp(sg(jnp.asarray(logp_BxT, jnp.float32))
                    - jnp.asarray(old_logp_BxT, jnp.float32))
    low, high, dual = clip_indicators(ratio, adv_BxT, eps_low=eps_low, eps_high=eps_high,
                                      dual_clip=dual_clip)
    return jnp.maximum(jnp.maximum(low, high), dual)
