"""Log-probabilities of completion tokens from hidden states, in rematerialised chunks.

The trainer never materialises float32 logits ``[B, T, V]`` for a whole batch: the
decoder returns hidden states ``[B, T, D]`` and the output projection, log-softmax and
gather run over ``chunk`` positions at a time inside ``jax.checkpoint``, so the backward
pass recomputes one chunk's ``[B, chunk, V]`` logits instead of storing all of them.
A linear head (tied embedding or ``lm_head``) goes through
``rljax.train.learn.linear_head.linear_logprobs`` (a hand-written backward forms each
chunk's logits gradient once, for ``dh`` and ``dW``); other heads through
:func:`chunked_logprobs` and plain autodiff.

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

from rljax.models.layers import compute_dtype as _compute_dtype
from rljax.train.batch import REPLAY_KEY
from rljax.train.learn import router
from rljax.train.learn.linear_head import (check_chunk_args, join_chunks, linear_logprobs,
                                           split_chunks)

Array = Any


def _chunk_logprobs(logits_fn, head_params, h_BxCxD, tgt_BxC, inv_temp):
    """log p(target) and entropy of softmax(logits * inv_temp) for one chunk, float32."""
    logits_BxCxV = logits_fn(head_params, h_BxCxD).astype(jnp.float32) * inv_temp
    logz_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
    # The target's logit as a one-hot contraction (plain autodiff; linear heads gather it).
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
    _, t, _ = check_chunk_args("chunked_logprobs", h_BxTxD, targets_BxT, chunk, temperature)
    c = min(chunk, t)
    n = math.ceil(t / c)
    inv_temp = 1.0 / float(temperature)
    one = jax.checkpoint(lambda hp, hc, tc: _chunk_logprobs(logits_fn, hp, hc, tc, inv_temp))
    logp_NxBxC, ent_NxBxC = jax.lax.map(
        lambda xs: one(head_params, *xs),
        (split_chunks(h_BxTxD, n, c), split_chunks(targets_BxT, n, c)))
    return join_chunks(logp_NxBxC, t), join_chunks(ent_NxBxC, t)


# ---------------------------------------------------------------------------------------
# The linear output projection with its own backward pass.
#
# ``jax.grad`` of ``chunked_logprobs`` leaves XLA a cotangent of the logits built from the
# whole loss and two matmuls on it; XLA:CPU computed that [B*C, V] cotangent twice, once
# transposed. The custom VJP below reduces what the program hands the head to two
# per-token scalars (the cotangents of log p and of the entropy), forms ``d logits`` once
# per chunk, and issues ``dh = g . W`` and ``dW`` (in ``W``'s own layout) on it.


def head_weight(model) -> tuple[Array, bool] | None:
    """``(W, vocab_major)`` of a decoder's linear output projection (the tied embedding
    ``[V, D]`` or the ``lm_head`` ``[D, V]``), or None for a model without one."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", None)
    name = "embed" if tied else "lm_head"
    if tied is None or not hasattr(model, name):
        return None
    return getattr(model, name)[...], bool(tied)




def completion_hidden(model, prompt_BxP, prompt_mask_BxP, completion_BxT, completion_mask_BxT,
                      *, remat: bool = False, group: int = 1, replay_BxLxSxK=None) -> Array:
    """Hidden states ``[B, T, D]`` that predict each completion token.

    Runs the decoder on ``concat(prompt, completion)`` (left-padded prompts, right-padded
    completions) and keeps positions ``P - 1 .. P + T - 2``. ``group`` G > 1: rows
    ``n G .. n G + G - 1`` share one prompt (the rollout's layout), which runs through the
    decoder once (``Decoder.grouped_hidden_states``; the rows' last slot, which predicts
    nothing, is left out): the same values on real positions. ``replay_BxLxSxK``: the
    sampler's expert ids of an MoE model (`REPLAY_KEY`), routed by when its
    ``MoeConfig.router_replay`` is "replay" (`rljax.models.moe`), ignored otherwise.
    An MoE decoder's router record goes to `rljax.train.learn.router.note` (kept only
    inside the update's ``router.recording``).
    """
    (b, p), t, g = prompt_BxP.shape, completion_BxT.shape[1], group
    moe = getattr(model.config, "moe", None)
    replay = None
    if replay_BxLxSxK is not None and moe is not None and moe.router_replay == "replay":
        replay = jnp.swapaxes(replay_BxLxSxK, 0, 1)

    def forward(ids, mask, replay_LxBxSxK):
        if replay_LxBxSxK is None and not router.wanted(model):
            return model.hidden_states(ids, mask_BxT=mask, remat=remat)
        h, rec = model.routed_hidden_states(ids, mask_BxT=mask, remat=remat,
                                            replay_ids_LxBxTxK=replay_LxBxSxK)
        router.note(rec, model.config)
        return h

    if g <= 1:
        ids = jnp.concatenate([prompt_BxP, completion_BxT], axis=1).astype(jnp.int32)
        mask = jnp.concatenate([prompt_mask_BxP, completion_mask_BxT], axis=1) > 0
        return forward(ids, mask, replay)[:, p - 1 : p + t - 1]
    if b % g:
        raise ValueError(f"completion_hidden: {b} rows do not split into groups of {g}")
    prompt_NxP = prompt_BxP.reshape(b // g, g, p)[:, 0].astype(jnp.int32)
    pmask_NxP = prompt_mask_BxP.reshape(b // g, g, p)[:, 0] > 0
    if t == 1:
        h_NxPxD = forward(prompt_NxP, pmask_NxP, None if replay is None else replay[:, ::g, :p])
        return jnp.repeat(h_NxPxD[:, -1:], g, axis=0)
    h_NxPxD, h_BxTxD, rec = model.routed_grouped_hidden_states(
        prompt_NxP, pmask_NxP, completion_BxT[:, : t - 1].astype(jnp.int32),
        completion_mask_BxT[:, : t - 1] > 0, remat=remat, replay_ids_LxBxSxK=replay)
    router.note(rec, model.config)
    return jnp.concatenate([jnp.repeat(h_NxPxD[:, -1:], g, axis=0), h_BxTxD], axis=1)


def head_logits(model_graphdef):
    """A ``(params, h) -> logits`` function for ``chunked_logprobs`` from a decoder graphdef."""
    return lambda params, h: nnx.merge(model_graphdef, params).logits_from_hidden(h)


def policy_logprobs(graphdef, params, seqs: dict, *, chunk: int, temperature: float = 1.0,
                    remat: bool = False, group: int = 1) -> tuple[Array, Array]:
    """Completion-token log-probs and entropies of the decoder ``(graphdef, params)``.

    ``seqs`` holds ``prompt_BxP``, ``prompt_mask_BxP``, ``completion_BxT`` and
    ``completion_mask_BxT`` (and, for router replay, `REPLAY_KEY`). ``group``: rows share their prompt in groups of this many
    (see :func:`completion_hidden`). Returns ``(logp_BxT, entropy_BxT)`` float32; values
    at masked positions are finite but meaningless.
    """
    model = nnx.merge(graphdef, params)
    h_BxTxD = completion_hidden(model, seqs["prompt_BxP"], seqs["prompt_mask_BxP"],
                                seqs["completion_BxT"], seqs["completion_mask_BxT"],
                                remat=remat, group=group, replay_BxLxSxK=seqs.get(REPLAY_KEY))
    return hidden_logprobs(graphdef, params, model, h_BxTxD, seqs["completion_BxT"],
                           chunk=chunk, temperature=temperature)


def hidden_logprobs(graphdef, params, model, h_BxTxD, targets_BxT, *, chunk, temperature):
    """``(logp_BxT, entropy_BxT)`` of ``targets_BxT`` from the hidden states of ``model``
    (merged from ``(graphdef, params)``): :func:`linear_logprobs` for a linear head."""
    targets_BxT, head = targets_BxT.astype(jnp.int32), head_weight(model)
    if head is not None:  # the linear head: log-probs with the hand-written backward
        return linear_logprobs(head[0], h_BxTxD, targets_BxT, vocab_major=head[1], chunk=chunk,
                               temperature=temperature, compute_dtype=_compute_dtype(model.config))
    return chunked_logprobs(head_logits(graphdef), params, h_BxTxD, targets_BxT, chunk=chunk,
                            temperature=temperature)
