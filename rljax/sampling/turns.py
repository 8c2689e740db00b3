"""Multi-turn decoding: the jitted programs of a rollout whose rows take turns with an
environment, continuing one KV cache.

A row's sequence is its prompt, then model turns and observations (the environment's
tokens) one after another. The programs keep, per row, one cache of ``TurnSpec.cache_len``
slots and a completion buffer ``T = TurnSpec.completion_len`` wide; the host loop
(``rljax.train.multiturn``) runs, per turn:

1. ``start`` (the first turn) or ``observe`` (the next ones): prefill the new tokens at
   the shared cache slot and draw the turn's first token from the last one's logits.
   ``start`` prefills the left-padded prompts; ``observe`` the row's last drawn token
   (not yet in the cache) followed by its observation ids, left-padded to a bucketed
   width ``W`` (``W + 1`` columns), so only new tokens are ever prefilled. Observation
   ids go into the completion buffer with loss mask 0 and log-prob 0.
2. ``decode_turn``: a ``lax.while_loop`` of one-token steps until every row's turn has
   ended: a stop id, a stop sequence (``TurnSpec.stop_seqs``, matched on the turn's last
   tokens), the row's turn budget (``budget_R``, at most ``turn_tokens``), a full
   completion buffer or a full cache. Returns the turn's tokens for the host.
3. ``turn_flags``: from global arrays, the replicated all-done flag and the widest
   observation, the same on every process.

Cache slots are shared by all rows (one scalar ``slot``): a row whose turn ended early
leaves its slots of the rest of the turn invalid (masked out, like the prompts' left
padding), and the positions fed are the row's own. Shapes are fixed: the cache, the
buffers and ``turn_tokens`` are static, observation widths come from a few buckets, so
once each bucket has been seen a new turn compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rljax.models.moe import compact_ids
from rljax.sampling.head import vocab_major_head
from rljax.sampling.ops import SamplingParams
from rljax.sampling.sampler import constrain, constrain_cache, constrain_rows, decode_model
from rljax.sampling.vocab_shards import sample_tokens_sharded

__all__ = ["TurnSpec", "TurnState", "start", "observe", "decode_turn", "turn_flags",
           "cache_slots"]


@dataclasses.dataclass(frozen=True)
class TurnSpec:
    """Static (hashable) settings of the multi-turn programs.

    params: the sampling distribution. stop_ids: single tokens that end a turn (kept in
    it). stop_seqs: token sequences that end a turn when they are its last tokens (each
    a stop string's ids). turn_tokens: the most tokens one turn draws. completion_len:
    ``T``, the completion buffer (model turns and observations). cache_len: cache slots
    (``cache_slots``). pad_id: written after a row's last token.
    """

    params: SamplingParams
    stop_ids: tuple[int, ...]
    stop_seqs: tuple[tuple[int, ...], ...]
    turn_tokens: int
    completion_len: int
    cache_len: int
    pad_id: int


def cache_slots(prompt_width: int, max_turns: int, turn_tokens: int, obs_width: int) -> int:
    """Cache slots that hold any rollout: the prompt, ``turn_tokens - 1`` decode steps per
    turn (each turn's first token is drawn by the prefill before it) and ``max_turns - 1``
    observation prefills of at most ``obs_width + 1`` columns."""
    return prompt_width + max_turns * max(turn_tokens - 1, 1) + (max_turns - 1) * (obs_width + 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TurnState:
    """The rollout's device state between programs (``R`` rows, ``T`` completion columns).

    cache: the rows' KV cache. key: the rollout's PRNG key. slot: the next free cache
    slot (int32 scalar, shared). turn / step: the turn and its decode step (key folding).
    pending_R: each row's last drawn token, not yet in the cache; pos_R: its position.
    cursor_R: the row's next completion column. turn_start_R: the column its current
    turn began at. active_R: still decoding this turn. budget_R: tokens its turn may
    draw. window_RxL: the turn's last tokens (stop sequences; -2 before the turn's first).
    tokens_RxT / logp_RxT / loss_RxT: the completion: ids, the sampler's log-probs
    (0 at observation tokens) and the loss mask (1 at the tokens the model drew).
    experts_RxLxSxK: an MoE model's expert ids (`rljax.models.moe.compact_ids`) of every
    position fed, prompt, drawn tokens and observations, in the columns of
    ``concat(prompt, completion)`` (``S = P + T``), -1 where nothing was fed (router
    replay, as `rljax.sampling.SampleResult.expert_ids`); None for a dense model.
    """

    cache: object
    key: jax.Array
    slot: jax.Array
    turn: jax.Array
    step: jax.Array
    pending_R: jax.Array
    pos_R: jax.Array
    cursor_R: jax.Array
    turn_start_R: jax.Array
    active_R: jax.Array
    budget_R: jax.Array
    window_RxL: jax.Array
    tokens_RxT: jax.Array
    logp_RxT: jax.Array
    loss_RxT: jax.Array
    experts_RxLxSxK: jax.Array | None = None


def _rows(s: TurnState, mesh) -> TurnState:
    """`constrain_rows`, with the expert ids split over the batch axes too."""
    s = constrain_rows(s, mesh)
    if s.experts_RxLxSxK is None:
        return s
    return dataclasses.replace(s, experts_RxLxSxK=constrain(
        s.experts_RxLxSxK, mesh, ("batch", None, None, None)))


def _put_experts(s: TurnState, routed_LxRxWxK, col_RxW, fed_RxW) -> TurnState:
    """The fed positions' expert ids written at their columns of ``concat(prompt,
    completion)`` (``col_RxW``; only where ``fed_RxW``)."""
    buf = s.experts_RxLxSxK
    if routed_LxRxWxK is None:
        return s
    col = jnp.where(fed_RxW, col_RxW, buf.shape[2])  # out of range: dropped
    ids = jnp.swapaxes(routed_LxRxWxK, 0, 1).astype(buf.dtype)
    put = jax.vmap(lambda b_LxSxK, c_W, v_LxWxK: b_LxSxK.at[:, c_W].set(v_LxWxK, mode="drop"))
    return dataclasses.replace(s, experts_RxLxSxK=put(buf, col, ids))


def _expert_buffer(config, routed_LxRxPxK, width: int):
    """``[R, L_moe, width, k]`` of -1 in the compact id dtype; None for a dense model."""
    if routed_LxRxPxK is None:
        return None
    l, r, _, k = routed_LxRxPxK.shape
    return jnp.full((r, l, width, k), -1, compact_ids(routed_LxRxPxK[:0],
                                                      config.moe.num_experts).dtype)


def _stop_hit(spec: TurnSpec, tok_R, window_RxL):
    hit = jnp.zeros(tok_R.shape, bool)
    if spec.stop_ids:
        hit = jnp.any(tok_R[:, None] == jnp.asarray(spec.stop_ids, jnp.int32)[None], axis=-1)
    if spec.stop_seqs:
        width = window_RxL.shape[1]
        seqs_KxL = jnp.asarray([(-1,) * (width - len(q)) + tuple(q) for q in spec.stop_seqs],
                               jnp.int32)
        match_RxK = jnp.all((seqs_KxL[None] == -1) | (window_RxL[:, None] == seqs_KxL[None]),
                            axis=-1)
        hit = hit | jnp.any(match_RxK, axis=-1)
    return hit


def _record(s: TurnState, spec: TurnSpec, tok_R, slogp_R) -> TurnState:
    """Write the drawn tokens of the active rows at their cursors; end the turns that
    drew a stop, used their budget or filled the buffer."""
    act = s.active_R
    t = s.tokens_RxT.shape[1]
    tok_R = jnp.where(act, tok_R, spec.pad_id).astype(jnp.int32)
    at_RxT = (jnp.arange(t)[None] == s.cursor_R[:, None]) & act[:, None]
    window = jnp.where(act[:, None], jnp.concatenate([s.window_RxL[:, 1:], tok_R[:, None]], 1),
                       s.window_RxL)
    cursor = s.cursor_R + act
    drawn_R = cursor - s.turn_start_R
    hit = _stop_hit(spec, tok_R, window)
    return dataclasses.replace(
        s, pending_R=jnp.where(act, tok_R, s.pending_R), pos_R=s.pos_R + act,
        cursor_R=cursor, window_RxL=window,
        active_R=act & ~hit & (drawn_R < s.budget_R) & (cursor < t),
        tokens_RxT=jnp.where(at_RxT, tok_R[:, None], s.tokens_RxT),
        logp_RxT=jnp.where(at_RxT, slogp_R[:, None], s.logp_RxT),
        loss_RxT=jnp.where(at_RxT, 1.0, s.loss_RxT))


def _begin_turn(s: TurnState, spec: TurnSpec, mesh, logits_VxR, budget_R) -> TurnState:
    """A new turn: every row with budget left draws its first token from ``logits_VxR``."""
    t = s.tokens_RxT.shape[1]
    budget_R = jnp.minimum(jnp.asarray(budget_R, jnp.int32), spec.turn_tokens)
    s = dataclasses.replace(s, step=jnp.int32(0), turn_start_R=s.cursor_R, budget_R=budget_R,
                            active_R=(budget_R > 0) & (s.cursor_R < t),
                            window_RxL=jnp.full_like(s.window_RxL, -2))
    tok, _, slp = sample_tokens_sharded(_step_key(s), logits_VxR, spec.params, mesh)
    return _rows(_record(s, spec, tok, slp), mesh)


def _prompt_width(s: TurnState, spec: TurnSpec) -> int:
    """``P``: the expert-id columns before the completion's (0 for a dense model)."""
    return 0 if s.experts_RxLxSxK is None else s.experts_RxLxSxK.shape[2] - spec.completion_len


def _step_key(s: TurnState):
    return jax.random.fold_in(jax.random.fold_in(s.key, s.turn), s.step)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def start(graphdef, spec: TurnSpec, mesh, params, head_VxD, prompt_RxP, mask_RxP, budget_R,
          key) -> TurnState:
    """Prefill the left-padded prompts at slot 0 and draw each row's first token."""
    model, head_VxD = decode_model(graphdef, params, head_VxD, mesh)
    r, p = prompt_RxP.shape
    t = spec.completion_len
    mask_RxP = jnp.asarray(mask_RxP, bool)
    cache = constrain_cache(model.init_cache(r, spec.cache_len), mesh)
    pos_RxP = jnp.maximum(jnp.cumsum(mask_RxP, axis=1, dtype=jnp.int32) - 1, 0)
    h_RxPxD, cache, routed = model.forward_cached_routed(prompt_RxP, pos_RxP, mask_RxP,
                                                         cache, 0)
    width = max([len(q) for q in spec.stop_seqs] + [1])
    zeros = jnp.zeros((r,), jnp.int32)
    s = TurnState(cache=cache, key=key, slot=jnp.int32(p), turn=jnp.int32(0), step=jnp.int32(0),
                  pending_R=zeros, pos_R=jnp.sum(mask_RxP, axis=1, dtype=jnp.int32) - 1,
                  cursor_R=zeros, turn_start_R=zeros, active_R=jnp.zeros((r,), bool),
                  budget_R=zeros, window_RxL=jnp.full((r, width), -2, jnp.int32),
                  tokens_RxT=jnp.full((r, t), spec.pad_id, jnp.int32),
                  logp_RxT=jnp.zeros((r, t), jnp.float32), loss_RxT=jnp.zeros((r, t), jnp.float32),
                  experts_RxLxSxK=_expert_buffer(model.config, routed, p + t))
    s = _put_experts(s, routed, jnp.broadcast_to(jnp.arange(p), (r, p)), mask_RxP)
    logits_VxR = vocab_major_head(model, head_VxD)(h_RxPxD[:, -1])
    return _begin_turn(s, spec, mesh, logits_VxR, budget_R)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5,))
def observe(graphdef, spec: TurnSpec, mesh, params, head_VxD, s: TurnState, obs_RxW, obs_len_R,
            continue_R, budget_R) -> TurnState:
    """Append each continuing row's last drawn token and its observation to the cache
    (``obs_RxW`` left-padded, ``obs_len_R`` real ids each), write the observation into
    the completion (loss mask 0), and begin the next turn with ``budget_R``."""
    model, head_VxD = decode_model(graphdef, params, head_VxD, mesh)
    w = obs_RxW.shape[1]
    t = spec.completion_len
    cont_R = jnp.asarray(continue_R, bool)
    len_R = jnp.where(cont_R, jnp.asarray(obs_len_R, jnp.int32), 0)
    # Column j of the W + 1 fed holds item k = j - (W - len) of [pending, obs_1 .. obs_len].
    k_RxW1 = jnp.arange(w + 1)[None] - (w - len_R)[:, None]
    obs_at = jnp.take_along_axis(obs_RxW, jnp.clip(w - len_R[:, None] + k_RxW1 - 1, 0, w - 1), 1)
    ids = jnp.where(k_RxW1 == 0, s.pending_R[:, None], obs_at).astype(jnp.int32)
    mask = (k_RxW1 >= 0) & cont_R[:, None]
    pos = s.pos_R[:, None] + jnp.maximum(k_RxW1, 0)
    h_RxWxD, cache, routed = model.forward_cached_routed(ids, pos, mask, s.cache, s.slot)
    # Item k (the pending token is item 0) sits at completion column cursor - 1 + k.
    s = _put_experts(s, routed, _prompt_width(s, spec) + s.cursor_R[:, None] - 1 + k_RxW1,
                     mask)
    # The observation into the completion at the cursor: column c holds obs item c - cursor.
    c_RxT = jnp.arange(t)[None] - s.cursor_R[:, None]
    put = (c_RxT >= 0) & (c_RxT < len_R[:, None])
    obs_tok = jnp.take_along_axis(obs_RxW, jnp.clip(w - len_R[:, None] + c_RxT, 0, w - 1), 1)
    s = dataclasses.replace(
        s, cache=cache, slot=s.slot + w + 1, turn=s.turn + 1,
        pos_R=s.pos_R + len_R, cursor_R=jnp.minimum(s.cursor_R + len_R, t),
        tokens_RxT=jnp.where(put, obs_tok, s.tokens_RxT).astype(jnp.int32),
        logp_RxT=jnp.where(put, 0.0, s.logp_RxT), loss_RxT=jnp.where(put, 0.0, s.loss_RxT))
    logits_VxR = vocab_major_head(model, head_VxD)(h_RxWxD[:, -1])
    return _begin_turn(s, spec, mesh, logits_VxR, jnp.where(cont_R, budget_R, 0))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5,))
def decode_turn(graphdef, spec: TurnSpec, mesh, params, head_VxD, s: TurnState):
    """Decode until every row's turn has ended. Returns ``(state, turn_RxN, turn_len_R)``:
    this turn's tokens of each row (``N = turn_tokens``, ``pad_id`` after them) and
    their count."""
    model, head_VxD = decode_model(graphdef, params, head_VxD, mesh)
    head = vocab_major_head(model, head_VxD)

    def body(s):
        h_Rx1xD, cache, routed = model.forward_cached_routed(
            s.pending_R[:, None], s.pos_R[:, None], s.active_R[:, None], s.cache, s.slot)
        # The pending token was drawn into completion column cursor - 1.
        s = _put_experts(s, routed, _prompt_width(s, spec) + s.cursor_R[:, None] - 1,
                         s.active_R[:, None])
        s = dataclasses.replace(s, cache=cache, slot=s.slot + 1, step=s.step + 1)
        tok, _, slp = sample_tokens_sharded(_step_key(s), head(h_Rx1xD[:, 0]), spec.params, mesh)
        return _rows(_record(s, spec, tok, slp), mesh)

    s = jax.lax.while_loop(lambda s: jnp.any(s.active_R) & (s.slot < spec.cache_len), body,
                           _rows(s, mesh))
    s = dataclasses.replace(s, active_R=jnp.zeros_like(s.active_R))
    n, t = spec.turn_tokens, spec.completion_len
    len_R = s.cursor_R - s.turn_start_R
    cols_RxN = s.turn_start_R[:, None] + jnp.arange(n)[None]
    turn_RxN = jnp.take_along_axis(s.tokens_RxT, jnp.clip(cols_RxN, 0, t - 1), 1)
    turn_RxN = jnp.where(jnp.arange(n)[None] < len_R[:, None], turn_RxN, spec.pad_id)
    return s, constrain(turn_RxN, mesh, ("batch", None)), len_R


@jax.jit
def turn_flags(done_R, obs_len_R):
    """``(all rows done, widest observation)``: replicated scalars from global arrays,
    so every process takes the same decision."""
    return jnp.all(done_R), jnp.max(obs_len_R)
