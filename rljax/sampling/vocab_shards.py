"""Sampling with the vocabulary split over the mesh's "tensor" axis, drawing the tokens the
one-device sampler (:mod:`rljax.sampling.ops`) draws, without gathering the logits.

The decode loop's logits ``[V, R]`` leave the output projection split over "tensor" by
vocabulary. Sampling them with the one-device ops makes XLA's partitioner all-gather
them every step wherever the number of blocks does not divide by tensor (Qwen2.5's 297
blocks of 512: ``f32[152064, rows]`` per chip per token, ~78 MB on the 1.5B recipes). Here
each chip works on its ``V / tensor`` slice inside ``jax.shard_map`` and the chips
exchange only per-row summaries (docs/sampler.md has the bytes):

- greedy: ``pmax`` of the slice maxima, then ``pmin`` of the lowest global index holding
  the maximum (the one-device tie rule, lowest id).
- temperature (inverse CDF, ``ops._sample_with_logp``): the one-device blocks of
  ``bs ~ sqrt(V)`` tokens are kept. Each block belongs to the chip holding its first token;
  a block crossing into the next chip's slice is completed by a ``ppermute`` of that chip's
  first ``< bs`` weights. Every chip sums its own blocks as one device does, the ``nb``
  block sums are all-gathered and put in global order, and every chip runs the same
  cumulative sum and block choice on them. The owner of the chosen block draws inside it;
  its index and weight are ``psum``'d (the others add 0).
- top-k: every chip's ``k`` largest keys are all-gathered and the global ``k``-th is taken
  from them (exact, ties counted as one device counts them); when ``tensor * k`` would not
  be smaller than a slice, the k-th key is found by bisection with ``psum``'d counts.
- top-p: ``ops._top_p_mask``'s bisection with the masses ``psum``'d over slices.
- log-probs: ``x_tok - logsumexp(x)`` with the maximum ``pmax``'d and the sum ``psum``'d.

Exactness: the blocks and the two uniforms per row are the one-device ones, so the same
token is drawn wherever float32 rounding does not decide the draw. Integer counts, maxima
and picks are exact in any order; the log-sum-exp and the top-p masses are summed per
slice, and XLA may round an ``exp`` differently in the two programs, so log-probs agree to
float32 rounding and a token could differ only when a cumulative weight lies within
rounding of its target (tests/test_sampling_sharded.py: equal on 10,240 draws per mode).

Vocabularies not divisible by ``tensor`` are padded with ``-inf`` (never drawn) to a
multiple of it; the block size is the one-device one, ``ops.vocab_block_size(V)``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from rljax.models.attention_kernels import pad_axis
from rljax.sampling.ops import (
    SamplingParams,
    filter_logits,
    vocab_block_size,
    inverse_cdf,
    largest_key_where,
    ordered_key,
    pick_along,
    sample_tokens,
)
from rljax.sharding import fitted_spec

__all__ = ["sample_tokens_sharded", "vocab_shards"]

AXIS = "tensor"


def vocab_shards(mesh: Mesh | None, v: int) -> int:
    """How many vocabulary slices the sampler keeps on ``mesh``: its "tensor" size, or 1
    (the one-device sampler) without a mesh, with tensor 1, or when a slice would be
    shorter than one sampling block (``V < tensor * bs``, a vocabulary of a few dozen)."""
    t = 1 if mesh is None else dict(mesh.shape).get(AXIS, 1)
    return t if t > 1 and -(-v // t) >= vocab_block_size(v) else 1


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How the one-device blocks fall on ``t`` slices of ``L`` tokens (static).

    starts/counts/offsets: per slice, its first block, how many blocks it owns and where
    the first one begins in its slice; edge: tokens taken from the next slice; nbl: the
    most blocks a slice owns; order: index of each global block in the gathered
    ``[t * nbl]`` block sums.
    """

    v: int
    t: int
    bs: int
    nb: int
    L: int
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    edge: int
    nbl: int
    order: tuple[int, ...]

    @staticmethod
    def make(v: int, t: int) -> "_Plan":
        bs, L = vocab_block_size(v), -(-v // t)
        nb = -(-v // bs)
        starts = [min(-(-s * L // bs), nb) for s in range(t)] + [nb]
        counts = [starts[s + 1] - starts[s] for s in range(t)]
        offsets = [starts[s] * bs - s * L for s in range(t)]
        edge = max(0, max(starts[s + 1] * bs - (s + 1) * L for s in range(t)))
        nbl = max(counts)
        order = [s * nbl + i for s in range(t) for i in range(counts[s])]
        return _Plan(v, t, bs, nb, L, tuple(starts[:t]), tuple(counts), tuple(offsets),
                     edge, nbl, tuple(order))

    def mine(self, table) -> jax.Array:
        """This slice's entry of a per-slice table."""
        return jnp.asarray(np.asarray(table, np.int32))[jax.lax.axis_index(AXIS)]


def _pmax(x):
    return jax.lax.pmax(x, AXIS)


def _global_iota(plan: _Plan, shape, axis: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis) + plan.L * jax.lax.axis_index(AXIS)


def _greedy(plan: _Plan, x, axis: int) -> jax.Array:
    """``ops._first_index_of_max`` over the whole vocabulary: lowest global id of the max."""
    m = _pmax(jnp.max(x, axis=axis, keepdims=True))
    idx = jnp.min(jnp.where(x == m, _global_iota(plan, x.shape, axis), plan.v), axis=axis)
    return jax.lax.pmin(idx, AXIS)


def _pick_global(plan: _Plan, x, tok, axis: int) -> jax.Array:
    """``x[tok]`` along the split ``axis``: the owner's value, psum'd (others add 0)."""
    local = tok - plan.L * jax.lax.axis_index(AXIS)
    mine = (local >= 0) & (local < plan.L)
    return jax.lax.psum(jnp.where(mine, pick_along(x, jnp.clip(local, 0, plan.L - 1), axis), 0.0),
                        AXIS)


def _token_logprobs(plan: _Plan, x, tok, axis: int) -> jax.Array:
    """``ops.token_logprobs``: ``x_tok - logsumexp(x)`` as ``jax.nn.logsumexp`` forms it."""
    m = _pmax(jnp.max(x, axis=axis, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    s = jax.lax.psum(jnp.sum(jnp.exp(x - m), axis=axis), AXIS)
    return _pick_global(plan, x, tok, axis) - (jnp.log(s) + jnp.squeeze(m, axis))


def _sample_with_logp(plan: _Plan, u_Rx2, x, axis: int):
    """``ops._sample_with_logp`` on this slice (``axis``: 1 for ``[R, L]``, 0 for
    ``[L, R]``): the same blocks, block sums, uniforms and choices (module docstring)."""
    bs, nbl = plan.bs, plan.nbl
    w = jnp.exp(x - _pmax(jnp.max(x, axis=axis, keepdims=True)))
    if plan.edge:  # the next slice's first weights complete this slice's last block
        head = jax.lax.slice_in_dim(w, 0, plan.edge, axis=axis)
        perm = [(s + 1, s) for s in range(plan.t - 1)]  # the last slice gets zeros
        w = jnp.concatenate([w, jax.lax.ppermute(head, AXIS, perm)], axis=axis)
    need = max(plan.offsets) + nbl * bs
    if need > w.shape[axis]:
        w = pad_axis(w, axis, need)
    w = jax.lax.dynamic_slice_in_dim(w, plan.mine(plan.offsets), nbl * bs, axis=axis)
    rows = w.shape[1 - axis]
    w3 = w.reshape((rows, nbl, bs) if axis == 1 else (nbl, bs, rows))
    sums = jax.lax.all_gather(jnp.sum(w3, axis=axis + 1), AXIS, axis=axis, tiled=True)
    sums = jnp.take(sums, jnp.asarray(plan.order, jnp.int32), axis=axis)  # [.., nb]
    blk, total = inverse_cdf(sums, u_Rx2[:, 0], axis)
    local = blk - plan.mine(plan.starts)
    mine = (local >= 0) & (local < plan.mine(plan.counts))
    at = jnp.expand_dims(jnp.clip(local, 0, nbl - 1), (axis, axis + 1))
    w_block = jnp.squeeze(jnp.take_along_axis(w3, at, axis=axis), axis)
    within, _ = inverse_cdf(w_block, u_Rx2[:, 1], axis)
    within = jax.lax.psum(jnp.where(mine, within, 0), AXIS)
    w_tok = jax.lax.psum(jnp.where(mine, pick_along(w_block, within, axis), 0.0), AXIS)
    return blk * bs + within, jnp.log(w_tok) - jnp.log(total)


def _top_k_mask(plan: _Plan, x_RxL, k: int) -> jax.Array:
    """``ops._top_k_mask`` over the whole vocabulary (the global k-th key, ties kept)."""
    if k >= plan.v:
        return jnp.ones(x_RxL.shape, bool)
    key_RxL = ordered_key(x_RxL)
    if plan.t * k < plan.L:  # per-slice top-k: the global k largest are among them
        signed = jax.lax.bitcast_convert_type(key_RxL ^ jnp.uint32(0x80000000), jnp.int32)
        cand = jax.lax.all_gather(jax.lax.top_k(signed, k)[0], AXIS, axis=1, tiled=True)
        kth = jax.lax.top_k(cand, k)[0][:, k - 1]
        kth_R = jax.lax.bitcast_convert_type(kth, jnp.uint32) ^ jnp.uint32(0x80000000)
    else:
        r = x_RxL.shape[0]
        kth_R = largest_key_where(
            lambda t: jax.lax.psum(jnp.sum(key_RxL >= t, axis=-1), AXIS) >= k,
            jnp.zeros((r,), jnp.uint32), jnp.full((r,), 0xFFFFFFFF, jnp.uint32))
    return key_RxL >= kth_R[:, None]


def _top_p_mask(plan: _Plan, x_RxL, keep_RxL, p: float) -> jax.Array:
    """``ops._top_p_mask`` with the softmax's sum and the masses psum'd over slices."""
    if p >= 1.0:
        return keep_RxL
    x_RxL = jnp.where(keep_RxL, x_RxL, -jnp.inf)
    e_RxL = jnp.exp(x_RxL - _pmax(jnp.max(x_RxL, axis=-1, keepdims=True)))
    probs_RxL = e_RxL / jax.lax.psum(jnp.sum(e_RxL, axis=-1, keepdims=True), AXIS)
    bits_RxL = jax.lax.bitcast_convert_type(probs_RxL, jnp.uint32)
    r = x_RxL.shape[0]

    def mass_above_reaches_p(t_Rx1):
        mass = jnp.sum(jnp.where(bits_RxL > t_Rx1, probs_RxL, 0.0), axis=-1)
        return jax.lax.psum(mass, AXIS) >= p

    # Probabilities are >= 0, so their bits order the same as int32 (pmax's type here).
    top = _pmax(jax.lax.bitcast_convert_type(jnp.max(bits_RxL, axis=-1), jnp.int32))
    last_R = largest_key_where(
        lambda t: mass_above_reaches_p(t) | (t[:, 0] == 0),
        jnp.zeros((r,), jnp.uint32), jax.lax.bitcast_convert_type(top, jnp.uint32))
    thresh_R = jnp.where(mass_above_reaches_p(last_R[:, None]), last_R + 1, last_R)
    return keep_RxL & (bits_RxL >= thresh_R[:, None])


def _sample_slice(plan: _Plan, params: SamplingParams, axis: int, x, u_Rx2):
    """The body of :func:`sample_tokens_sharded` on one slice; mirrors
    ``ops.sample_tokens`` / ``ops.sample_tokens_VxR`` step by step."""
    if params.filters and axis == 0:  # as sample_tokens_VxR: filters run on [R, V]
        x, axis = x.T, 1
    if params.is_greedy:
        tok = _greedy(plan, x, axis)
        return tok, _token_logprobs(plan, x, tok, axis), jnp.zeros(tok.shape)
    scaled = filter_logits(x, params, top_k_mask=functools.partial(_top_k_mask, plan),
                           top_p_mask=functools.partial(_top_p_mask, plan))
    tok, slogp = _sample_with_logp(plan, u_Rx2, scaled, axis)
    if params.is_plain:
        return tok, slogp, slogp
    return tok, _token_logprobs(plan, x, tok, axis), slogp


def sample_tokens_sharded(key: jax.Array, logits: jax.Array, params: SamplingParams,
                          mesh: Mesh | None, axis: int = 0,
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``ops.sample_tokens`` (``axis=1``, logits ``[R, V]``) or ``ops.sample_tokens_VxR``
    (``axis=0``, ``[V, R]``) with the vocabulary kept split over ``mesh``'s "tensor" axis
    and the rows over its batch axes (where they divide): the same tokens, log-probs to
    float32 rounding. Without a mesh, or where ``vocab_shards(mesh, V)`` is 1, it is the
    one-device op itself."""
    x = logits.astype(jnp.float32)
    v, rows = x.shape[axis], x.shape[1 - axis]
    t = vocab_shards(mesh, v)
    if t == 1:
        return sample_tokens(key, x, params, axis)
    plan = _Plan.make(v, t)
    if plan.L * t != v:  # pad to whole slices; -inf is never drawn nor counted
        x = pad_axis(x, axis, plan.L * t, -jnp.inf)
    (row_axes,) = fitted_spec(("batch",), (rows,), mesh)
    x_spec = PartitionSpec(AXIS, row_axes) if axis == 0 else PartitionSpec(row_axes, AXIS)
    u_Rx2 = (jnp.zeros((rows, 2), jnp.float32) if params.is_greedy
             else jax.random.uniform(key, (rows, 2), jnp.float32))  # as ops draws them
    body = jax.shard_map(
        lambda x, u: _sample_slice(plan, params, axis, x, u), mesh=mesh,
        in_specs=(x_spec, PartitionSpec(row_axes, None)),
        out_specs=(PartitionSpec(row_axes),) * 3, check_vma=False)
    tok, logp, slogp = body(x, u_Rx2)
    return tok.astype(jnp.int32), logp, slogp
