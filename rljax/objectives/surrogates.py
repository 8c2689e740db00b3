"""Per-token policy surrogates: policy gradient, PPO clip (clip-higher, dual clip), GSPO, TIS.

Each returns the per-token objective **to maximise**; a loss is its negative. Reduction
over tokens is `aggregate`'s job.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_same_shape

Array = Any
sg = jax.lax.stop_gradient


def policy_gradient_objective(logp: Array, advantages: Array) -> Array:
    """REINFORCE with a baseline: A_t * log pi(a_t) (Williams 1992; Sutton et al. 2000).

    Its gradient is A_t * grad log pi(a_t), an unbiased estimate of the policy gradient
    when A_t = R - b for any baseline b that does not depend on the action (the seed's
    "Baselines and advantages"). The advantages are data (stop-gradient).
    """
    check_same_shape("advantages", advantages, "logp", logp)
    return sg(advantages) * logp


def ppo_clip_objective(
    ratio: Array,
    advantages: Array,
    *,
    eps_low: Any = 0.2,
    eps_high: Any = None,
    dual_clip: Any = None,
) -> Array:
    """PPO's clipped surrogate, min(r A, clip(r, 1 - eps_low, 1 + eps_high) A).

    Schulman et al. 2017, arXiv:1707.06347 §3 Eq. 7 (symmetric eps = 0.2 there). The seed's
    examples with eps 0.2: A=+1, r=1.5 -> 1.2 (capped); A=-1, r=0.5 -> -0.8 (held);
    A=-1, r=1.5 -> -1.5 (not clipped, so the correction stays).

    Args:
      ratio: pi_theta(a) / pi_old(a) per token (gradients flow through it).
      advantages: A per token (treated as data).
      eps_low: lower clip range (r >= 1 - eps_low while A < 0 pushes down).
      eps_high: upper clip range; None means eps_low. A larger value is DAPO's
        "clip-higher" (arXiv:2503.14476 §3.1, eps_low 0.2, eps_high 0.28): low-probability
        tokens with positive advantage may grow further, which counters entropy collapse.
      dual_clip: None (off) or c > 1 (inf also means off). Dual-clip PPO (Ye et al. 2020,
        arXiv:1912.09729, "dual-clip PPO"): for A < 0 the objective is bounded below by c * A,
        max(min(r A, clip(r) A), c A), so a huge ratio on a bad token cannot blow up the
        step; for A >= 0 it is unchanged.
    """
    check_same_shape("advantages", advantages, "ratio", ratio)
    if eps_high is None:
        eps_high = eps_low
    adv = sg(advantages)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    obj = jnp.minimum(ratio * adv, clipped * adv)
    if dual_clip is not None:
        # The floor is -inf for A >= 0 (and for c = inf), so those tokens are unchanged.
        floor = jnp.where(adv < 0, dual_clip * jnp.minimum(adv, 0.0), -jnp.inf)
        obj = jnp.maximum(obj, floor)
    return obj


def clip_indicators(
    ratio: Array, advantages: Array, *, eps_low: Any, eps_high: Any, dual_clip: Any = None
) -> tuple[Array, Array, Array]:
    """Float 0/1 masks of the tokens where each clip is active (gradient zeroed).

    Returns (low, high, dual): low where A < 0 and r < 1 - eps_low; high where A > 0 and
    r > 1 + eps_high; dual where A < 0 and r > c (dual clip binding).
    """
    adv = sg(advantages)
    r = sg(ratio)
    low = (adv < 0) & (r < 1.0 - eps_low)
    high = (adv > 0) & (r > 1.0 + eps_high)
    dual = (adv < 0) & (r > dual_clip) if dual_clip is not None else jnp.zeros_like(low)
    return low.astype(jnp.float32), high.astype(jnp.float32), dual.astype(jnp.float32)


def gspo_token_ratio(logp_BxT: Array, old_logp_BxT: Array, mask_BxT: Array) -> Array:
    """GSPO's sequence-level ratio, spread over tokens with per-token gradients.

    Zheng et al. 2025, arXiv:2507.18071 (§4, "GSPO") defines the length-normalised sequence
    ratio s_i = exp(1/|y_i| sum_t [log pi(y_it) - log pi_old(y_it)]); its "GSPO-token" variant
    writes it per token as s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]. Every token of a
    sequence gets the value s_i, and the gradient of s_it is s_i * grad log pi(y_it). With
    a sequence advantage broadcast over tokens and "seq-mean-token-mean" aggregation this
    is exactly GSPO's objective and gradient.

    Masked positions are ignored (whatever they hold) and get ratio 1, zero gradient.
    """
    check_same_shape("old_logp_BxT", old_logp_BxT, "logp_BxT", logp_BxT)
    check_same_shape("mask_BxT", mask_BxT, "logp_BxT", logp_BxT)
    m = jnp.asarray(mask_BxT, jnp.float32) > 0
    logp = jnp.where(m, logp_BxT, 0.0)
    log_ratio = jnp.where(m, logp - jnp.where(m, old_logp_BxT, 0.0), 0.0)
    len_B = jnp.maximum(m.sum(axis=1), 1)
    log_s_B = log_ratio.sum(axis=1) / len_B
    return jnp.exp(sg(log_s_B)[:, None] + logp - sg(logp))


def truncated_is_weights(old_logp: Array, sampler_logp: Array, cap: Any) -> Array:
    """Truncated importance-sampling weights min(pi_old / pi_sampler, cap), stop-gradient.

    When the sampler (e.g. a fast inference engine) and the trainer compute slightly
    different probabilities for the same policy, tokens come from pi_sampler but the
    surrogate assumes pi_old; multiplying each token's surrogate by the truncated ratio
    corrects the mismatch with bounded variance (truncated IS, Ionides 2008; the
    "TIS" fix of Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"). cap = inf gives plain IS.
    """
    check_same_shape("sampler_logp", sampler_logp, "old_logp", old_logp)
    return sg(jnp.minimum(jnp.exp(old_logp - sampler_logp), cap))
