"""The update's output head in one pass, for objectives that are sums over tokens.

Through :func:`rljax.train.learn.logprobs.linear_logprobs` an update costs four
``[B*C, D] x [D, V]`` products per chunk of ``C`` positions: the forward's logits, and in
the backward the logits again (a chunk's ``B*C*V`` floats are not kept), ``dh`` and
``dW``. The backward needs the logits' gradient

    d logits = a * (onehot - p) - e * p * (log p + H),

where ``a`` and ``e`` are the loss's derivatives by each token's log-prob and entropy; in
general they exist only once the whole loss has been computed, hence the recompute. An
objective is *token-separable* when its derivative at a token depends on that token's
log-prob and entropy alone (besides data, masks and stop-gradient weights): GRPO, DAPO,
Dr.GRPO, REINFORCE / RLOO, PPO's policy term, CISPO, SAPO, Clip-Cov and KL-Cov, with
token-level importance weights (``rljax.objectives.token_separable``). Then a chunk's
``a`` and ``e`` are known as soon as its log-probs are, and :func:`one_pass_head` forms the
chunk's ``dh`` and ``dW`` right there from the logits still in hand: three products and
one pass of exponentials a chunk instead of four and two.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from rljax.sharding import constrain_logical
from rljax.train.learn.linear_head import (DW_DXV_AXES, PARTIAL_DW_AXES, batch_shards,
                                           check_linear_args, chunk_grads, join_chunks,
                                           linear_chunk_stats, reduce_partial_dw, split_chunks)

Array = Any
#: ``token_grads(aux, logp_BxC, entropy_BxC, start) -> (a_BxC, e_BxC)``: the loss's
#: derivatives by the log-probs and entropies of the chunk at columns ``start ..
#: start + C - 1`` of the (padded) completion; ``aux`` is the data it reads.
TokenGrads = Callable[[Any, Array, Array, Array], tuple[Array, Array]]

__all__ = ["TokenGrads", "one_pass_head", "padded_width"]


def padded_width(t: int, chunk: int) -> int:
    """The completion width the chunks cover: ``T`` rounded up to whole chunks of
    ``min(chunk, T)`` (``token_grads`` sees its arrays at this width)."""
    c = min(chunk, t)
    return math.ceil(t / c) * c


def _chunk_pass(w, h_BxCxD, tgt_BxC, aux, start, token_grads, vocab_major, cd, inv_temp,
                with_ent, shards):
    z, e, s, logz, logp, ent = linear_chunk_stats(w, h_BxCxD, tgt_BxC, vocab_major, cd,
                                                   inv_temp)
    a, eg = token_grads(aux, logp, ent, start)
    ent_term = (eg.astype(jnp.float32)[..., None] * (z - logz[..., None] + ent[..., None])
                if with_ent else None)
    # p = e / s: d logits as in linear_logprobs' backward, from this pass's exponentials.
    dh, dw = chunk_grads(w, h_BxCxD, tgt_BxC, e / s[..., None], a.astype(jnp.float32),
                         ent_term, vocab_major, cd, inv_temp, shards)
    return logp, ent, dh, dw


def _run(w, h_BxTxD, tgt_BxT, aux, token_grads, vocab_major, cd, inv_temp, c, with_ent,
         w_names, w_grad=True):
    b, t, d = h_BxTxD.shape
    n = math.ceil(t / c)
    wc = w.astype(cd)
    # The chunks' dW stay partial sums per batch shard, [S, D, V], through the loop and
    # are reduced once after it, to W's own split (rljax.train.learn.logprobs, `partial_dw`).
    names_DxV = DW_DXV_AXES if w_names is None else (w_names[::-1] if vocab_major else w_names)
    s = batch_shards(b) if w_grad else None  # a frozen head (w_grad False): no dW at all

    def step(dw_SxDxV, xs):
        h, tgt, start = xs
        logp, ent, dh, dw = _chunk_pass(wc, h, tgt, aux, start, token_grads, vocab_major, cd,
                                        inv_temp, with_ent, s)
        return None if dw is None else dw_SxDxV + dw, (logp, ent, dh)

    starts = jnp.arange(n, dtype=jnp.int32) * c
    v = w.shape[0] if vocab_major else w.shape[1]
    init = None if s is None else constrain_logical(jnp.zeros((s, d, v), jnp.float32),
                                                    PARTIAL_DW_AXES)
    dw_SxDxV, (logp, ent, dh) = jax.lax.scan(
        step, init, (split_chunks(h_BxTxD, n, c), split_chunks(tgt_BxT, n, c), starts))
    dw_DxV = None if dw_SxDxV is None else reduce_partial_dw(dw_SxDxV, names_DxV)
    dw = dw_DxV.T if vocab_major and dw_DxV is not None else dw_DxV
    return join_chunks(logp, t), join_chunks(ent, t), join_chunks(dh, t), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _one_pass(w, h_BxTxD, tgt_BxT, aux, *static):
    logp, ent, _, _ = _run(w, h_BxTxD, tgt_BxT, aux, *static)
    return jnp.zeros((), jnp.float32), logp, ent


def _one_pass_fwd(w, h_BxTxD, tgt_BxT, aux, *static):
    # symbolic_zeros=True: primals arrive as CustomVJPPrimal (value, perturbed).
    w_grad = bool(w.perturbed)
    w, h_BxTxD, tgt_BxT = w.value, h_BxTxD.value, tgt_BxT.value
    aux = jax.tree.map(lambda x: x.value, aux, is_leaf=lambda x: hasattr(x, "perturbed"))
    logp, ent, dh, dw = _run(w, h_BxTxD, tgt_BxT, aux, *static, w_grad=w_grad)
    res = (None if dw is None else dw.astype(w.dtype), dh.astype(h_BxTxD.dtype))
    return (jnp.zeros((), jnp.float32), logp, ent), res


def _one_pass_bwd(*args):
    *_, res, cts = args
    dw, dh = res
    ct = cts[0]  # the surrogate's; log-probs and entropies leave as stop-gradient values
    if isinstance(ct, SymbolicZero):
        return None, None, None, None
    return (None if dw is None else ct.astype(dw.dtype) * dw, ct.astype(dh.dtype) * dh,
            None, None)


_one_pass.defvjp(_one_pass_fwd, _one_pass_bwd, symbolic_zeros=True)


def one_pass_head(
    w: Array,
    h_BxTxD: Array,
    targets_BxT: Array,
    token_grads: TokenGrads,
    aux: Any,
    *,
    vocab_major: bool,
    chunk: int,
    temperature: float = 1.0,
    compute_dtype: Any = jnp.float32,
    with_entropy: bool = False,
    weight_names: tuple | None = None,
) -> tuple[Array, Array, Array]:
    """Log-probs, entropies and the loss's gradient of a linear head in one pass.

    ``w``, ``vocab_major``, ``chunk``, ``temperature``, ``compute_dtype``: as in
    :func:`rljax.train.learn.logprobs.linear_logprobs`, whose log-probs and entropies these
    equal. ``token_grads(aux, logp_BxC, entropy_BxC, start)`` returns the loss's
    derivatives ``(a_BxC, e_BxC)`` for one chunk; it must be the derivative of a
    token-separable loss (module docstring), evaluated on the chunk's values. ``aux``
    (arrays) is passed to it and gets no gradient. ``with_entropy``: the loss depends on
    the entropies (otherwise ``e`` is ignored). ``weight_names``: ``w``'s logical axis
    names (``rljax.sharding``; default a decoder head's), to place its gradient, reduced
    once over the batch shards after the chunk loop, as ``w`` is on a mesh.

    Returns ``(surrogate, logp_BxT, entropy_BxT)``: the two float32 arrays under
    ``stop_gradient``, and ``surrogate``, a float32 zero whose gradient with respect to
    ``w`` and ``h_BxTxD`` is the loss's (the chunks' ``dW`` summed, ``dh`` per position),
    to be added to the loss. A ``w`` that is not differentiated (LoRA's frozen head) gets
    no ``dW``: the chunks do not form it.
    """
    _, t, _ = check_linear_args("one_pass_head", w, h_BxTxD, targets_BxT, chunk,
                                 temperature, vocab_major)
    surrogate, logp, ent = _one_pass(
        w, h_BxTxD, targets_BxT.astype(jnp.int32), aux, token_grads, bool(vocab_major),
        jnp.dtype(compute_dtype), 1.0 / float(temperature), min(chunk, t), bool(with_entropy),
        None if weight_names is None else tuple(weight_names))
    return surrogate, jax.lax.stop_gradient(logp), jax.lax.stop_gradient(ent)
