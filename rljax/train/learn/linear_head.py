"""The linear output head's chunked log-probabilities with a hand-written backward
(:func:`linear_logprobs`): each chunk's logits gradient is formed once, for ``dh`` and
``dW``; on a mesh the weight gradient's partial products are reduced as the weight is
sharded (:func:`reduce_partial_dw`). The one-pass head (``rljax.train.learn.onepass``)
reuses the chunk pieces. ``rljax.train.learn.logprobs`` calls it for a linear head."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec

from rljax.sharding import BATCH_AXES, constrain_logical, constraints_enabled, fitted_spec

Array = Any


def check_chunk_args(name: str, h_BxTxD, targets_BxT, chunk, temperature) -> tuple[int, int, int]:
    """Validate the chunked log-prob arguments; returns ``(B, T, D)``."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{name}: chunk must be an int >= 1, got {chunk!r}")
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature!r}")
    b, t, d = h_BxTxD.shape
    if tuple(targets_BxT.shape) != (b, t):
        raise ValueError(
            f"{name}: targets_BxT has shape {tuple(targets_BxT.shape)}; expected {(b, t)}"
        )
    return b, t, d


def check_linear_args(name: str, w, h_BxTxD, targets_BxT, chunk, temperature,
                      vocab_major) -> tuple[int, int, int]:
    """``check_chunk_args`` plus the linear head's weight against the hidden size."""
    b, t, d = check_chunk_args(name, h_BxTxD, targets_BxT, chunk, temperature)
    if w.ndim != 2 or (w.shape[1] if vocab_major else w.shape[0]) != d:
        raise ValueError(f"{name}: weight shape {tuple(w.shape)} does not match hidden "
                         f"size {d} (vocab_major={vocab_major})")
    return b, t, d


def _linear_logits(w, h, vocab_major: bool, cd):
    """float32 logits of ``h [..., D]`` through ``W`` (``[V, D]`` if ``vocab_major``, else
    ``[D, V]``), inputs cast to ``cd``: the same einsum as ``Decoder.logits_from_hidden``."""
    spec = "...d,vd->...v" if vocab_major else "...d,dv->...v"
    return jnp.einsum(spec, h.astype(cd), w.astype(cd), preferred_element_type=jnp.float32)


def linear_chunk_stats(w, h_BxCxD, tgt_BxC, vocab_major, cd, inv_temp):
    """One chunk's ``(z, e, s, logz, logp, ent)``: logits ``z`` (scaled by ``inv_temp``),
    ``e = exp(z - max z)``, ``s = sum(e)``, log Z, the target's log-prob, the entropy."""
    z = _linear_logits(w, h_BxCxD, vocab_major, cd) * inv_temp
    # One exp per logit serves both log Z and the entropy (E_p[z] = sum(e z) / sum(e));
    # logsumexp followed by p = exp(z - log Z) took two passes of exp over [B, C, V].
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)
    s = jnp.sum(e, axis=-1)
    logz = m[..., 0] + jnp.log(s)
    # The target's logit by a gather along V: the same value as the one-hot contraction
    # (exact), without writing a [B, C, V] product first (XLA:CPU did: 0.35 s of the
    # benchmark's 1.7 s reference forward). With V sharded, the SPMD partitioner gathers
    # on each shard and all-reduces the [B, C] result: V stays sharded.
    logp = jnp.take_along_axis(z, tgt_BxC[..., None], axis=-1,
                               mode="promise_in_bounds")[..., 0] - logz
    ent = logz - jnp.sum(e * z, axis=-1) / s
    return z, e, s, logz, logp, ent


# ---------------------------------------------------------------------------------------
# The head weight's gradient across chunks, reduced once.
#
# A chunk's dW = h^T . g contracts the batch rows, split over data x fsdp: a partial sum
# per batch shard. Summed into a [D, V] accumulator inside the chunk loop, it is reduced
# once per chunk (64 x 545 MB a step on 0.5b-v5e8, docs/pods.md "Collective audit").
# Kept apart as [S, D, V] (S = the batch shards, split like the rows), each chunk's
# product is local and one sum over S after the loop (`reduce_partial_dw`: a
# reduce-scatter) is the one reduction per micro-batch, at the cost of D x V / tensor float32 a chip (0.5B: 545 MB) in the loop.

#: Logical axes of the partial accumulator ``[S, D, V]``: S split as the rows are.
PARTIAL_DW_AXES = ("batch", None, "vocab")
#: Logical axes of a linear head's ``dW`` in the ``[D, V]`` layout (tied or not).
DW_DXV_AXES = ("embed", "vocab")


def batch_shards(b: int) -> int:
    """The number of batch shards (data x fsdp of the mesh set by ``jax.set_mesh``) that
    the ``[S, D, V]`` partial sums keep apart: 1 off a mesh, when ``b`` rows do not split
    evenly, or inside ``rljax.sharding.logical_constraints(False)``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not constraints_enabled():
        return 1
    s = math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)
    return s if b % s == 0 else 1


def partial_dw(h_BxCxD, g_BxCxV, cd, s: int):
    """``h^T . g`` per batch shard: ``[S, D, V]`` float32 (``S = s`` groups of rows)."""
    b, c, d = h_BxCxD.shape
    h = h_BxCxD.astype(cd).reshape(s, b // s, c, d)
    g = g_BxCxV.reshape(s, b // s, c, g_BxCxV.shape[-1])
    dw = jnp.einsum("sbcd,sbcv->sdv", h, g, preferred_element_type=jnp.float32)
    return constrain_logical(dw, PARTIAL_DW_AXES)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def reduce_partial_dw(dw_SxDxV, names_DxV=DW_DXV_AXES):
    """The partial sums added over the batch shards, placed as the head weight is.

    On a mesh, a reduce-scatter over the batch axes that split W's D (each chip receives
    only its own slice of the sum: half the bytes of the all-reduce GSPMD makes of a sum
    followed by a slice) and an all-reduce over the others (``data``); where W's split does
    not allow that (D split by a non-batch axis, V by a batch one), the sum as GSPMD
    places it. XLA:CPU keeps the reduce-scatter; XLA:TPU (libtpu 0.0.42.1) decomposes it
    into an all-reduce and a slice again (docs/pods.md)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not constraints_enabled():
        return constrain_logical(jnp.sum(dw_SxDxV, axis=0), names_DxV)
    s_spec = fitted_spec(("batch",), dw_SxDxV.shape[:1], mesh)[0]
    d_spec, v_spec = fitted_spec(names_DxV, dw_SxDxV.shape[1:], mesh)
    rows, d_axes, v_axes = _axes(s_spec), _axes(d_spec), _axes(v_spec)
    if not rows or not set(d_axes) <= set(rows) or set(v_axes) & set(rows):
        return constrain_logical(jnp.sum(dw_SxDxV, axis=0), names_DxV)
    rest = tuple(a for a in rows if a not in d_axes and mesh.shape[a] > 1)

    def local(dw):
        x = jnp.sum(dw, axis=0)
        x = jax.lax.psum(x, rest) if rest else x
        return jax.lax.psum_scatter(x, d_axes, scatter_dimension=0, tiled=True) if d_axes \
            else x

    return jax.shard_map(local, in_specs=PartitionSpec(s_spec, None, v_spec),
                         out_specs=PartitionSpec(d_spec, v_spec), check_vma=False)(dw_SxDxV)


def chunk_grads(wc, h_BxCxD, tgt_BxC, p, a, ent_term, vocab_major, cd, inv_temp, shards):
    """One chunk's ``dh`` and partial ``dW`` (:func:`partial_dw`; ``wc``: ``W`` in ``cd``)
    from ``d logits = (a (onehot - p) - p ent_term) / temperature``, with ``p`` the
    probabilities, ``a`` the target log-probs' cotangents (None: 0) and ``ent_term`` the
    entropies' cotangents times ``log p + H`` (None: 0). ``shards=None``: a frozen head
    (LoRA's): ``dW`` is not formed, None in its place."""
    scale = 0.0 if a is None else a[..., None]
    if ent_term is not None:
        scale = scale + ent_term
    g = -p * scale
    if a is not None:
        g = g + jax.nn.one_hot(tgt_BxC, p.shape[-1], dtype=jnp.float32) * a[..., None]
    g = (g * inv_temp).astype(cd)
    dh = jnp.einsum("bcv,vd->bcd" if vocab_major else "bcv,dv->bcd", g, wc,
                    preferred_element_type=jnp.float32)
    # dW as [D, V] = h^T . g (asked for as g^T . h, XLA:CPU wrote a transposed copy of g;
    # a tied W's [V, D] is the transpose of this small result instead).
    return dh, None if shards is None else partial_dw(h_BxCxD, g, cd, shards)


def split_chunks(x, n: int, c: int):
    """``[B, T, ...] -> [N, B, C, ...]`` (T zero-padded to ``N * C``)."""
    b, t = x.shape[:2]
    x = jnp.pad(x, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b, n, c, *x.shape[2:]).swapaxes(0, 1)


def join_chunks(x_NxBxC, t: int):
    """``[N, B, C, ...] -> [B, T, ...]``: :func:`split_chunks` undone."""
    n, b, c = x_NxBxC.shape[:3]
    return x_NxBxC.swapaxes(0, 1).reshape(b, n * c, *x_NxBxC.shape[3:])[:, :t]


def _over_chunks(fn, xs, n: int):
    """``lax.map(fn, xs)`` over the leading chunk axis, without a loop for one chunk."""
    if n == 1:
        return jax.tree.map(lambda y: y[None], fn(jax.tree.map(lambda x: x[0], xs)))
    return jax.lax.map(fn, xs)


def _linear_primal(w, h_BxTxD, tgt_BxT, vocab_major, cd, inv_temp, c):
    """``(logp, entropy, log Z)``, each ``[B, T]``, chunk by chunk."""
    t = h_BxTxD.shape[1]
    n = math.ceil(t / c)
    logz, logp, ent = _over_chunks(
        lambda xs: linear_chunk_stats(w, *xs, vocab_major, cd, inv_temp)[3:],
        (split_chunks(h_BxTxD, n, c), split_chunks(tgt_BxT, n, c)), n)
    return join_chunks(logp, t), join_chunks(ent, t), join_chunks(logz, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _linear_logprobs(w, h_BxTxD, tgt_BxT, vocab_major, cd, inv_temp, c):
    logp, ent, _ = _linear_primal(w, h_BxTxD, tgt_BxT, vocab_major, cd, inv_temp, c)
    return logp, ent


def _linear_fwd(w, h_BxTxD, tgt_BxT, vocab_major, cd, inv_temp, c):
    # symbolic_zeros=True: primals arrive as CustomVJPPrimal (value, perturbed).
    # A w not differentiated (a frozen head: LoRA's) gets no dW (w_grad, static residual).
    w_grad = bool(w.perturbed)
    w, h_BxTxD, tgt_BxT = w.value, h_BxTxD.value, tgt_BxT.value
    logp, ent, logz = _linear_primal(w, h_BxTxD, tgt_BxT, vocab_major, cd, inv_temp, c)
    return (logp, ent), (w, h_BxTxD, tgt_BxT, logz, ent, w_grad)


def _linear_bwd(vocab_major, cd, inv_temp, c, res, cts):
    w, h_BxTxD, tgt_BxT, logz_BxT, ent_BxT, w_grad = res
    ct_logp, ct_ent = cts
    use_logp = not isinstance(ct_logp, SymbolicZero)
    use_ent = not isinstance(ct_ent, SymbolicZero)
    if not (use_logp or use_ent):
        return None, None, None
    b, t, _ = h_BxTxD.shape
    n = math.ceil(t / c)
    zeros = jnp.zeros((b, t), jnp.float32)
    a_BxT = ct_logp.astype(jnp.float32) if use_logp else zeros
    e_BxT = ct_ent.astype(jnp.float32) if use_ent else zeros
    wc = w.astype(cd)

    def chunk(xs):
        h, tgt, logz, ent, a, e = xs
        logp_all = _linear_logits(wc, h, vocab_major, cd) * inv_temp - logz[..., None]
        ent_term = e[..., None] * (logp_all + ent[..., None]) if use_ent else None
        dh, dw = chunk_grads(wc, h, tgt, jnp.exp(logp_all), a if use_logp else None, ent_term,
                             vocab_major, cd, inv_temp, s)
        return dh.astype(h_BxTxD.dtype), dw

    s = batch_shards(b) if w_grad else None
    xs = (split_chunks(h_BxTxD, n, c), split_chunks(tgt_BxT, n, c), split_chunks(logz_BxT, n, c),
          split_chunks(ent_BxT, n, c), split_chunks(a_BxT, n, c), split_chunks(e_BxT, n, c))
    if not w_grad:  # a frozen head: dh alone
        return None, join_chunks(_over_chunks(lambda x: chunk(x)[0], xs, n), t), None
    if n == 1:
        dh, dw = chunk(jax.tree.map(lambda x: x[0], xs))
        dh_NxBxCxD = dh[None]
    else:
        def step(acc, x):
            dh, dw = chunk(x)
            return acc + dw, dh

        d, v = (w.shape[1], w.shape[0]) if vocab_major else w.shape
        zeros = constrain_logical(jnp.zeros((s, d, v), jnp.float32), PARTIAL_DW_AXES)
        dw, dh_NxBxCxD = jax.lax.scan(step, zeros, xs)
    dw = reduce_partial_dw(dw)
    if vocab_major:
        dw = dw.T
    return dw.astype(w.dtype), join_chunks(dh_NxBxCxD, t), None


_linear_logprobs.defvjp(_linear_fwd, _linear_bwd, symbolic_zeros=True)


def linear_logprobs(
    w: Array,
    h_BxTxD: Array,
    targets_BxT: Array,
    *,
    vocab_major: bool,
    chunk: int,
    temperature: float = 1.0,
    compute_dtype: Any = jnp.float32,
) -> tuple[Array, Array]:
    """``chunked_logprobs`` for a linear output projection, with a hand-written backward.

    ``w`` is the head weight, ``[V, D]`` when ``vocab_major`` (a tied embedding) and
    ``[D, V]`` otherwise (an ``lm_head``); logits are ``h . W`` with both cast to
    ``compute_dtype`` and accumulated in float32, scaled by ``1 / temperature``. Values
    equal :func:`chunked_logprobs` of the same projection. The backward pass recomputes one
    ``[B, chunk, V]`` block of logits per chunk (as the rematerialised chunks do), forms
    ``d logits = (a * (onehot - p) - e * p * (log p + H)) / temperature`` from the
    per-token cotangents ``a`` (log-probs) and ``e`` (entropies; skipped when the entropy
    is not differentiated) once, and returns ``dh = d logits . W`` and ``dW`` in ``W``'s
    own layout (summed over chunks; not formed when ``w`` is not differentiated, e.g.
    LoRA's frozen head: a symbolic zero then); both matmuls take ``d logits`` in
    ``compute_dtype`` (float32 accumulation), as the forward takes ``h``. Returns
    ``(logp_BxT, entropy_BxT)``, float32.
    """
    _, t, _ = check_linear_args("linear_logprobs", w, h_BxTxD, targets_BxT, chunk,
                                 temperature, vocab_major)
    return _linear_logprobs(w, h_BxTxD, targets_BxT.astype(jnp.int32), bool(vocab_major),
                            jnp.dtype(compute_dtype), 1.0 / float(temperature), min(chunk, t))
