"""Log-probabilities of completion tokens from hidden states, in rematerialised chunks.

The trainer never materialises float32 logits ``[B, T, V]`` for a whole batch: the
decoder returns hidden states ``[B, T, D]`` and the output projection, log-softmax and
gather run over ``chunk`` positions at a time inside ``jax.checkpoint``, so the backward
pass recomputes one chunk's ``[B, chunk, V]`` logits instead of storing all of them.

Sequence layout (shared by SFT and RL): prompts are left-padded to a common width P and
completions right-padded to width T; the model reads ``concat(prompt, completion)`` and the
hidden state at position ``P - 1 + t`` predicts completion token ``t``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

Array = Any


def _chunk_logprobs(logits_fn, head_params, h_BxCxD, tgt_BxC, inv_temp):
    """log p(target) and entropy of softmax(logits * inv_temp) for one chunk, float32."""
    logits_BxCxV = logits_fn(head_params, h_BxCxD).astype(jnp.float32) * inv_temp
    logz_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
    # A one-hot contraction rather than a gather keeps a vocab-sharded axis sharded.
    onehot = jax.nn.one_hot(tgt_BxC, logits_BxCxV.shape[-1], dtype=jnp.float32)
    logp_BxC = jnp.sum(logits_BxCxV * onehot, axis=-1) - logz_BxC
    p_BxCxV = jnp.exp(logits_BxCxV - logz_BxC[..., None])
    ent_BxC = logz_BxC - jnp.sum(p_BxCxV * logits_BxCxV, axis=-1)
    return logp_BxC, ent_BxC


def chunked_logprobs(
    logits_fn: Callable[[Any, Array], Array],
    head_params: Any,
    h_BxTxD: Array,
    targets_BxT: Array,
    *,
    chunk: int,
    temperature: float = 1.0,
) -> tuple[Array, Array]:
    """Per-token log-probs and entropies of ``targets_BxT`` from hidden states.

    ``logits_fn(head_params, h_...xD) -> logits_...xV`` is the output projection. The
    positions are processed ``chunk`` at a time under ``jax.checkpoint`` inside a scan, so
    peak memory holds one ``[B, chunk, V]`` block in the forward and in the backward pass.
    Log-probs are of ``softmax(logits / temperature)``, the distribution the sampler drew
    from. Returns ``(logp_BxT, entropy_BxT)``, both float32.
    """
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunked_logprobs: chunk must be an int >= 1, got {chunk!r}")
    if not temperature > 0:
        raise ValueError(f"chunked_logprobs: temperature must be > 0, got {temperature!r}")
    b, t, d = h_BxTxD.shape
    if tuple(targets_BxT.shape) != (b, t):
        raise ValueError(
            f"chunked_logprobs: targets_BxT has shape {tuple(targets_BxT.shape)}; expected {(b, t)}"
        )
    c = min(chunk, t)
    n = math.ceil(t / c)
    pad = n * c - t
    h = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
    tgt = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    h_NxBxCxD = h.reshape(b, n, c, d).swapaxes(0, 1)
    tgt_NxBxC = tgt.reshape(b, n, c).swapaxes(0, 1)
    inv_temp = 1.0 / float(temperature)
    one = jax.checkpoint(
        lambda hp, hc, tc: _chunk_logprobs(logits_fn, hp, hc, tc, inv_temp)
    )
    logp_NxBxC, ent_NxBxC = jax.lax.map(lambda xs: one(head_params, *xs), (h_NxBxCxD, tgt_NxBxC))
    logp_BxT = logp_NxBxC.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent_BxT = ent_NxBxC.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return logp_BxT, ent_BxT


def completion_hidden(model, prompt_BxP, prompt_mask_BxP, completion_BxT, completion_mask_BxT,
                      *, remat: bool = False) -> Array:
    """Hidden states ``[B, T, D]`` that predict each completion token.

    Runs the decoder on ``concat(prompt, completion)`` (left-padded prompts, right-padded
    completions) and keeps positions ``P - 1 .. P + T - 2``.
    """
    p = prompt_BxP.shape[1]
    t = completion_BxT.shape[1]
    ids = jnp.concatenate([prompt_BxP, completion_BxT], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask_BxP, completion_mask_BxT], axis=1) > 0
    h = model.hidden_states(ids, mask_BxT=mask, remat=remat)
    return h[:, p - 1 : p + t - 1]


def head_logits(model_graphdef):
    """A ``(params, h) -> logits`` function for ``chunked_logprobs`` from a decoder graphdef."""

    def fn(params, h):
        return nnx.merge(model_graphdef, params).logits_from_hidden(h)

    return fn


def policy_logprobs(graphdef, params, seqs: dict, *, chunk: int, temperature: float = 1.0,
                    remat: bool = False) -> tuple[Array, Array]:
    """Completion-token log-probs and entropies of the decoder ``(graphdef, params)``.

    ``seqs`` holds ``prompt_BxP``, ``prompt_mask_BxP``, ``completion_BxT`` and
    ``completion_mask_BxT``. Returns ``(logp_BxT, entropy_BxT)`` float32; values at masked
    positions are finite but meaningless.
    """
    model = nnx.merge(graphdef, params)
    h_BxTxD = completion_hidden(
        model, seqs["prompt_BxP"], seqs["prompt_mask_BxP"], seqs["completion_BxT"],
        seqs["completion_mask_BxT"], remat=remat,
    )
    return chunked_logprobs(
        head_logits(graphdef), params, h_BxTxD, seqs["completion_BxT"].astype(jnp.int32),
        chunk=chunk, temperature=temperature,
    )
