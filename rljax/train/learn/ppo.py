"""PPO pieces of the RL loop: the value model's forward, per-token KL-penalised rewards,
GAE advantages, and the KL coefficient controller.

PPO for language models (Ziegler et al. 2019; Ouyang et al. 2022, InstructGPT): the
reward of a completion is placed on its last token, each token pays a KL penalty
``-beta * (log pi(y_t) - log pi_ref(y_t))`` (DeepSeekMath Eq. 2 writes the same), GAE
(Schulman et al. 2016) turns rewards and value predictions into advantages and returns,
and the value model is trained on the returns with a clipped loss.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from rljax import objectives as obj
from rljax.train.learn.logprobs import completion_hidden

Array = Any


def value_predictions(graphdef, params, seqs: dict, *, remat: bool = False) -> Array:
    """Value predictions ``[B, T]`` for the states before each completion token.

    The value model (``rljax.models.ValueModel``) reads ``concat(prompt, completion)``;
    its output at position ``P - 1 + t`` is V(state before completion token t), aligned
    with the log-prob of token t.
    """
    model = nnx.merge(graphdef, params)
    h_BxTxD = completion_hidden(model, seqs["prompt_BxP"], seqs["prompt_mask_BxP"],
                                seqs["completion_BxT"], seqs["completion_mask_BxT"], remat=remat)
    return model.values_from_hidden(h_BxTxD).astype(jnp.float32)


def ppo_advantages(rewards_B, logp_BxT, ref_logp_BxT, values_BxT, mask_BxT, *, kl_coef,
                   kl_kind: str, gamma: float, lam: float, whiten_adv: bool):
    """Token rewards (score on the last token minus the per-token KL penalty), then GAE.

    Returns ``(adv_BxT, returns_BxT, token_rewards_BxT)``; advantages whitened over real
    tokens when ``whiten_adv`` (returns are not).
    """
    r_BxT = obj.final_token_rewards(jnp.asarray(rewards_B, jnp.float32), mask_BxT)
    if ref_logp_BxT is not None:
        r_BxT = obj.kl_penalized_rewards(r_BxT, logp_BxT, ref_logp_BxT, mask_BxT,
                                         coef=kl_coef, kind=kl_kind)
    adv_BxT, ret_BxT = obj.gae(r_BxT, values_BxT, mask_BxT, gamma=gamma, lam=lam)
    if whiten_adv:
        adv_BxT = obj.whiten(adv_BxT, mask_BxT)
    return adv_BxT, ret_BxT, r_BxT


def adaptive_kl_coef(beta, kl, *, target: float | None, horizon: int, batch_size: int):
    """The adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593 §2.2; InstructGPT):

      e_t = clip(KL_t / KL_target - 1, -0.2, 0.2),   beta_{t+1} = beta_t (1 + K_beta e_t n_t)

    with K_beta n_t = ``batch_size / horizon``; ``target`` None is the fixed controller.
    Pure jnp: the trainer runs it inside its learning program.
    """
    if target is None:
        return beta
    err = jnp.clip(kl / target - 1.0, -0.2, 0.2)
    return beta * (1.0 + err * batch_size / horizon)


class AdaptiveKLController:
    """Host-side wrapper of :func:`adaptive_kl_coef` with a fixed target and horizon."""

    def __init__(self, target: float | None, horizon: int):
        if target is not None and not target > 0:
            raise ValueError(f"AdaptiveKLController: target must be > 0 or None, got {target!r}")
        if not horizon >= 1:
            raise ValueError(f"AdaptiveKLController: horizon must be >= 1, got {horizon!r}")
        self.target, self.horizon = target, horizon

    def update(self, beta: float, kl: float, batch_size: int) -> float:
        """The next coefficient given the current one and the measured mean KL per token
        summed over the sequence (the paper's KL of the whole completion)."""
        return float(adaptive_kl_coef(beta, kl, target=self.target, horizon=self.horizon,
                                      batch_size=batch_size))


def sequence_kl(logp_BxT, ref_logp_BxT, mask_BxT) -> Array:
    """Mean over sequences of sum_t (log pi - log pi_ref): the controller's KL (k1).

    Rows without real tokens (padding) are left out of the mean."""
    m_BxT = jnp.asarray(mask_BxT) > 0
    d_B = jnp.where(m_BxT, logp_BxT - ref_logp_BxT, 0.0).sum(axis=1)
    rows = m_BxT.any(axis=1)
    return jnp.sum(jnp.where(rows, d_B, 0.0)) / jnp.maximum(rows.sum(), 1)
