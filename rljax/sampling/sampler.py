"""The jitted KV-cache sampler: prefill once, then decode in `lax.while_loop` phases.

``generate`` packs the prompts on the host (left padding, length buckets), then runs two
compiled programs:

1. ``_prefill``: one forward of the ``B`` padded prompts into a cache of ``P`` slots, the
   next-token logits repeated ``G = num_samples`` times (each prompt is prefilled once),
   and the first token drawn.
2. ``_decode``: ``lax.while_loop`` phases that feed the last token at slot ``P + t - 1``,
   draw token ``t`` and stop once ``max_new_tokens`` are drawn or every row has emitted
   a stop id. The loop state is donated and the rows' caches live inside the program
   (grown per phase), so every buffer is updated in place, never reallocated per step;
   no cache is returned.

Shared prompt cache: the G rows of a prompt read one copy of the prompt's keys and values
(``Decoder.forward_cached(..., prefix=)``, ``rljax.models.attention.attend_group_prefix``)
and each row's own cache holds only its completion. Against a cache with the prompt
copied into every row this divides the prompt's share of the KV memory and of the decode
attention's reads by G (on the GSM8K Qwen2.5 recipes, prompts of 320 and 512 new tokens,
the decode program's peak per chip is ~21% lower; docs/performance.md, "Per-chip
memory"). On a mesh with more batch shards than prompts each prompt's cache is kept once
per shard holding its rows (``rljax.models.grouped.prompt_copies``), so no keys cross
chips.

Decode phases: attention reads every slot of the cache, and on a CPU reading the cache
costs about as much as the lm head at the end of a long completion. So the steps are
split into up to ``DecodeSpec.phases`` loops, each with a cache just long enough for its
last step; between phases the cache grows (one copy). The results do not depend on the
phases (empty slots are masked out either way); only the cost does.

The model is split into ``graphdef`` (static) and ``state`` (an argument) outside jit and
merged inside, so the trainer can pass the current policy's state without a copy. On a
mesh, rows are split over ("data", "fsdp") and kv heads over "tensor" (the cache follows
``rljax.models.kv_cache_shardings``); the draws do not depend on the sharding (threefry
keys are partitionable), so results equal the single-device ones. The logits stay split
by vocabulary over "tensor" while tokens are drawn (``rljax.sampling.vocab_shards``: the
chips exchange per-row summaries, never the logits).

Inference layout (docs/design.md, "Mesh layout" and "Numerics"): a decode loop over the
FSDP-sharded training layout would all-gather every weight at every step, so the sampler
decodes with ``rljax.sharding.inference_shardings`` (each parameter replicated over data x
fsdp, still split over "tensor"), its matmul weights cast to the compute dtype
(``rljax.models.layers.cast_matmul_weights``, before the gather). ``run`` makes that copy
once per call (freed when the call returns), and ``_prefill`` / ``_decode`` constrain to it
on entry, so inside a larger program (``rljax.train.programs.device``) XLA gathers once,
before the loops. While sampling a chip holds the copy, ``params / tensor``, beside its
training shard (``experiments/memory_budget.py`` counts both); with fsdp = 1 only a
bfloat16 model's cast copy is made.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rljax.models import ModelConfig, grow_kv_cache, kv_cache_shardings
from rljax.models.grouped import prompt_copies
from rljax.models.layers import cast_matmul_weights, compute_dtype
from rljax.models.moe import compact_ids
from rljax.sampling.head import state_vocab_major_weight, vocab_major_head
from rljax.sampling.ops import SamplingParams
from rljax.sampling.prompts import PackedPrompts
from rljax.sampling.result import SampleResult
from rljax.sampling.vocab_shards import sample_tokens_sharded
from rljax.sharding import (BATCH_AXES, inference_shardings, logical_sharding, mesh_context,
                            mesh_of)

__all__ = ["DecodeSpec", "DecodeState", "compiled_count", "inference_layout", "plan_phases",
           "sample_arrays", "sampler_weights"]

# Logical axes of the vocab-major output weight ``W_VxD`` (``rljax.sampling.head``).
HEAD_AXES = ("vocab", "embed")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static (hashable) settings of one compiled sampler program.

    phases: ``((end_step, cache_len), ...)``: decode loop ``j`` runs while fewer than
    ``end_step`` tokens are drawn, with a cache of ``cache_len`` slots (increasing; the
    last phase ends at ``max_new_tokens`` with the full cache). See :func:`plan_phases`.
    """

    params: SamplingParams
    stop_ids: tuple[int, ...]
    num_samples: int
    max_new_tokens: int
    phases: tuple[tuple[int, int], ...]
    pad_id: int


MIN_PHASE_STEPS = 16


def plan_phases(prompt_len: int, max_new_tokens: int, cache_len: int, max_phases: int,
                ) -> tuple[tuple[int, int], ...]:
    """Split decode steps ``1 .. N-1`` into at most ``max_phases`` near-equal loops.

    Each phase gets the smallest cache that holds its last step (step ``t`` feeds slot
    ``P + t - 1``), the last one ``cache_len``; phases have at least
    ``MIN_PHASE_STEPS`` steps, so short completions decode in one loop.
    """
    steps = max_new_tokens - 1
    k = max(1, min(max_phases, steps // MIN_PHASE_STEPS))
    ends = [1 + (steps * (j + 1)) // k for j in range(k)]
    return tuple((e, prompt_len + e - 1) for e in ends[:-1]) + ((max_new_tokens, cache_len),)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The while-loop carry (``R = B * G`` rows, ``N = max_new_tokens``).

    step: int32 scalar, tokens drawn so far. slot: the cache slot of ``last_R``.
    last_R: the token to feed next; feed_pos_R: its position. done_R: emitted a stop id.
    lengths_R: completion lengths so far. tokens/logp/sampling_logp: ``[R, N]`` outputs.
    experts_RxLxNxK: an MoE model's expert ids of each fed completion token, per MoE layer
      (int8 / int16, -1 where none was fed; `rljax.models.moe.compact_ids`); None for a
      dense model.
    """

    cache: object  # the rows' own KVCache inside the decode loop, None between programs
    key: jax.Array
    step: jax.Array
    slot: jax.Array
    last_R: jax.Array
    feed_pos_R: jax.Array
    done_R: jax.Array
    lengths_R: jax.Array
    tokens_RxN: jax.Array
    logp_RxN: jax.Array
    sampling_logp_RxN: jax.Array
    experts_RxLxNxK: jax.Array | None = None


def constrain(x, mesh, names):
    """``x`` constrained to the logical axes ``names`` on ``mesh`` (as is for None)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_sharding(names, x.shape, mesh))


def constrain_cache(cache, mesh):
    """``cache`` constrained to ``kv_cache_shardings`` on ``mesh`` (as is for None)."""
    if mesh is None or cache is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, kv_cache_shardings(cache, mesh))


def constrain_rows(s, mesh):
    """A loop state (``DecodeState``, ``rljax.sampling.turns.TurnState``) with its cache
    constrained (``constrain_cache``) and every per-row field (``*_R``, ``*_RxN``, ...)
    split over the batch axes; as is without a mesh."""
    if mesh is None:
        return s
    rows = {f.name: constrain(getattr(s, f.name), mesh,
                              ("batch",) + (None,) * (getattr(s, f.name).ndim - 1))
            for f in dataclasses.fields(s) if f.name.endswith(("_R", "_RxN", "_RxT", "_RxL"))}
    if getattr(s, "experts_RxLxNxK", None) is not None:
        rows["experts_RxLxNxK"] = constrain(s.experts_RxLxNxK, mesh, ("batch", None, None, None))
    return dataclasses.replace(s, cache=constrain_cache(s.cache, mesh), **rows)


def _record_experts(s: DecodeState, routed_LxRx1xK) -> DecodeState:
    """The fed token's expert ids (completion token ``step - 1``) written into ``s``."""
    if routed_LxRx1xK is None:
        return s
    buf = s.experts_RxLxNxK
    col = jnp.swapaxes(routed_LxRx1xK, 0, 1).astype(buf.dtype)
    return dataclasses.replace(s, experts_RxLxNxK=jax.lax.dynamic_update_slice(
        buf, col, (0, 0, s.step - 1, 0)))


def _record(s: DecodeState, spec: DecodeSpec, cache, tok_R, logp_R, slogp_R) -> DecodeState:
    """Write the drawn tokens at column ``step`` (pad / 0 for rows already done)."""
    active_R = ~s.done_R
    tok_R = jnp.where(active_R, tok_R, spec.pad_id).astype(jnp.int32)
    zero = jnp.zeros_like(logp_R)

    def put(buf_RxN, col_R):
        return jax.lax.dynamic_update_slice(buf_RxN, col_R[:, None].astype(buf_RxN.dtype), (0, s.step))

    stop = jnp.asarray(spec.stop_ids or (-1,), jnp.int32)
    hit_R = jnp.any(tok_R[:, None] == stop[None, :], axis=-1) & active_R
    return dataclasses.replace(
        s,
        cache=cache,
        step=s.step + 1,
        slot=s.slot + 1,
        last_R=tok_R,
        feed_pos_R=s.feed_pos_R + 1,
        done_R=s.done_R | hit_R,
        lengths_R=jnp.where(active_R, s.step + 1, s.lengths_R),
        tokens_RxN=put(s.tokens_RxN, tok_R),
        logp_RxN=put(s.logp_RxN, jnp.where(active_R, logp_R, zero)),
        sampling_logp_RxN=put(s.sampling_logp_RxN, jnp.where(active_R, slogp_R, zero)),
    )


def inference_layout(params, head_VxD, mesh, place=jax.lax.with_sharding_constraint):
    """``(params, head_VxD)`` in the decode layout (``rljax.sharding.inference_shardings``;
    the head ``W_VxD`` split over "tensor" by vocab), or as given without a mesh.

    place: ``jax.lax.with_sharding_constraint`` inside jit (the default), ``jax.device_put``
    for concrete arrays (a copy where the layouts differ).
    """
    if mesh is None:
        return params, head_VxD
    params = place(params, inference_shardings(params, mesh))
    if head_VxD is not None:
        head_VxD = place(head_VxD, logical_sharding(HEAD_AXES, head_VxD.shape, mesh, BATCH_AXES))
    return params, head_VxD


def decode_model(graphdef, params, head_VxD, mesh):
    """The decoder the sampler runs and its head weight, in the inference layout with the
    matmul weights cast to the compute dtype before the layout change (module docstring)."""
    cd = compute_dtype(nnx.merge(graphdef, params).config)
    params, head_VxD = inference_layout(cast_matmul_weights(params, cd), head_VxD, mesh)
    return nnx.merge(graphdef, params), head_VxD


def _repeat_rows(x, g, axis=0):
    return x if g == 1 else jnp.repeat(x, g, axis=axis)


def _repeat_cache_rows(cache, g):
    """Each cache row ``g`` times: keys / values have the batch axis 4th from last (a
    scanned decoder's stacked ``[L, B, ...]`` buffers lead with the layer axis)."""
    if g == 1:
        return cache
    rows = lambda x: jnp.repeat(x, g, axis=x.ndim - 4)
    return dataclasses.replace(cache, keys=jax.tree.map(rows, cache.keys),
                               values=jax.tree.map(rows, cache.values),
                               valid_BxS=_repeat_rows(cache.valid_BxS, g))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _prefill(graphdef, spec: DecodeSpec, mesh, params, head_VxD, tokens_BxP, mask_BxP, pos_BxP,
             key):
    """Prefill the prompts once, draw the first token of each of their G rows.

    Returns the state, the prompts' cache (each prompt once, or once per batch shard
    holding its rows on a mesh: the decode's read-only prefix) and the prompt arrays
    repeated for the rows.
    """
    model, head_VxD = decode_model(graphdef, params, head_VxD, mesh)
    b, p = tokens_BxP.shape
    cache = constrain_cache(model.init_cache(b, p), mesh)
    h_BxPxD, cache, routed_LxBxPxK = model.forward_cached_routed(tokens_BxP, pos_BxP, mask_BxP,
                                                                  cache, 0)
    logits_VxB = vocab_major_head(model, head_VxD)(h_BxPxD[:, -1])
    g, n = spec.num_samples, spec.max_new_tokens
    prefix = constrain_cache(
        _repeat_cache_rows(cache, 1 if mesh is None else prompt_copies(b, g, mesh)), mesh)
    r = b * g
    plen_R = _repeat_rows(jnp.sum(mask_BxP, axis=1, dtype=jnp.int32), g)
    zeros_RxN = jnp.zeros((r, n), jnp.float32)
    s = DecodeState(
        cache=None, key=key, step=jnp.int32(0), slot=jnp.int32(p - 1),
        last_R=jnp.zeros((r,), jnp.int32), feed_pos_R=plen_R - 1,
        done_R=jnp.zeros((r,), bool), lengths_R=jnp.zeros((r,), jnp.int32),
        tokens_RxN=jnp.full((r, n), spec.pad_id, jnp.int32),
        logp_RxN=zeros_RxN, sampling_logp_RxN=zeros_RxN,
        experts_RxLxNxK=_expert_buffer(model.config, routed_LxBxPxK, r, n),
    )
    tok, lp, slp = sample_tokens_sharded(jax.random.fold_in(key, 0),
                                         _repeat_rows(logits_VxB, g, axis=1), spec.params, mesh)
    s = constrain_rows(_record(s, spec, None, tok, lp, slp), mesh)
    prompt = tuple(_repeat_rows(x, g) for x in (tokens_BxP, mask_BxP, pos_BxP))
    if routed_LxBxPxK is not None:
        routed = jnp.swapaxes(compact_ids(routed_LxBxPxK, model.config.moe.num_experts), 0, 1)
        prompt += (constrain(_repeat_rows(routed, g), mesh, ("batch", None, None, None)),)
    return s, prefix, prompt


def _expert_buffer(config, routed_LxBxPxK, r: int, n: int):
    """The completion tokens' expert-id buffer ``[R, L, N, k]`` of -1 (None when dense)."""
    if routed_LxBxPxK is None:
        return None
    l, _, _, k = routed_LxBxPxK.shape
    dtype = compact_ids(routed_LxBxPxK[:0], config.moe.num_experts).dtype
    return jnp.full((r, l, n, k), -1, dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5,))
def _decode(graphdef, spec: DecodeSpec, mesh, params, head_VxD, s: DecodeState, prefix):
    """Decode until ``max_new_tokens`` or every row stopped; the state is donated.

    ``prefix``: the prompts' cache (``C`` rows, ``P`` slots); slot ``j`` of a row's own
    cache is the sequence's slot ``P + j`` (module docstring). ``s.cache`` is None on the
    way in and out. ``head_VxD``: ``state_vocab_major_weight`` (or None).
    """
    model, head_VxD = decode_model(graphdef, params, head_VxD, mesh)
    r, p = s.last_R.shape[0], prefix.max_len
    ones_Rx1 = jnp.ones((r, 1), bool)
    head = vocab_major_head(model, head_VxD)
    own_len = lambda cache_len: max(cache_len - p, 1)
    s = dataclasses.replace(s, cache=model.init_cache(r, own_len(spec.phases[0][1])))

    def body(s):
        h_Rx1xD, cache, routed = model.forward_cached_routed(
            s.last_R[:, None], s.feed_pos_R[:, None], ones_Rx1, s.cache, s.slot - p, prefix
        )
        s = _record_experts(s, routed)
        tok, lp, slp = sample_tokens_sharded(jax.random.fold_in(s.key, s.step),
                                             head(h_Rx1xD[:, 0]), spec.params, mesh)
        return constrain_rows(_record(s, spec, cache, tok, lp, slp), mesh)

    for end_step, cache_len in spec.phases:
        s = dataclasses.replace(s, cache=grow_kv_cache(s.cache, own_len(cache_len)))
        s = jax.lax.while_loop(
            lambda s, end=end_step: (s.step < end) & ~jnp.all(s.done_R), body,
            constrain_rows(s, mesh)
        )
    return dataclasses.replace(s, cache=None)


def compiled_count() -> int:
    """How many programs the sampler has compiled in this process (prefill + decode).

    Repeated ``generate`` calls with prompts in the same length bucket, the same batch
    size and settings must not raise it.
    """
    return _prefill._cache_size() + _decode._cache_size()


def run(graphdef: nnx.GraphDef, params: nnx.State, prompts: PackedPrompts, spec: DecodeSpec,
        key: jax.Array, mesh: Mesh | None = None, config: ModelConfig | None = None,
        ) -> SampleResult:
    """Prefill + decode left-padded prompts; see ``rljax.sampling.generate`` for the API.
    ``config``: the model's config (the weights' preparation, :func:`sampler_weights`)."""
    mesh = mesh_of(params) if mesh is None else mesh
    host = (prompts.tokens_BxP, prompts.mask_BxP, prompts.positions_BxP)
    if mesh is not None:
        host = tuple(
            jax.device_put(x, logical_sharding(("batch", None), x.shape, mesh)) for x in host
        )
    params, head_VxD = sampler_weights(params, config, mesh)
    index_R = _prompt_index(len(prompts.lengths_B), spec.num_samples, mesh)
    with mesh_context(mesh):  # prefill's attention kernels run per chip (rljax.sharding)
        return sample_arrays(graphdef, params, *host, spec, key, mesh, head_VxD, index_R)


def sampler_weights(params: nnx.State, config: ModelConfig | None, mesh: Mesh | None):
    """The weights the sampler's programs read, ``(params, head_VxD)``: the matmul weights
    cast to the config's compute dtype, on a mesh copied to the inference layout (module
    docstring), and the vocab-major output weight built once from them (None without a
    config: each program builds it inside). Every sampler entry (``run``, the multi-turn
    rollouts' turn programs) prepares its weights here."""
    cast = (lambda p: p) if config is None else (
        lambda p: cast_matmul_weights(p, compute_dtype(config)))
    if mesh is not None:
        params, _ = inference_layout(cast(params), None, mesh, place=jax.device_put)
    head_VxD = None if config is None else state_vocab_major_weight(params, config)
    return cast(params), head_VxD  # (a no-op cast on a mesh) the programs get the copy


def sample_arrays(graphdef: nnx.GraphDef, params: nnx.State, tokens_BxP, mask_BxP,
                  positions_BxP, spec: DecodeSpec, key: jax.Array, mesh: Mesh | None = None,
                  head_VxD=None, prompt_index_R=None) -> SampleResult:
    """The sampler on packed prompt arrays (``rljax.sampling.PackedPrompts``' fields, on
    device or traced): callable inside ``jax.jit`` and ``jax.vmap``, so a caller can
    compile sampling into a larger program (``rljax.train.programs.device``). ``prompt_index_R``
    defaults to ``row // num_samples``."""
    s, prefix, (ptok, pmask, ppos, *pexperts) = _prefill(
        graphdef, spec, mesh, params, head_VxD, tokens_BxP, mask_BxP, positions_BxP, key)
    s = _decode(graphdef, spec, mesh, params, head_VxD, s, prefix)
    n, g = spec.max_new_tokens, spec.num_samples
    cols_N = jnp.arange(n, dtype=jnp.int32)
    plen_R = jnp.sum(pmask, axis=1, dtype=jnp.int32)
    if prompt_index_R is None:
        prompt_index_R = jnp.repeat(jnp.arange(tokens_BxP.shape[0], dtype=jnp.int32), g)
    return SampleResult(
        prompt_tokens=ptok, prompt_mask=pmask, prompt_positions=ppos,
        tokens=s.tokens_RxN,
        completion_mask=cols_N[None, :] < s.lengths_R[:, None],
        positions=plen_R[:, None] + cols_N[None, :],
        lengths=s.lengths_R, truncated=~s.done_R,
        logprobs=s.logp_RxN, sampling_logprobs=s.sampling_logp_RxN,
        prompt_index=prompt_index_R,
        expert_ids=(jnp.concatenate([pexperts[0], s.experts_RxLxNxK], axis=2) if pexperts
                    else None),
    )


def _prompt_index(n_prompts: int, g: int, mesh: Mesh | None) -> jax.Array:
    """``row // g`` as a global array placed like the sampled rows (the same host data on
    every process), so it mixes with the other outputs on a pod."""
    index_R = np.repeat(np.arange(n_prompts, dtype=np.int32), g)
    if mesh is None:
        return jnp.asarray(index_R)
    return jax.device_put(index_R, logical_sharding(("batch",), index_R.shape, mesh))
