"""Advantage estimators: group-normalised (GRPO), RLOO, whitening, GAE.

All are pure functions of arrays. Group estimators take flat rewards `[B*G]` laid out
group by group (the G completions of prompt 0, then of prompt 1, ...), and return flat
per-sequence advantages; `broadcast_to_tokens` spreads them over a completion's tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_choice, check_group_size, check_ndim, check_same_shape

Array = Any

STD_MODES = ("population", "sample", "none")


def _groups(rewards: Array, group_size: int, minimum: int = 1) -> Array:
    n_groups = check_group_size(rewards, group_size, minimum=minimum)
    return jnp.asarray(rewards, jnp.float32).reshape(n_groups, group_size)


def _all_equal_NxG(r_NxG: Array) -> Array:
    """[N, 1] bool: True where every reward of the group is the same."""
    return (r_NxG.max(axis=1, keepdims=True) == r_NxG.min(axis=1, keepdims=True))


def group_advantages(
    rewards: Array, group_size: int, *, std: str = "population", eps: float = 1e-6
) -> Array:
    """GRPO's group-normalised advantage, A_i = (r_i - mean(r)) / (std(r) + eps).

    DeepSeekMath arXiv:2402.03300 §4.1.2 ("outcome supervision"): each completion's reward
    is normalised by its group's mean and standard deviation, and the result is the
    advantage of every token of that completion.

    Args:
      rewards: flat `[B*G]` rewards, groups laid out consecutively.
      group_size: G, a Python int dividing `len(rewards)`.
      std: "population" (ddof=0; the seed's table: 1,0,0,0 -> +1.73, -0.58, ...),
        "sample" (ddof=1, as the DeepSeekMath reference code, TRL and verl compute it) or
        "none" (only centre; Dr.GRPO, arXiv:2503.20783 §3.1).
      eps: added to the std before dividing.

    Returns:
      `[B*G]` float32 advantages. A group whose rewards are all equal gets exactly 0 (it
      carries no signal; the mean of equal floats need not round back to them exactly, so
      this is enforced rather than left to arithmetic).
    """
    check_choice("std", std, STD_MODES)
    r_NxG = _groups(rewards, group_size, minimum=2 if std == "sample" else 1)
    centred_NxG = r_NxG - r_NxG.mean(axis=1, keepdims=True)
    if std == "none":
        adv_NxG = centred_NxG
    else:
        ddof = 1 if std == "sample" else 0
        std_Nx1 = jnp.std(r_NxG, axis=1, keepdims=True, ddof=ddof)
        adv_NxG = centred_NxG / (std_Nx1 + eps)
    return jnp.where(_all_equal_NxG(r_NxG), 0.0, adv_NxG).reshape(-1)


def rloo_advantages(rewards: Array, group_size: int) -> Array:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j != i} r_j.

    Ahmadian et al. 2024, arXiv:2402.14740 ("RLOO"): each sample's baseline is the mean
    reward of the other G-1 samples of its prompt, which is unbiased. Equals
    G / (G-1) * (r_i - mean(r)). Needs G >= 2; all-equal groups give exactly 0.

    Args:
      rewards: flat `[B*G]` rewards, groups laid out consecutively.
      group_size: G >= 2, dividing `len(rewards)`.
    Returns:
      `[B*G]` float32 advantages.
    """
    r_NxG = _groups(rewards, group_size, minimum=2)
    others_mean_NxG = (r_NxG.sum(axis=1, keepdims=True) - r_NxG) / (group_size - 1)
    return jnp.where(_all_equal_NxG(r_NxG), 0.0, r_NxG - others_mean_NxG).reshape(-1)


def zero_variance_fraction(rewards: Array, group_size: int) -> Array:
    """Fraction of groups whose rewards are all equal (they give GRPO no learning signal).

    For binary rewards with success rate p and groups of G this is p^G + (1-p)^G.
    """
    r_NxG = _groups(rewards, group_size)
    return _all_equal_NxG(r_NxG).astype(jnp.float32).mean()


def broadcast_to_tokens(adv_B: Array, mask_BxT: Array) -> Array:
    """Spread per-sequence advantages over tokens: adv_BxT = adv_B[:, None] * mask_BxT."""
    check_ndim("adv_B", adv_B, 1, "[B]")
    check_ndim("mask_BxT", mask_BxT, 2, "[B, T]")
    if adv_B.shape[0] != mask_BxT.shape[0]:
        raise ValueError(f"adv_B has {adv_B.shape[0]} rows but mask_BxT has {mask_BxT.shape[0]}")
    return jnp.asarray(adv_B, jnp.float32)[:, None] * jnp.asarray(mask_BxT, jnp.float32)


def whiten(x: Array, mask: Array | None = None, *, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """Normalise `x` to zero mean and unit variance over the (masked) elements.

    out = (x - mean) / sqrt(var + eps), with mean and population variance taken over the
    elements where `mask` is 1 (all elements when `mask` is None). With shift_mean=False the
    mean is added back (as PPO implementations whiten advantages but not returns' scale).
    Masked-out positions of the output are 0, whatever `x` held there.
    """
    x = jnp.asarray(x, jnp.float32)
    if mask is None:
        mask = jnp.ones_like(x)
    check_same_shape("mask", mask, "x", x)
    m = jnp.asarray(mask, jnp.float32) > 0
    n = jnp.maximum(m.sum(), 1.0)
    xm = jnp.where(m, x, 0.0)
    mean = xm.sum() / n
    var = jnp.where(m, (xm - mean) ** 2, 0.0).sum() / n
    out = (xm - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(m, out, 0.0)


def gae(
    rewards: Array, values: Array, mask: Array, *, gamma: float, lam: float
) -> tuple[Array, Array]:
    """Generalised advantage estimation over masked sequences.

    Schulman et al. 2016, arXiv:1506.02438 §3 (Eqs. 11-16):
      delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},
    with V_{t+1} = 0 and A_{t+1} = 0 after a sequence's last real token (the episode ends
    there). Returns are the value targets R_t = A_t + V_t (the lambda-return).

    The steps are the real tokens: ``t + 1`` is the next real token, so a gap of masked
    tokens inside a sequence (a multi-turn rollout's observations, loss mask 0) is
    skipped, and the result on the real tokens equals GAE over the sequence with the
    gaps removed. A right-padded mask (ones then zeros) is the usual case.

    Args:
      rewards: `[B, T]` per-token rewards (usually the score on the last real token, minus
        a per-token KL penalty; see `kl_penalized_rewards`).
      values: `[B, T]` value predictions V_t. Whatever masked positions hold (junk, NaN) is
        ignored.
      mask: `[B, T]` 0/1: the real tokens (right padding and gaps are 0).
      gamma, lam: discount and GAE lambda (floats or traced scalars).

    Returns:
      (advantages, returns), both `[B, T]` float32, raw (not whitened), 0 where masked.
    """
    check_ndim("rewards", rewards, 2, "[B, T]")
    check_same_shape("values", values, "rewards", rewards)
    check_same_shape("mask", mask, "rewards", rewards)
    m_BxT = jnp.asarray(mask, jnp.float32) > 0
    r_BxT = jnp.where(m_BxT, jnp.asarray(rewards, jnp.float32), 0.0)
    v_BxT = jnp.where(m_BxT, jnp.asarray(values, jnp.float32), 0.0)

    def step(carry, inputs):
        v_next_B, adv_next_B = carry  # of the next real token (0 after the last)
        r_B, v_B, m_B = inputs
        adv_B = r_B + gamma * v_next_B - v_B + gamma * lam * adv_next_B
        carry = (jnp.where(m_B, v_B, v_next_B), jnp.where(m_B, adv_B, adv_next_B))
        return carry, jnp.where(m_B, adv_B, 0.0)

    zeros_B = jnp.zeros_like(r_BxT[:, 0])
    _, adv_TxB = jax.lax.scan(step, (zeros_B, zeros_B), (r_BxT.T, v_BxT.T, m_BxT.T),
                             reverse=True)
    adv_BxT = adv_TxB.T
    return adv_BxT, jnp.where(m_BxT, adv_BxT + v_BxT, 0.0)


def final_token_rewards(rewards_B: Array, mask_BxT: Array) -> Array:
    """Place each sequence's scalar reward on its last real token: `[B]` -> `[B, T]`.

    The last position where the mask is 1 (right padding or gaps before it allowed); a
    fully masked row gets no reward.
    """
    check_ndim("rewards_B", rewards_B, 1, "[B]")
    check_ndim("mask_BxT", mask_BxT, 2, "[B, T]")
    if rewards_B.shape[0] != mask_BxT.shape[0]:
        raise ValueError(f"rewards_B has {rewards_B.shape[0]} rows but mask_BxT has {mask_BxT.shape[0]}")
    m_BxT = jnp.asarray(mask_BxT, jnp.float32) > 0
    t_BxT = jnp.broadcast_to(jnp.arange(m_BxT.shape[1])[None, :], m_BxT.shape)
    last_B = jnp.max(jnp.where(m_BxT, t_BxT, -1), axis=1)
    last_BxT = t_BxT == last_B[:, None]
    return jnp.where(last_BxT & m_BxT, jnp.asarray(rewards_B, jnp.float32)[:, None], 0.0)
