"""Packed learning batches: each row's real tokens packed into fixed-width sequences.

A padded row costs ``P + T`` positions in every forward and backward whatever its length.
Packed, a row is its real prompt tokens followed by its real completion tokens (its
*segment*), and segments sit side by side in rows of width ``W = P + T``: per-token
segment ids keep attention within a segment (``Decoder.hidden_states(segment_ids_BxT=)``,
xla and the kernels), and each segment's positions count from 0, so every real token's
hidden state equals the padded forward's. Log-probs, entropies and values computed on the
packed layout are *unpacked* back to ``[B, T]``, where advantages, GAE and the objective
run unchanged: aggregation (per-sequence means, the token mean over real tokens) stays
exact in every mode.

The plan (which packed row and offset each row takes) is a pure function of the masks:
first-fit decreasing over the row lengths, within each batch shard (rows never leave
their shard), made in the jitted program, so every process makes the same one. Its one
input from the host is its static shape, :class:`PackSpec`: the packed rows per
micro-batch (``RLConfig.tokens_per_micro_batch // W``) and the number of micro-batches, the
*bucket*, chosen from :func:`bins_needed` (one replicated scalar fetched from device).
A batch whose bucket was seen compiles nothing.

Micro-batch ``i`` holds packed rows ``i, i + M, ...`` (``rljax.train.learn.micro``); a row
belongs to the micro-batch of its packed row, and its loss terms there, so the exact
accumulation of ``rljax.train.learn.update`` holds as for padded micro-batches.

Batch keys (``S`` packed rows; ``pack_bin_B`` and ``pack_col_BxT`` index each shard's own
packed rows): ``pack_tokens_SxW``, ``pack_segments_SxW`` (-1: padding),
``pack_positions_SxW``, ``pack_targets_SxW`` (the next token), ``pack_dst_SxW`` (the
shard-local flat ``[R, T]`` slot of the completion token a position predicts; ``R x T``:
none), ``pack_micro_S`` (the micro-batch of each packed row), ``pack_bin_B`` (each row's
packed row within its shard), ``pack_col_BxT`` (the column predicting completion token t);
for an MoE batch with router-replay ids (``seqs[REPLAY_KEY]``), ``pack_replay_SxWxLxK``
(each position's expert ids, -1 on padding; the forwards route by them when the model's
``router_replay`` is "replay").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rljax.train.batch import REPLAY_KEY
from rljax.train.learn import router
from rljax.train.learn.micro import merge_micro, split_micro
from rljax.train.learn.onepass import padded_width

Array = Any
__all__ = ["PackSpec", "bins_needed", "choose_spec", "make_plan", "over_micro", "pack_bins",
           "packed_hidden", "packed_token_grads", "split_packed", "this_micro", "unpack",
           "unpack_micro", "useful_token_frac"]


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """The static shape of a packed learning batch (a field of ``StepSpec``).

    rows_per_micro: packed rows per micro-batch, over all batch shards (a multiple of
      ``shards``); each has width ``P + T``.
    num_micro: micro-batches (the bucket; :func:`choose_spec`).
    shards: batch shards (data x fsdp; 1 off a mesh) the rows are packed within.
    """

    rows_per_micro: int
    num_micro: int = 1
    shards: int = 1

    def __post_init__(self):
        for name in ("rows_per_micro", "num_micro", "shards"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"PackSpec.{name}={v!r}; allowed: an int >= 1")
        if self.rows_per_micro % self.shards:
            raise ValueError(f"PackSpec.rows_per_micro={self.rows_per_micro} does not split "
                             f"over the {self.shards} batch shards; allowed: a multiple of "
                             f"{self.shards}")

    @property
    def rows(self) -> int:
        """Packed rows in all."""
        return self.rows_per_micro * self.num_micro


def _lengths(seqs: dict) -> Array:
    """Real tokens per row, ``[B]`` int32; 0 for a row without completion tokens (a
    padding row: nothing to learn from, not packed)."""
    c = jnp.sum(seqs["completion_mask_BxT"] > 0, axis=1)
    p = jnp.sum(seqs["prompt_mask_BxP"] > 0, axis=1)
    return jnp.where(c > 0, p + c, 0).astype(jnp.int32)


def _first_fit(len_R: Array, width: int) -> tuple[Array, Array, Array]:
    """First-fit decreasing of one shard's rows into bins of ``width``: ``(bin_R,
    offset_R, bins used)``. Every row fits an empty bin, so ``R`` bins always do; used
    bins are ``0 .. used - 1``."""
    order = jnp.argsort(-len_R, stable=True)

    def place(fill, r):
        n = len_R[r]
        b = jnp.argmax(fill + n <= width)
        return fill.at[b].add(n), (b, fill[b])

    fill, (b_R, off_R) = jax.lax.scan(place, jnp.zeros(len_R.shape, jnp.int32), order)
    unsort = lambda x: jnp.zeros_like(x).at[order].set(x)
    return unsort(b_R), unsort(off_R), jnp.sum(fill > 0)


def _by_shard(x_Bx: Array, d: int) -> Array:
    return x_Bx.reshape(d, x_Bx.shape[0] // d, *x_Bx.shape[1:])


def bins_needed(seqs: dict, shards: int) -> Array:
    """The packed rows the fullest batch shard needs (int32 scalar): what the host reads
    to choose the bucket (:func:`choose_spec`)."""
    w = seqs["prompt_BxP"].shape[1] + seqs["completion_BxT"].shape[1]
    used = jax.vmap(lambda n: _first_fit(n, w)[2])(_by_shard(_lengths(seqs), shards))
    return jnp.max(used).astype(jnp.int32)


#: :func:`bins_needed` as a program of its own (``shards`` static): the host's one read.
pack_bins = jax.jit(bins_needed, static_argnums=1)


def choose_spec(bins: int, tokens_per_micro_batch: int, width: int, shards: int) -> PackSpec:
    """The bucket for a batch whose fullest shard needs ``bins`` packed rows of ``width``:
    the fewest micro-batches of ``tokens_per_micro_batch`` slots (whole packed rows, at
    least one per shard) that hold it. ``bins`` = the rows per shard: the largest bucket
    (every row in a packed row of its own)."""
    rows = max(shards, tokens_per_micro_batch // width // shards * shards)
    return PackSpec(rows, max(1, math.ceil(int(bins) / (rows // shards))), shards)


_PACKED = ("pack_tokens_SxW", "pack_segments_SxW", "pack_positions_SxW", "pack_targets_SxW",
           "pack_dst_SxW", "pack_micro_S")
#: An MoE batch's router-replay ids packed like the tokens (-1 on padding), when ``seqs``
#: holds `REPLAY_KEY`.
REPLAY_PACKED = "pack_replay_SxWxLxK"


def _packed_keys(batch: dict) -> tuple[str, ...]:
    return _PACKED + ((REPLAY_PACKED,) if REPLAY_PACKED in batch else ())


def _shard_plan(ids_RxL, mask_RxL, len_R, replay_RxLx, p: int, s: int, w: int, m: int):
    r, length = ids_RxL.shape
    t = length - p
    b_R, off_R, _ = _first_fit(len_R, w)
    k_RxL = jnp.cumsum(mask_RxL, axis=1) - 1
    keep = mask_RxL & (len_R > 0)[:, None] & (b_R < s)[:, None]
    dest = jnp.where(keep, (b_R * w + off_R)[:, None] + k_RxL, s * w).reshape(-1)
    put = lambda fill, x: jnp.full((s * w,), fill, jnp.int32).at[dest].set(
        x.reshape(-1), mode="drop").reshape(s, w)
    tokens = put(0, ids_RxL)
    rows = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32)[:, None], (r, length))
    segments = put(-1, rows)
    positions = put(0, k_RxL)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((s, 1), jnp.int32)], axis=1)
    # The hidden state predicting completion token t sits one column before the token.
    col_RxT = jnp.clip(off_R[:, None] + k_RxL[:, p:] - 1, 0, w - 1)
    real = keep[:, p:]
    slot = jnp.where(real, b_R[:, None] * w + col_RxT, s * w).reshape(-1)
    flat = (jnp.arange(r)[:, None] * t + jnp.arange(t)[None]).reshape(-1)
    dst = jnp.full((s * w,), r * t, jnp.int32).at[slot].set(flat, mode="drop").reshape(s, w)
    micro = jnp.arange(s, dtype=jnp.int32) % m
    if replay_RxLx is not None:  # [R, columns, L, K]: every column's ids, like a token
        tail = replay_RxLx.shape[2:]
        replay_RxLx = jnp.full((s * w, *tail), -1, replay_RxLx.dtype).at[dest].set(
            replay_RxLx.reshape(-1, *tail), mode="drop").reshape(s, w, *tail)
    return tokens, segments, positions, targets, dst, micro, b_R, col_RxT, replay_RxLx


def make_plan(seqs: dict, spec: PackSpec) -> dict:
    """The packed batch of ``seqs`` (``prompt_BxP``, ``prompt_mask_BxP``, ``completion_BxT``,
    ``completion_mask_BxT``) at ``spec``'s shape: the ``pack_*`` arrays of the module
    docstring. Rows past the spec's packed rows would be dropped: the spec comes from
    :func:`bins_needed` of the same masks, so none are."""
    d = spec.shards
    b, p = seqs["prompt_BxP"].shape
    if b % d:
        raise ValueError(f"make_plan: {b} rows do not split over {d} batch shards")
    ids = jnp.concatenate([seqs["prompt_BxP"], seqs["completion_BxT"]], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([seqs["prompt_mask_BxP"], seqs["completion_mask_BxT"]], axis=1) > 0
    w = ids.shape[1]
    replay = seqs.get(REPLAY_KEY)
    replay = None if replay is None else _by_shard(jnp.swapaxes(replay[:, :, :w], 1, 2), d)
    plan = jax.vmap(lambda i, msk, n, rp: _shard_plan(i, msk, n, rp, p, spec.rows // d, w,
                                                      spec.num_micro))(
        _by_shard(ids, d), _by_shard(mask, d), _by_shard(_lengths(seqs), d), replay)
    names = _PACKED + ("pack_bin_B", "pack_col_BxT", REPLAY_PACKED)
    return {k: x.reshape(-1, *x.shape[2:]) for k, x in zip(names, plan) if x is not None}


def useful_token_frac(plan: dict) -> Array:
    """Real tokens over packed slots."""
    return jnp.mean((plan["pack_segments_SxW"] >= 0).astype(jnp.float32))


def _gather_rows(x_SxW: Array, bin_B: Array, col_BxT: Array, d: int, per: int) -> Array:
    """``x`` at each row's ``(packed row, column)``: ``bin_B`` indexes the ``per`` packed
    rows of its shard (``x_SxW``'s rows by shard), gathered shard by shard."""
    w = x_SxW.shape[1]
    idx = _by_shard(bin_B[:, None] * w + col_BxT, d)
    flat = x_SxW.reshape(d, per * w)
    out = jax.vmap(lambda x, i: jnp.take(x, i.reshape(-1), mode="clip").reshape(i.shape))(
        flat, idx)
    return out.reshape(bin_B.shape[0], col_BxT.shape[1])


def unpack(x_SxW: Array, batch: dict, d: int) -> Array:
    """Packed-layout values (``[S, W]``: every packed row) at each completion token,
    ``[B, T]`` (meaningless where the completion mask is 0)."""
    return _gather_rows(x_SxW, batch["pack_bin_B"], batch["pack_col_BxT"], d,
                        x_SxW.shape[0] // d)


def unpack_micro(x_SxW: Array, mb: dict, d: int, m: int) -> Array:
    """:func:`unpack` of one micro-batch's packed rows (micro-batch ``i`` holds the rows
    whose packed row is ``i mod m``; the others' values are meaningless)."""
    return _gather_rows(x_SxW, mb["pack_bin_B"] // m, mb["pack_col_BxT"], d,
                        x_SxW.shape[0] // d)


def packed_hidden(model, pk: dict, remat: bool) -> Array:
    """The decoder's hidden states ``[S, W, D]`` of the packed rows (segments attend
    within themselves; routed by the packed replay ids when the model replays)."""
    seg = pk["pack_segments_SxW"]
    moe = getattr(model.config, "moe", None)
    replay = REPLAY_PACKED in pk and moe is not None and moe.router_replay == "replay"
    if not (replay or router.wanted(model)):
        return model.hidden_states(pk["pack_tokens_SxW"], pk["pack_positions_SxW"], seg >= 0,
                                   remat=remat, segment_ids_BxT=seg)
    h, rec = model.routed_hidden_states(
        pk["pack_tokens_SxW"], pk["pack_positions_SxW"], seg >= 0, remat=remat,
        segment_ids_BxT=seg,
        replay_ids_LxBxTxK=jnp.transpose(pk[REPLAY_PACKED], (2, 0, 1, 3)) if replay else None)
    router.note(rec, model.config)
    return h


def over_micro(fn: Callable, batch: dict, m: int) -> Array:
    """``fn(packed arrays) -> [S_m, W]`` over the ``m`` micro-batches' packed rows,
    ``[S, W]`` in packed-row order."""
    pk = {k: batch[k] for k in _packed_keys(batch)}
    if m == 1:
        return fn(pk)
    return merge_micro(jax.lax.map(fn, jax.tree.map(lambda x: split_micro(x, m), pk)))


def split_packed(batch: dict, num_micro: int) -> tuple[dict, dict]:
    """``rljax.train.learn.update.accumulate``'s split of a packed batch: ``(xs, shared)``,
    the packed arrays split into micro-batches, every ``[B, ...]`` array whole."""
    keys = _packed_keys(batch)
    xs = {k: split_micro(batch[k], num_micro) for k in keys}
    return xs, {k: v for k, v in batch.items() if k not in keys}


def this_micro(mb: dict, spec: PackSpec) -> dict:
    """One micro-batch of a packed batch with its loss mask cut to the rows it holds
    (micro-batch ``pack_micro_S[0]``: the rows whose packed row is that mod M)."""
    mine_B = (mb["pack_bin_B"] % spec.num_micro) == mb["pack_micro_S"][0]
    key = "loss_mask_BxT" if "loss_mask_BxT" in mb else "completion_mask_BxT"
    return dict(mb, **{key: mb[key] * mine_B[:, None]})


def packed_token_grads(loss_of: Callable, aux: Any, mb: dict, chunk: int, d: int):
    """``(token_grads, aux)`` of the one-pass head over one packed micro-batch
    (``rljax.train.learn.onepass.TokenGrads``). ``loss_of(aux, logp_BxT, entropy_BxT)`` is
    the (token-separable) loss on the ``[B, T]`` layout; each chunk of packed columns is
    put into ``[B, T]`` (over the sampler's log-probs: any finite values do),
    differentiated there and read back."""
    b, t = mb["completion_mask_BxT"].shape
    s_m, w = mb["pack_tokens_SxW"].shape
    dst = jnp.pad(mb["pack_dst_SxW"], ((0, 0), (0, padded_width(w, chunk) - w)),
                  constant_values=(b // d) * t)

    def token_grads(full, logp_SxC, ent_SxC, start):
        aux, dst, filler = full
        c = logp_SxC.shape[1]
        idx = _by_shard(jax.lax.dynamic_slice(dst, (0, start), (s_m, c)), d).reshape(d, -1)
        by = lambda x: _by_shard(x, d).reshape(d, -1)
        put = lambda base, x: jax.vmap(lambda f, i, v: f.at[i].set(v, mode="drop"))(
            by(base), idx, by(x)).reshape(b, t)
        a, e = jax.grad(lambda lp, en: loss_of(aux, lp, en), argnums=(0, 1))(
            put(filler, logp_SxC), put(jnp.zeros((b, t), jnp.float32), ent_SxC))
        cut = lambda g: jax.vmap(lambda f, i: f.at[i].get(mode="fill", fill_value=0.0))(
            by(g), idx).reshape(s_m, c)
        return cut(a), cut(e)

    return token_grads, (aux, dst, mb["sampler_logp_BxT"])
