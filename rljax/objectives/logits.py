"""Per-token log-probabilities and entropies from logits, in float32."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.objectives._validate import check_ndim

Array = Any


def token_logprobs(logits_BxTxV: Array, tokens_BxT: Array) -> Array:
    """log softmax(logits)[tokens]: `[B, T, V]`, `[B, T]` ints -> `[B, T]` float32.

    Computed as logit[token] - logsumexp(logits) in float32 (bf16 logits are upcast first),
    without materialising the full log-softmax.
    """
    check_ndim("logits_BxTxV", logits_BxTxV, 3, "[B, T, V]")
    check_ndim("tokens_BxT", tokens_BxT, 2, "[B, T]")
    if tuple(tokens_BxT.shape) != tuple(logits_BxTxV.shape[:2]):
        raise ValueError(
            f"tokens_BxT has shape {tuple(tokens_BxT.shape)} but logits_BxTxV has "
            f"[B, T] = {tuple(logits_BxTxV.shape[:2])}"
        )
    logits = logits_BxTxV.astype(jnp.float32)
    picked_BxT = jnp.take_along_axis(logits, tokens_BxT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked_BxT - jax.nn.logsumexp(logits, axis=-1)


def token_entropy(logits_BxTxV: Array) -> Array:
    """Entropy of softmax(logits) per position, -sum_v p_v log p_v: `[B, T, V]` -> `[B, T]`."""
    check_ndim("logits_BxTxV", logits_BxTxV, 3, "[B, T, V]")
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return -(jnp.exp(logp) * logp).sum(axis=-1)
