"""The decoder-only transformer (Llama / Qwen2 / Qwen3) as a Flax NNX module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from rljax.models import grouped
from rljax.models.attention import Attention
from rljax.models.attention_kernels import SegmentMask, segment_ids_from_mask
from rljax.models.config import ModelConfig
from rljax.models.embedding import lookup
from rljax.models.kv_cache import KVCache, init_kv_cache
from rljax.models.layers import MLP, RMSNorm, compute_dtype, normal_param, rope_cos_sin
from rljax.models.lora import lora_rngs
from rljax.models.moe import MoeMLP, RouterRecord, join_records
from rljax.models.scanned import (effective_remat, remat_policy, scan_apply, scan_apply_indexed,
                                  stacked)
from rljax.sharding import constrain_logical

# The residual stream's logical axes: rows over the batch axes, positions and the hidden
# dimension whole on a chip. Without this constraint the partitioner followed the
# embedding table (hidden split over fsdp) inside micro-batch loops, so every chip held
# every row of a micro-batch and each projection moved an activation-sized collective
# (docs/pods.md, "Collective audit").
RESIDUAL_AXES = ("batch", "length", "act_embed")


def constrain_residual(x_BxTxD: jax.Array) -> jax.Array:
    """The residual stream constrained to `RESIDUAL_AXES` on the mesh set by
    `jax.set_mesh` (rows split over data x fsdp where they divide); unchanged off a mesh."""
    return constrain_logical(x_BxTxD, RESIDUAL_AXES)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    ``lora_rngs``: the adapters' key stream when ``config.lora`` is set. ``moe``: the
    feed-forward is a mixture of experts (`rljax.models.moe.MoeMLP`)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs,
                 lora_rngs: nnx.Rngs | None = None, moe: bool = False) -> None:
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, rngs, lora_rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoeMLP(config, rngs) if moe else MLP(config, rngs, lora_rngs)

    def __call__(self, x: jax.Array, cos_sin: tuple[jax.Array, jax.Array], allowed: jax.Array,
                 cache_kv: tuple[jax.Array, jax.Array] | None = None,
                 slot: jax.Array | int | None = None,
                 prefix_kv: tuple[jax.Array, jax.Array] | None = None,
                 group_prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None, *,
                 mask_BxT: jax.Array | None = None, replay_ids_BxTxK: jax.Array | None = None,
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], RouterRecord | None]:
        """(new residual stream, this layer's (keys, values), its `RouterRecord` or None
        for a dense MLP); see :class:`Attention`. An MoE layer counts router statistics
        over ``mask_BxT`` (all positions when None) and routes by ``replay_ids_BxTxK``
        when given (router replay)."""
        a, kv = self.attn(self.attn_norm(x), cos_sin, allowed, cache_kv, slot, prefix_kv,
                          group_prefix)
        x = constrain_residual(x + a)
        h = self.mlp_norm(x)
        if isinstance(self.mlp, MoeMLP):
            y, rec = self.mlp(h, mask_BxT, replay_ids_BxTxK)
        else:
            y, rec = self.mlp(h), None
        return constrain_residual(x + y), kv, rec


def _check_ids(input_ids_BxT, positions_BxT, mask_BxT, segment_ids_BxT=None):
    ids = jnp.asarray(input_ids_BxT)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"input_ids_BxT must be an integer array of rank 2, got {ids.dtype}{ids.shape}"
        )
    for name, a in (("positions_BxT", positions_BxT), ("mask_BxT", mask_BxT),
                    ("segment_ids_BxT", segment_ids_BxT)):
        if a is not None and tuple(a.shape) != tuple(ids.shape):
            raise ValueError(f"{name} has shape {tuple(a.shape)}; expected {tuple(ids.shape)}")
    return ids


def _run_layer(layer, body, carry, remat: str, x=None):
    """`body(layer, carry, x)`, under `jax.checkpoint` unless remat is "none"."""
    if remat == "none":
        return body(layer, carry, x)
    graphdef, state = nnx.split(layer)
    fn = jax.checkpoint(lambda st, c, xx: body(nnx.merge(graphdef, st), c, xx),
                        policy=remat_policy(remat))
    return fn(state, carry, x)


def _causal_mask(config: ModelConfig, mask_BxT: jax.Array,
                 segment_ids_BxT: jax.Array | None = None) -> jax.Array | SegmentMask:
    """The mask of a full causal forward: `[B,T,T]` booleans for "xla", else segment ids.
    With `segment_ids_BxT` (packed sequences: ids >= 0, negative on padding) a token sees
    the earlier tokens of its own segment only."""
    seg = segment_ids_from_mask(mask_BxT) if segment_ids_BxT is None else jnp.where(
        mask_BxT, jnp.asarray(segment_ids_BxT, jnp.int32), -1)
    if config.attention != "xla":
        return SegmentMask(seg)
    i = jnp.arange(mask_BxT.shape[1])
    causal = i[None, :, None] >= i[None, None, :]
    allowed = causal & mask_BxT[:, None, :]
    if segment_ids_BxT is not None:
        allowed = allowed & (seg[:, :, None] == seg[:, None, :])
    # A query may always see itself, so padding rows stay finite (their output is unused).
    return allowed | (i[:, None] == i[None, :])[None]


def default_positions(mask_BxT: jax.Array) -> jax.Array:
    """Positions of real tokens counted from 0 within each row: cumsum(mask) - 1 (>= 0)."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=1) - 1, 0)


class Decoder(nnx.Module):
    """Decoder-only LM: embed -> L x Block -> final RMSNorm -> output projection.

    Parameters are float32 with logical axis names (`logical_axes` metadata); matmuls run
    in `config.compute_dtype`; logits and softmax in float32. Build it inside
    `jax.set_mesh(mesh)` to create each parameter already sharded. With `config.lora`
    the projections own LoRA adapters (`rljax.models.lora`), drawn from their own key
    stream: the base weights equal those of the same config without adapters.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"Decoder: config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        v, d = config.vocab_size, config.hidden_size
        self.embed = normal_param(rngs, (v, d), ("vocab", "embed"))
        lr = lora_rngs(rngs) if config.lora is not None else None
        moe = config.moe_layers
        if config.scan_layers:  # one Block with parameters [L, ...]; see rljax/models/scanned.py
            self.layers = stacked(lambda r, *lr_: Block(config, r, *lr_, moe=moe[0]),
                                  config.num_layers, rngs, *(() if lr is None else (lr,)))
        else:
            self.layers = nnx.List([Block(config, rngs, lr, moe=m) for m in moe])
        self.final_norm = RMSNorm(d, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = normal_param(rngs, (d, v), ("embed", "vocab"))

    def _embed(self, ids_BxT):
        return constrain_residual(lookup(self.embed[...], jnp.asarray(ids_BxT)))

    def hidden_states(self, input_ids_BxT: ArrayLike, positions_BxT: ArrayLike | None = None,
                      mask_BxT: ArrayLike | None = None, *, remat: bool = False,
                      segment_ids_BxT: ArrayLike | None = None) -> jax.Array:
        """Final-norm hidden states `[B, T, D]` (float32) of a full (causal) forward.

        mask_BxT marks real tokens (padding left or right); padding slots are never
        attended to. positions_BxT defaults to `cumsum(mask) - 1`. remat: run each layer
        under `jax.checkpoint` (only layer inputs are kept for the backward pass) when
        `config.remat` is "none"; `config.remat` otherwise decides. segment_ids_BxT:
        packed rows (``rljax.train.learn.packing``): a token attends to the earlier tokens
        with its own id only (pass each segment's own positions).
        """
        return self.routed_hidden_states(input_ids_BxT, positions_BxT, mask_BxT, remat=remat,
                                         segment_ids_BxT=segment_ids_BxT)[0]

    def routed_hidden_states(self, input_ids_BxT: ArrayLike,
                             positions_BxT: ArrayLike | None = None,
                             mask_BxT: ArrayLike | None = None, *, remat: bool = False,
                             segment_ids_BxT: ArrayLike | None = None,
                             replay_ids_LxBxTxK: ArrayLike | None = None,
                             ) -> tuple[jax.Array, RouterRecord | None]:
        """`hidden_states` and the MoE layers' `RouterRecord` (stacked over the L MoE
        layers; None for a dense model). ``replay_ids_LxBxTxK``: expert ids to route by
        (router replay), e.g. what the sampler recorded; None routes by the router."""
        ids = _check_ids(input_ids_BxT, positions_BxT, mask_BxT, segment_ids_BxT)
        mask = jnp.ones(ids.shape, bool) if mask_BxT is None else jnp.asarray(mask_BxT, bool)
        pos = default_positions(mask) if positions_BxT is None else jnp.asarray(positions_BxT)
        allowed = _causal_mask(self.config, mask, segment_ids_BxT)
        cos_sin = rope_cos_sin(self.config, pos)

        def body(lyr, xx, replay):
            xx, _, rec = lyr(xx, cos_sin, allowed, mask_BxT=mask, replay_ids_BxTxK=replay)
            return xx, rec

        replay = None if replay_ids_LxBxTxK is None else jnp.asarray(replay_ids_LxBxTxK)
        x, recs = self._apply_layers(body, self._embed(ids),
                                     effective_remat(self.config.remat, remat), replay)
        return self.final_norm(x), recs

    def _apply_layers(self, body, carry, remat: str, xs=None):
        """``carry, y = body(layer, carry, x)`` through every layer (a scan for stacked
        layers); ``x``: an MoE layer's slice of ``xs`` (``[L_moe, ...]``), None for a dense
        layer. Returns ``(carry, ys)``, the non-None ``y`` stacked (None if there are none)."""
        if self.config.scan_layers:
            return scan_apply(self.layers, body, carry, remat, xs)
        ys = []
        for layer, is_moe in zip(self.layers, self.config.moe_layers):
            x = None if xs is None or not is_moe else jax.tree.map(lambda a: a[len(ys)], xs)
            carry, y = _run_layer(layer, body, carry, remat, x)
            if y is not None:
                ys.append(y)
        return carry, (jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys else None)

    def grouped_hidden_states(self, prompt_NxP: ArrayLike, prompt_mask_NxP: ArrayLike,
                              input_ids_BxT: ArrayLike, mask_BxT: ArrayLike, *,
                              remat: bool = False, replay_ids_LxBxSxK: ArrayLike | None = None,
                              ) -> tuple[jax.Array, jax.Array]:
        """`routed_grouped_hidden_states` without the router record."""
        return self.routed_grouped_hidden_states(
            prompt_NxP, prompt_mask_NxP, input_ids_BxT, mask_BxT, remat=remat,
            replay_ids_LxBxSxK=replay_ids_LxBxSxK)[:2]

    def routed_grouped_hidden_states(self, prompt_NxP: ArrayLike, prompt_mask_NxP: ArrayLike,
                                     input_ids_BxT: ArrayLike, mask_BxT: ArrayLike, *,
                                     remat: bool = False,
                                     replay_ids_LxBxSxK: ArrayLike | None = None,
                                     ) -> tuple[jax.Array, jax.Array, RouterRecord | None]:
        """`hidden_states` of ``concat(prompt_n, row_b)`` with each prompt computed once.

        Rows ``n G .. n G + G - 1`` (G = B / N) follow prompt n (`rljax.models.grouped`).
        Returns the final-norm hidden states of the prompts `[N, P, D]` and of the rows'
        own slots `[B, T, D]` (float32): on real slots they equal `hidden_states` of the
        concatenated rows at positions P.. (and, per prompt, ..P - 1). Attention "xla" or
        "splash"; `remat` as in `hidden_states`. On a mesh with more batch shards than
        prompts each prompt runs as one copy per shard holding its rows
        (`grouped.prompt_copies`), so no keys or values cross chips.
        ``replay_ids_LxBxSxK``: router replay ids in the columns of ``concat(prompt, row)``
        (``S >= P + T``; `rljax.sampling.SampleResult.expert_ids`): each group's first row
        gives its prompt's, every row its own columns ``P .. P + T - 1``.
        Also returns the MoE layers' `RouterRecord` (None for a dense model) over the
        real tokens, each prompt's counted once per row that reads it
        (`rljax.models.moe.join_records`), as in `routed_hidden_states` of the rows.
        """
        pids, ids = jnp.asarray(prompt_NxP), jnp.asarray(input_ids_BxT)
        g = grouped.check_groups(pids, prompt_mask_NxP, ids, mask_BxT)
        k = grouped.prompt_copies(pids.shape[0], g)  # each prompt's copies (1 off a mesh)
        pids = grouped.on_batch_shards(grouped.repeat_rows(pids, k))
        pm = grouped.on_batch_shards(grouped.repeat_rows(jnp.asarray(prompt_mask_NxP, bool), k))
        cm = jnp.asarray(mask_BxT, bool)
        pm_B = grouped.repeat_rows(pm, g // k)
        c = self.config
        allowed_p, allowed_c = _causal_mask(c, pm), grouped.completion_mask(c, pm_B, cm)
        cs_p = rope_cos_sin(c, default_positions(pm))
        cs_c = rope_cos_sin(c, grouped.completion_positions(pm_B, cm))

        replay = None
        if replay_ids_LxBxSxK is not None:
            r, p = jnp.asarray(replay_ids_LxBxSxK), pids.shape[1]
            replay = (jax.vmap(lambda a: grouped.repeat_rows(a, k))(r[:, ::g, :p]),
                      r[:, :, p:p + ids.shape[1]])

        def body(layer, xs, rep):
            (xp, xc), (rp, rc) = xs, rep or (None, None)
            xp, (kp, vp), rec_p = layer(xp, cs_p, allowed_p, mask_BxT=pm, replay_ids_BxTxK=rp)
            prefix = (grouped.repeat_rows(kp, g // k), grouped.repeat_rows(vp, g // k))
            xc, _, rec_c = layer(xc, cs_c, allowed_c, prefix_kv=prefix, mask_BxT=cm,
                                 replay_ids_BxTxK=rc)
            if rec_p is None:
                return (xp, xc), None
            ids_BxSxK = jnp.concatenate(
                [grouped.repeat_rows(rec_p.ids_BxTxK, g // k), rec_c.ids_BxTxK], axis=1)
            return (xp, xc), join_records(rec_p, rec_c, g // k, ids_BxSxK)

        (xp, xc), recs = self._apply_layers(body, (self._embed(pids), self._embed(ids)),
                                            effective_remat(c.remat, remat), replay)
        return self.final_norm(xp)[::k], self.final_norm(xc), recs

    def logits_from_hidden(self, h_xD: jax.Array) -> jax.Array:
        """Output projection of hidden states `[..., D]` to float32 logits `[..., V]`."""
        cd = compute_dtype(self.config)
        spec, w = (("...d,vd->...v", self.embed) if self.config.tie_word_embeddings
                   else ("...d,dv->...v", self.lm_head))
        return jnp.einsum(spec, h_xD.astype(cd), w[...].astype(cd),
                          preferred_element_type=jnp.float32)

    def __call__(self, input_ids_BxT: ArrayLike, positions_BxT: ArrayLike | None = None,
                 mask_BxT: ArrayLike | None = None) -> jax.Array:
        """Float32 logits `[B, T, V]`; see `hidden_states` for the arguments."""
        return self.logits_from_hidden(self.hidden_states(input_ids_BxT, positions_BxT, mask_BxT))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for `batch` rows and `max_len` slots (compute dtype)."""
        c = self.config
        return init_kv_cache(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim,
                             compute_dtype(c), stacked=c.scan_layers)

    def forward_cached(self, input_ids_BxT: ArrayLike, positions_BxT: ArrayLike,
                       mask_BxT: ArrayLike, cache: KVCache, slot: ArrayLike,
                       prefix: KVCache | None = None) -> tuple[jax.Array, KVCache]:
        """`forward_cached_routed` without the expert ids."""
        return self.forward_cached_routed(input_ids_BxT, positions_BxT, mask_BxT, cache, slot,
                                          prefix)[:2]

    def forward_cached_routed(self, input_ids_BxT: ArrayLike, positions_BxT: ArrayLike,
                              mask_BxT: ArrayLike, cache: KVCache, slot: ArrayLike,
                              prefix: KVCache | None = None,
                              ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """Run T new tokens against the cache: returns (final hidden `[B,T,D]`, new cache).

        The new keys/values go to slots [slot, slot + T) (slot: int32 scalar shared by all
        rows), marked valid where mask_BxT; the query at slot s attends to valid slots
        j <= s. Prefill: one call with the padded prompts at slot 0; decode: T = 1 calls
        at slots P, P + 1, ...

        prefix: a read-only cache of C rows (C divides B) that rows ``c B/C .. (c+1) B/C - 1``
        read before their own cache, e.g. the prompts of a sampled group, kept once per
        prompt instead of copied into every row; every query sees its valid slots.

        Also returns the expert ids each MoE layer routed the T tokens to,
        ``[L_moe, B, T, k]`` int32 (None for a dense model): what router replay records.
        """
        ids = _check_ids(input_ids_BxT, positions_BxT, mask_BxT)
        for name, c in (("cache", cache), ("prefix", prefix)):
            if not isinstance(c, KVCache) and (name == "cache" or c is not None):
                raise TypeError(f"forward_cached: {name} must be a KVCache, got {type(c).__name__}")
        if cache.batch_size != ids.shape[0] or ids.shape[1] > cache.max_len:
            raise ValueError(
                f"forward_cached: input_ids shape {tuple(ids.shape)} does not fit a cache "
                f"of batch {cache.batch_size} and {cache.max_len} slots"
            )
        if prefix is not None and ids.shape[0] % prefix.batch_size:
            raise ValueError(f"forward_cached: a prefix of {prefix.batch_size} rows does not "
                             f"divide the {ids.shape[0]} rows into equal groups")
        t, s = ids.shape[1], cache.max_len
        # A prefill (slot a Python 0) sees only its own T tokens, so a kernel can run it.
        prefill = isinstance(slot, int) and slot == 0 and prefix is None
        slot = jnp.asarray(slot, jnp.int32)
        mask = jnp.asarray(mask_BxT, bool)
        valid = jax.lax.dynamic_update_slice(cache.valid_BxS, mask, (0, slot))
        if prefill and self.config.attention != "xla":
            allowed = SegmentMask(segment_ids_from_mask(mask))
        else:
            q_slot = slot + jnp.arange(t)
            j = jnp.arange(s)
            allowed = (valid[:, None, :] & (j[None, None, :] <= q_slot[None, :, None])) | (
                j[None, None, :] == q_slot[None, :, None]
            )
        cos_sin = rope_cos_sin(self.config, jnp.asarray(positions_BxT))
        x = self._embed(ids)
        gp = lambda i: None if prefix is None else (prefix.keys[i], prefix.values[i],
                                                    prefix.valid_BxS)
        if self.config.scan_layers:
            return self._forward_cached_scanned(x, cos_sin, allowed, cache, slot, valid, gp)
        keys, values, routed = [], [], []
        for i, (layer, ck, cv) in enumerate(zip(self.layers, cache.keys, cache.values)):
            x, (k, v), rec = layer(x, cos_sin, allowed, (ck, cv), slot, group_prefix=gp(i),
                                   mask_BxT=mask)
            keys.append(k)
            values.append(v)
            routed += [] if rec is None else [rec.ids_BxTxK]
        new_cache = KVCache(keys=tuple(keys), values=tuple(values), valid_BxS=valid)
        return self.final_norm(x), new_cache, jnp.stack(routed) if routed else None

    def _forward_cached_scanned(self, x, cos_sin, allowed, cache, slot, valid, gp):
        """The cached forward of stacked layers: the `[L, ...]` cache rides in the scan's
        carry, and layer i reads and writes back its slice i (updated in place by XLA);
        `gp(i)`: layer i's group prefix, or None."""
        if not isinstance(cache.keys, jax.Array):
            raise ValueError("forward_cached: a scanned decoder (scan_layers=True) needs a "
                             "stacked cache (keys [L,B,K,H,S]); build it with init_cache")

        def body(layer, i, carry):
            h, k_L, v_L = carry
            h, (k, v), rec = layer(h, cos_sin, allowed, (k_L[i], v_L[i]), slot,
                                   group_prefix=gp(i))
            return (h, k_L.at[i].set(k), v_L.at[i].set(v)), (None if rec is None
                                                              else rec.ids_BxTxK)

        (x, k_L, v_L), routed = scan_apply_indexed(
            self.layers, body, (x, cache.keys, cache.values), self.config.num_layers)
        return self.final_norm(x), KVCache(keys=k_L, values=v_L, valid_BxS=valid), routed
