"""Mixture-of-experts feed-forward (Qwen3-MoE): top-k router, dropless experts, replay.

Routing follows Hugging Face's `Qwen3MoeSparseMoeBlock` exactly: router logits
``x W_r`` and a float32 softmax over all E experts; the k largest probabilities pick the
experts and are the gate weights, renormalised to sum to 1 when `norm_topk_prob`. With
recorded expert ids (router replay) the ids are taken as given and the gate weights are
the current softmax gathered at them (renormalised likewise), so the router still learns.

Experts are dropless and never computed densely (all tokens through all experts). Two
forms of the same function (`MOE_IMPLS`):

- "ragged": the N k token-expert pairs sorted by expert, then `jax.lax.ragged_dot` per
  projection (grouped matmuls; what TPU / GPU run).
- "tiled": sorted likewise, each expert's group padded to a multiple of a tile of ``T``
  rows, then one batched matmul of the ``[tiles, T, D]`` rows by each tile's expert
  weights. XLA:CPU runs `ragged_dot` 11-58x slower than a dense matmul of the same FLOPs;
  this form costs at most ``(N k + E T) / (N k)`` times the active FLOPs, and `tile_rows`
  keeps ``E T <= N k / 4``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models import moe_parallel
from rljax.models.config import ModelConfig, MoeConfig
from rljax.models.layers import compute_dtype, normal_param
from rljax.objectives.kl import kl_estimate

#: Logical axes of the stacked expert weights (`rljax.sharding.LOGICAL_RULES`).
EXPERT_IN_AXES = ("expert", "expert_embed", "expert_mlp")
EXPERT_OUT_AXES = ("expert", "expert_mlp", "expert_embed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterRecord:
    """What one MoE layer's router did in a forward (stacked over MoE layers: a leading
    ``L`` axis on every field, L = MoE layers).

    ids_BxTxK: the experts each position went to (int32; `compact_ids` stores them int16).
    load_E: routed token-expert choices per expert, over real tokens (sums to k tokens).
    agree: routed choices (real tokens) that the router's own top-k holds too: with
      replay, the choices the learner would have made itself; else every choice.
    prob_sum_E: router probabilities summed over real tokens.
    z_sum: sum over real tokens of logsumexp(router logits)^2.
    tokens: real tokens counted.
    """

    ids_BxTxK: jax.Array
    load_E: jax.Array
    agree: jax.Array
    prob_sum_E: jax.Array
    z_sum: jax.Array
    tokens: jax.Array


def route(logits_NxE: jax.Array, k: int, norm_topk_prob: bool,
          replay_ids_NxK: jax.Array | None = None,
          ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(gate weights ``[N, k]`` float32, expert ids ``[N, k]`` int32, probs ``[N, E]``,
    own top-k ids ``[N, k]``).

    Top-k of the float32 softmax (HF's `Qwen3MoeTopKRouter`), or the softmax gathered at
    ``replay_ids_NxK`` where given (a token whose replayed ids are negative, e.g. one the
    sampler never fed, routes by its own top-k); renormalised over the k when
    ``norm_topk_prob``.
    """
    probs = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    top_w, own = jax.lax.top_k(probs, k)
    if replay_ids_NxK is None:
        weights, ids = top_w, own
    else:
        replay = jnp.asarray(replay_ids_NxK, jnp.int32)
        ids = jnp.where(replay[:, :1] >= 0, replay, own)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32), probs, own


def tile_rows(pairs: int, num_experts: int) -> int:
    """The "tiled" form's tile: the largest power of two <= pairs / (4 E), in [8, 256]
    (padding is at most E T <= pairs / 4 rows once pairs >= 32 E)."""
    t = max(1, pairs // (4 * num_experts))
    return int(min(256, max(8, 1 << (t.bit_length() - 1))))


def _sorted_pairs(ids_NxK: jax.Array, num_experts: int):
    """(order of the flat pairs by expert, experts in that order, group sizes ``[E + 1]``:
    the last counts pairs with the sentinel id E, sorted last)."""
    flat = ids_NxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts + 1).astype(jnp.int32)
    return order, flat[order], sizes


def _swiglu_rows(x_MxD, w_gate, w_up, w_down, matmul):
    """SwiGLU of rows through `matmul(rows, expert weights)`, float32 out."""
    cd = x_MxD.dtype
    g = matmul(x_MxD, w_gate.astype(cd))
    u = matmul(x_MxD, w_up.astype(cd))
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(cd)
    return matmul(h, w_down.astype(cd), jnp.float32)


def experts_ragged(x_NxD, ids_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    """Per pair (n, j): expert ``ids[n, j]``'s SwiGLU of ``x[n]``, ``[N, k, D]`` float32,
    as grouped matmuls (`jax.lax.ragged_dot`) over the pairs sorted by expert. A pair
    with the sentinel id E (no local expert: `rljax.models.moe_parallel`) gets zeros
    and no compute (its rows lie past every group)."""
    n, k = ids_NxK.shape
    e = w_gate_ExDxF.shape[0]
    order, _, sizes = _sorted_pairs(ids_NxK, e)
    rows = x_NxD[order // k]

    def matmul(a, w, out=None):
        return jax.lax.ragged_dot(a, w, sizes[:e], preferred_element_type=out)

    y = _swiglu_rows(rows, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, matmul)
    y = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)
    return jnp.where(ids_NxK[..., None] < e, y, 0.0)


def experts_tiled(x_NxD, ids_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, tile: int):
    """`experts_ragged`'s function as one batched matmul over tiles of ``tile`` rows.

    Each expert's pairs fill whole tiles (the last padded with zero rows); tile i takes
    the weights of its expert. The static row count ``N k + (E + 1) tile`` bounds every
    routing, so no pair is ever dropped. Sentinel pairs (id E) get zeros.
    """
    n, k = ids_NxK.shape
    e = w_gate_ExDxF.shape[0]
    pairs = n * k
    num_tiles = -(-(pairs + (e + 1) * (tile - 1)) // tile)
    order, sorted_e, sizes = _sorted_pairs(ids_NxK, e)
    padded = -(-sizes // tile) * tile
    start = jnp.cumsum(sizes) - sizes
    pstart = jnp.cumsum(padded) - padded
    # Sorted pair r of expert x goes to padded row pstart[x] + (r - start[x]).
    dest = pstart[sorted_e] + jnp.arange(pairs, dtype=jnp.int32) - start[sorted_e]
    src = jnp.full((num_tiles * tile,), pairs, jnp.int32).at[dest].set(order.astype(jnp.int32))
    x_pad = jnp.concatenate([x_NxD, jnp.zeros((1, x_NxD.shape[1]), x_NxD.dtype)])
    rows = x_pad[jnp.where(src < pairs, src // k, n)]  # padding rows read the zero row
    tile_expert = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_tiles) * tile, side="right"), e - 1)

    def matmul(a, w, out=None):
        a_t = a.reshape(num_tiles, tile, a.shape[-1])
        return jnp.einsum("tri,tio->tro", a_t, w[tile_expert],
                          preferred_element_type=out).reshape(num_tiles * tile, -1)

    y = _swiglu_rows(rows, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, matmul)
    out = jnp.zeros((pairs, y.shape[-1]), y.dtype).at[order].set(y[dest])
    return jnp.where(ids_NxK[..., None] < e, out.reshape(n, k, -1), 0.0)


def resolve_impl(impl: str) -> str:
    """The `MOE_IMPLS` form a program uses: "auto" is "tiled" on CPU, else "ragged"."""
    if impl != "auto":
        return impl
    return "tiled" if jax.default_backend() == "cpu" else "ragged"


def record(ids_NxK, probs_NxE, logits_NxE, mask_N, shape_BxT, own_NxK=None) -> RouterRecord:
    """The `RouterRecord` of one layer's routing, statistics over ``mask_N`` tokens
    (``own_NxK``: the router's own top-k, when ``ids_NxK`` were replayed)."""
    m = mask_N.astype(jnp.float32)
    e = probs_NxE.shape[-1]
    load = jnp.sum(jax.nn.one_hot(ids_NxK, e, dtype=jnp.float32) * m[:, None, None], (0, 1))
    z = jax.nn.logsumexp(logits_NxE.astype(jnp.float32), axis=-1)
    own = ids_NxK if own_NxK is None else own_NxK
    held = jnp.any(ids_NxK[:, :, None] == own[:, None, :], axis=-1)
    return RouterRecord(ids_BxTxK=ids_NxK.reshape(*shape_BxT, -1), load_E=load,
                        agree=jnp.sum(held * m[:, None]),
                        prob_sum_E=jnp.sum(probs_NxE * m[:, None], 0),
                        z_sum=jnp.sum(jnp.square(z) * m), tokens=jnp.sum(m))


class MoeMLP(nnx.Module):
    """Router ``[D, E]`` and E SwiGLU experts (gate / up ``[E, D, F]``, down ``[E, F, D]``).

    The router runs in float32 whatever the compute dtype (its weight is never cast), so
    top-k choices and replayed gate weights do not depend on bf16 rounding of logits.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        moe: MoeConfig = config.moe
        d, f, e = config.hidden_size, moe.intermediate_size, moe.num_experts
        self.router = normal_param(rngs, (d, e), ("embed", None))
        self.gate = normal_param(rngs, (e, d, f), EXPERT_IN_AXES)
        self.up = normal_param(rngs, (e, d, f), EXPERT_IN_AXES)
        self.down = normal_param(rngs, (e, f, d), EXPERT_OUT_AXES)
        self.moe = moe
        self.dtype = compute_dtype(config)

    def __call__(self, x_BxTxD: jax.Array, mask_BxT: jax.Array | None = None,
                 replay_ids_BxTxK: jax.Array | None = None) -> tuple[jax.Array, RouterRecord]:
        """(float32 output ``[B, T, D]``, this layer's `RouterRecord`). On a mesh whose
        "fsdp" axis splits the experts, experts run in parallel
        (`rljax.models.moe_parallel`); otherwise as GSPMD partitions the program."""
        b, t, _ = x_BxTxD.shape
        mask = jnp.ones((b, t), bool) if mask_BxT is None else jnp.asarray(mask_BxT, bool)
        experts = (self.gate[...], self.up[...], self.down[...])
        local = functools.partial(_moe_local, self.moe, self.dtype)
        if moe_parallel.expert_axis_size(b, self.moe.num_experts) > 1:
            out, ids, stats = moe_parallel.run_expert_parallel(
                local, x_BxTxD, mask, replay_ids_BxTxK, self.router[...], experts)
        else:
            out, ids, stats = local(x_BxTxD, mask, replay_ids_BxTxK, self.router[...],
                                    experts)
        return out, RouterRecord(ids, *stats)


def _moe_local(moe: MoeConfig, dtype, x_BxTxD, mask_BxT, replay_BxTxK, router_DxE, experts,
               axis: str | None = None, batch_axes: tuple[str, ...] = ()):
    """One MoE layer on the rows at hand: ``(out [B, T, D], ids [B, T, k], (load_E, agree,
    prob_sum_E, z_sum, tokens))`` (the `RouterRecord` fields). With ``axis`` (inside `shard_map`) ``experts`` are this
    chip's slice: pairs are dispatched and combined over ``axis`` and the statistics
    summed over ``batch_axes``."""
    b, t, d = x_BxTxD.shape
    x32 = x_BxTxD.reshape(b * t, d).astype(jnp.float32)
    logits = jnp.dot(x32, router_DxE, preferred_element_type=jnp.float32)
    replay = None if replay_BxTxK is None else replay_BxTxK.reshape(b * t, -1)
    weights, ids, probs, own = route(logits, moe.experts_per_token, moe.norm_topk_prob,
                                     replay)
    x = x32.astype(dtype)
    rows, local_ids, local_w = x, ids, weights
    if axis is not None:
        rows, local_ids, local_w = moe_parallel.dispatch(x, ids, weights, experts[0].shape[0],
                                                         axis)
    if resolve_impl(moe.impl) == "ragged":
        y = experts_ragged(rows, local_ids, *experts)
    else:
        pairs = local_ids.size
        y = experts_tiled(rows, local_ids, *experts, tile_rows(pairs, experts[0].shape[0]))
    out = jnp.einsum("nkd,nk->nd", y, local_w)
    if axis is not None:
        out = moe_parallel.combine(out, axis)
    rec = record(ids, probs, logits, mask_BxT.reshape(-1), (b, t), own)
    stats = (rec.load_E, rec.agree, rec.prob_sum_E, rec.z_sum, rec.tokens)
    if batch_axes:
        stats = jax.lax.psum(stats, batch_axes)
    return out.reshape(b, t, d), rec.ids_BxTxK, stats


def join_records(prompt: RouterRecord, rows: RouterRecord, copies: int,
                 ids_BxTxK: jax.Array) -> RouterRecord:
    """One record of a shared-prompt forward (`Decoder.grouped_hidden_states`): each
    prompt's statistics count for the ``copies`` rows that read it, as in a forward of
    the concatenated rows; ``ids_BxTxK``: the rows' ids over prompt and own columns."""
    stat = lambda p, r: p * copies + r
    return RouterRecord(ids_BxTxK=ids_BxTxK, load_E=stat(prompt.load_E, rows.load_E),
                        agree=stat(prompt.agree, rows.agree),
                        prob_sum_E=stat(prompt.prob_sum_E, rows.prob_sum_E),
                        z_sum=stat(prompt.z_sum, rows.z_sum),
                        tokens=stat(prompt.tokens, rows.tokens))


def aux_loss(rec: RouterRecord) -> jax.Array:
    """Switch-Transformer load-balance loss (Fedus et al. 2021, eq. 4-6) per MoE layer,
    averaged over layers: ``E sum_e f_e P_e`` with f_e the routed choices per token and
    P_e the mean router probability of expert e (minimum k at uniform routing; HF's form,
    whose top-k f sums to k). ``rec``: a stacked `RouterRecord` (leading L axis)."""
    tokens = jnp.maximum(rec.tokens, 1.0)[..., None]
    e = rec.load_E.shape[-1]
    per_layer = e * jnp.sum((rec.load_E / tokens) * (rec.prob_sum_E / tokens), axis=-1)
    return jnp.mean(per_layer)


def z_loss(rec: RouterRecord) -> jax.Array:
    """Router z-loss (Zoph et al. 2022, ST-MoE eq. 5): mean over real tokens of
    logsumexp(router logits)^2, averaged over MoE layers."""
    return jnp.mean(rec.z_sum / jnp.maximum(rec.tokens, 1.0))


def router_loss(rec: RouterRecord, moe: MoeConfig) -> jax.Array:
    """``aux_loss_coef * aux_loss + z_loss_coef * z_loss`` (0.0 when both are off)."""
    total = jnp.float32(0.0)
    if moe.aux_loss_coef:
        total = total + moe.aux_loss_coef * aux_loss(rec)
    if moe.z_loss_coef:
        total = total + moe.z_loss_coef * z_loss(rec)
    return total


def router_metrics(rec: RouterRecord) -> dict[str, jax.Array]:
    """Scalars (and the expert load histogram ``moe/load_E``: each expert's share of the
    routed choices, over all MoE layers) for a step's metrics."""
    load = jnp.sum(rec.load_E, axis=0)
    share = load / jnp.maximum(jnp.sum(load), 1.0)
    e = share.shape[-1]
    k = rec.ids_BxTxK.shape[-1]
    agreement = jnp.sum(rec.agree) / jnp.maximum(k * jnp.sum(rec.tokens), 1.0)
    return {"moe/aux_loss": aux_loss(rec), "moe/z_loss": z_loss(rec), "moe/load_E": share,
            "moe/load_max_over_mean": jnp.max(share) * e, "moe/routing_agreement": agreement}


def mismatch_kl(sampler_logp: jax.Array, learner_logp: jax.Array,
                mask: jax.Array) -> dict[str, jax.Array]:
    """The sampler-learner mismatch both ways, from log-probs of tokens the sampler drew:
    ``moe/kl_sampler_learner`` = KL(sampler || learner) (k3) and
    ``moe/kl_learner_sampler`` = KL(learner || sampler) (k3 weighted by learner / sampler,
    unbiased under the sampler's draws), means over ``mask``."""
    m = jnp.asarray(mask, jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    fwd = kl_estimate(sampler_logp, learner_logp, "k3")
    rev = kl_estimate(learner_logp, sampler_logp, "k3_ratio", old_logp=sampler_logp)
    return {"moe/kl_sampler_learner": jnp.sum(fwd * m) / n,
            "moe/kl_learner_sampler": jnp.sum(rev * m) / n}


def active_params(num_params: int, config: ModelConfig) -> int:
    """The parameters one token computes with (what FLOPs and MFU count): ``num_params``
    (the model's total) less, in each MoE layer, the ``E - k`` experts it is not routed
    to; ``num_params`` itself for a dense model."""
    if config.moe is None:
        return num_params
    m = config.moe
    idle = 3 * config.hidden_size * m.intermediate_size * (m.num_experts - m.experts_per_token)
    return num_params - idle * sum(config.moe_layers)


def compact_ids(ids: jax.Array, num_experts: int) -> jax.Array:
    """Expert ids in the smallest integer dtype that holds them (int8 below 128 experts,
    else int16): what a sampler keeps per position and MoE layer."""
    return ids.astype(jnp.int8 if num_experts <= 127 else jnp.int16)


__all__ = ["EXPERT_IN_AXES", "EXPERT_OUT_AXES", "MoeMLP", "RouterRecord", "active_params",
           "aux_loss", "compact_ids", "experts_ragged", "experts_tiled", "join_records",
           "mismatch_kl", "record", "resolve_impl", "route", "router_loss", "router_metrics",
           "tile_rows", "z_loss"]
