"""Value-model loss (PPO2's clipped squared error) and the explained variance of values."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from rljax.objectives._validate import check_same_shape

Array = Any


def clipped_value_loss(values: Array, old_values: Array, returns: Array, clip: Any) -> tuple[Array, Array]:
    """PPO2's clipped value loss per token, and where the clipped branch is the larger.

    loss = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

    The value-function clipping of OpenAI baselines' PPO2 (also in InstructGPT's PPO and
    "The 37 implementation details of PPO", Huang et al. 2022): the value prediction may
    not move more than c from its rollout-time value for the pessimistic (max) term.
    The 0.5 makes the gradient of the unclipped term V - R. c = inf turns clipping off.

    Returns:
      (loss, clipped): per-token losses and float 0/1 where the clipped term is strictly
      larger (those tokens get no gradient from the loss).
    """
    check_same_shape("old_values", old_values, "values", values)
    check_same_shape("returns", returns, "values", values)
    v_clipped = old_values + jnp.clip(values - old_values, -clip, clip)
    err = jnp.square(values - returns)
    err_clipped = jnp.square(v_clipped - returns)
    return 0.5 * jnp.maximum(err, err_clipped), (err_clipped > err).astype(jnp.float32)


def explained_variance(values_BxT: Array, returns_BxT: Array, mask_BxT: Array) -> Array:
    """Explained variance of value predictions over the real tokens (``mask_BxT`` > 0):

      EV = 1 - Var[R - V] / Var[R]

    (population variances over the masked tokens; OpenAI baselines' PPO2 and Huang et al.
    2022 log it). 1 = V predicts the returns exactly, 0 = no better than a constant, < 0 =
    worse than the mean. NaN when the returns do not vary (Var[R] = 0) or no token is
    real. Two-pass (mean, then squared deviations) for float32 accuracy.
    """
    check_same_shape("returns_BxT", returns_BxT, "values_BxT", values_BxT)
    check_same_shape("mask_BxT", mask_BxT, "values_BxT", values_BxT)
    m = jnp.asarray(mask_BxT, jnp.float32)
    n = jnp.sum(m)
    r = jnp.asarray(returns_BxT, jnp.float32)
    res = r - jnp.asarray(values_BxT, jnp.float32)

    def var(x):
        mean = jnp.sum(x * m) / n
        return jnp.sum(jnp.square(x - mean) * m) / n

    var_r = var(r)
    return jnp.where(var_r > 0, 1.0 - var(res) / var_r, jnp.nan)


def explained_variance_from_sums(sums: dict[str, tuple[Array, Array]]) -> Array:
    """:func:`explained_variance` from the ``ev_*`` (sum, count) metric pairs of ``ppo``.

    The pieces are sums of R, R^2, R - V and (R - V)^2 over real tokens, so they add up
    over micro-batches and devices like any other metric; call this after summing.
    NaN when the returns do not vary.
    """

    def mean(name):
        s, n = sums[name]
        return s / jnp.maximum(n, 1.0)

    var_r = mean("ev_returns_sq") - jnp.square(mean("ev_returns"))
    var_res = mean("ev_residual_sq") - jnp.square(mean("ev_residual"))
    return jnp.where(var_r > 0, 1.0 - var_res / var_r, jnp.nan)
