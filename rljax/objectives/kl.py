"""KL(pi || ref) estimators from the log-probs of sampled tokens (Schulman 2020).

J. Schulman, "Approximating KL Divergence" (blog post, 2020). With x ~ pi and
log r = log ref(x) - log pi(x):
  k1 = -log r                 unbiased for KL(pi||ref), high variance, can be negative;
  k2 = (log r)^2 / 2          biased, low variance, >= 0;
  k3 = (r - 1) - log r        unbiased, low variance, >= 0 (DeepSeekMath Eq. 4's KL term).

Their values estimate KL(pi || ref). Their *gradients*, when an estimator is used as a
loss term and differentiated through log pi on tokens sampled from pi (as GRPO does,
arXiv:2402.03300 Eq. 3), follow different divergences (tests/test_objectives_kl.py checks
each exactly by enumerating a small vocabulary):
  grad E[k1] = E[grad log pi] = 0            (k1 in the loss does nothing on average);
  grad E[k2] = grad KL(pi || ref)             (the reverse KL the value estimates);
  grad E[k3] = grad KL(ref || pi)             (the forward KL; what GRPO's loss optimises).
"k3_ratio" is DeepSeek-V3.2's unbiased form (arXiv:2512.02556 §3.1, "unbiased KL
estimate"; TRL's `use_bias_correction_kl`): k3 weighted by the differentiable ratio
pi / pi_old of tokens sampled from pi_old,
  k3_ratio = (pi / pi_old) * k3,    E_{pi_old}[k3_ratio] = sum_x pi(x) k3(x) = KL(pi || ref),
so both its value and its gradient are those of KL(pi || ref), on- or off-policy (at
pi = pi_old its value is k3, its gradient k3 grad log pi + grad k3).
As a per-token reward penalty (PPO, DeepSeekMath Eq. 2: r_t - beta * log(pi/ref)) the
estimate enters through the reward, without gradient; k1 is the usual choice there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_choice, check_same_shape

Array = Any

KL_KINDS = ("k1", "k2", "k3", "k3_ratio")


def kl_estimate(logp: Array, ref_logp: Array, kind: str, *, clamp: float | None = None,
                old_logp: Array | None = None) -> Array:
    """Per-token estimate of KL(pi || ref) from log pi and log ref of the sampled tokens.

    Args:
      logp: log pi(x_t), any shape.
      ref_logp: log ref(x_t), same shape.
      kind: "k1", "k2", "k3" or "k3_ratio" (the module docstring gives the formulas and
        gradients).
      clamp: None (default: unclamped, so the estimator stays unbiased) or c > 0 to clip
        the estimate to [-c, c] (as verl does for k3 against exp overflow); for "k3_ratio"
        the k3 factor is clipped, before the ratio weights it.
      old_logp: log pi_old(x_t), the sampling policy; required by "k3_ratio" only.

    Returns:
      Per-token estimates, float32, same shape as `logp`.
    """
    check_choice("kind", kind, KL_KINDS)
    check_same_shape("ref_logp", ref_logp, "logp", logp)
    if kind == "k3_ratio" and old_logp is None:
        raise ValueError("kl_estimate(kind='k3_ratio') needs old_logp (log pi_old of the "
                         "sampled tokens); got None")
    log_r = jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32)
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * jnp.square(log_r)
    else:
        # expm1 keeps (r - 1) accurate when pi and ref nearly agree.
        kl = jnp.expm1(log_r) - log_r
    if clamp is not None:
        if not clamp > 0:
            raise ValueError(f"clamp must be None or > 0; got {clamp!r}")
        kl = jnp.clip(kl, -clamp, clamp)
    if kind == "k3_ratio":
        check_same_shape("old_logp", old_logp, "logp", logp)
        kl = jnp.exp(jnp.asarray(logp, jnp.float32) - jnp.asarray(old_logp, jnp.float32)) * kl
    return kl


def kl_penalized_rewards(
    rewards_BxT: Array,
    logp_BxT: Array,
    ref_logp_BxT: Array,
    mask_BxT: Array,
    *,
    coef: Array,
    kind: str = "k1",
    clamp: float | None = None,
) -> Array:
    """Per-token rewards with a KL penalty, r_t - beta * KL_t (DeepSeekMath Eq. 2).

    The penalty is data, not a loss term: it is computed under stop_gradient and enters
    the advantages through GAE (PPO / InstructGPT style). Masked positions are 0.
    "k3_ratio" is refused: its ratio only matters for a gradient, and a reward has none.
    """
    if kind == "k3_ratio":
        raise ValueError("kl_penalized_rewards: kind='k3_ratio' is a loss term (its ratio "
                         "weights a gradient); allowed: 'k1', 'k2' or 'k3'")
    check_same_shape("rewards_BxT", rewards_BxT, "logp_BxT", logp_BxT)
    check_same_shape("mask_BxT", mask_BxT, "logp_BxT", logp_BxT)
    m = jnp.asarray(mask_BxT, jnp.float32) > 0
    logp = jnp.where(m, logp_BxT, 0.0)
    ref = jnp.where(m, ref_logp_BxT, 0.0)
    kl = jax.lax.stop_gradient(kl_estimate(logp, ref, kind, clamp=clamp))
    return jnp.where(m, jnp.asarray(rewards_BxT, jnp.float32) - coef * kl, 0.0)
