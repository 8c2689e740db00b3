"""Causal self-attention through maintained kernels: Pallas TPU splash attention and cuDNN.

Both kernels take the mask the decoder needs — causal, padding on either side, packed
sequences — as *segment ids* plus causality: token t attends to token s iff s <= t and
both carry the same id. Real tokens carry ids >= 0; a negative id marks padding. Each
padding slot is given an id of its own (`-1 - t`), so its query row attends to itself
only: never an empty row (an empty softmax row would be 0/0 = NaN, and a NaN reaches
the gradients even where the row's output is unused), and no real row sees padding.

Neither kernel materialises the [B, N, T, S] scores that `rljax.models.attention.attend`
does; see docs/design.md, "Forward paths", for when each is used.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as splash_mask,
)
from jax.sharding import PartitionSpec

from rljax.sharding import fitted_spec

# Splash's blocks must be multiples of the TPU's 128 lanes. A grid step costs ~0.35 us of
# overhead against ~20 ns of MXU work for a 128 x 128 block at head_dim 64, so blocks are
# as large as VMEM allows: a sequence padded to a multiple of 128 runs as one block up to
# _WHOLE_MAX positions (a 1024 x 1024 float32 score tile is 4 MiB; the fused backward
# holds a few such tiles, inside v5e's 16 MiB default scoped VMEM), a longer one is padded
# to a multiple of _LONG_BLOCK and runs in blocks of that size. Padding slots are isolated
# as above, so they change no real row.
_LANES = 128
_WHOLE_MAX = 1024
_LONG_BLOCK = 512


def _traced_for_tpu() -> bool:
    """Whether the program being traced runs on TPU: the platform of the mesh set by
    ``jax.set_mesh`` (part of JAX's cache key; a mesh over a topology description's TPU
    devices compiles TPU programs ahead of time on a CPU host, as
    experiments/memory_budget.py does), else the default backend's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    platform = jax.default_backend() if device is None else device.platform
    return platform == "tpu"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentMask:
    """The mask of a full causal forward, as the kernel paths take it.

    segment_ids_BxT: int32; tokens attend causally to earlier tokens with the same id;
      a negative id marks a padding slot (see the module docstring).
    """

    segment_ids_BxT: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixSegmentMask:
    """The mask of T new tokens after a prefix of P tokens, as the kernel paths take it.

    New token t attends to prefix slot j when both carry the same id, and to new slot
    s <= t likewise (the prefix comes before every new token). Ids as in `SegmentMask`.

    segment_ids_BxT: int32 ids of the new tokens.
    prefix_segment_ids_BxP: int32 ids of the prefix's slots.
    """

    segment_ids_BxT: jax.Array
    prefix_segment_ids_BxP: jax.Array


def segment_ids_from_mask(mask_BxT: jax.Array) -> jax.Array:
    """Segment ids of one sequence per row: 0 on real tokens (mask True), -1 on padding."""
    return jnp.where(jnp.asarray(mask_BxT, bool), 0, -1).astype(jnp.int32)


def _isolate_padding(segment_ids_BxT: jax.Array) -> jax.Array:
    """Give every padding slot (negative id) an id of its own, -1 - t."""
    seg = jnp.asarray(segment_ids_BxT, jnp.int32)
    own = -1 - jnp.arange(seg.shape[1], dtype=jnp.int32)
    return jnp.where(seg >= 0, seg, own[None, :])


def padded_length(t: int) -> int:
    """The length splash runs a sequence of ``t`` positions at: ``t`` padded up to a
    multiple of 128 while that is at most 1024 (one block), else to a multiple of 512."""
    tp = -(-t // _LANES) * _LANES
    return tp if tp <= _WHOLE_MAX else -(-t // _LONG_BLOCK) * _LONG_BLOCK


def splash_block(t: int) -> int:
    """The splash block size for a padded length ``t`` (a multiple of 128): the whole
    length up to 1024, else the largest of 512, 256, 128 that divides it."""
    if t <= _WHOLE_MAX:
        return t
    return next(b for b in (_LONG_BLOCK, 256, _LANES) if t % b == 0)


def splash_blocks(t: int, prefix: int = 0) -> tuple[int, int]:
    """``(block_q, block_kv)`` of a program's splash kernel for ``t`` query positions
    after a prefix of ``prefix`` keys (0: a full causal forward): what the program runs."""
    tp = padded_length(t)
    return splash_block(tp), splash_block(tp + (padded_length(prefix) if prefix else 0))


def _splash_kernel(num_heads: int, tq: int, tkv: int, interpret: bool,
                   ) -> splash.SplashAttentionKernel:
    # The kernel holds the block structure of the causal mask (numpy, cached by splash per
    # shape) as arrays made inside the caller's trace: so it is built per call, never kept
    # across traces (a kept one leaks tracers). Segment ids are runtime inputs. GQA is
    # native: query head i reads kv head i // (num_heads / num_kv_heads). With tkv > tq the
    # queries are the last tq of the tkv positions (a prefix of tkv - tq keys before them).
    bq, bkv = splash_block(tq), splash_block(tkv)
    sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                              block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                              use_fused_bwd_kernel=True)
    causal = splash_mask.CausalMask((tq, tkv), offset=tkv - tq)
    mask = splash_mask.MultiHeadMask([causal] * num_heads)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def _on_mesh(fn, q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, q_seg_BxT, kv_seg_BxS):
    """Run `fn` per device under `shard_map` when a mesh is set (`jax.set_mesh`).

    A Pallas kernel is a custom call that GSPMD cannot split: without this every chip would
    gather the whole batch. Batch goes over its logical axes; heads over "tensor" where
    the kv heads divide it (query heads then follow their kv head), else replicated.
    """
    args = (q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, q_seg_BxT, kv_seg_BxS)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*args)
    batch = fitted_spec(("batch",), q_seg_BxT.shape[:1], mesh)[0]
    heads = fitted_spec(("kv_heads",), k_BxKxSxH.shape[1:2], mesh)[0]
    qkv = PartitionSpec(batch, heads, None, None)
    seg = PartitionSpec(batch, None)
    return jax.shard_map(fn, in_specs=(qkv, qkv, qkv, seg, seg), out_specs=qkv,
                         check_vma=False)(*args)


def pad_axis(x, axis, t_to, value=0):
    """``x`` padded with ``value`` at the end of ``axis`` to ``t_to`` entries."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, t_to - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def splash_attend(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                  segment_ids_BxT: jax.Array, *, interpret: bool | None = None,
                  scale: float | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(H) + causal segment mask) v with JAX's Pallas splash kernel.

    Same math as `attend` on rows that are not padding (Vaswani et al. 2017 eq. (1), GQA
    with G = N / K). Forward and backward are the kernel's own (fused backward). T is
    padded (`padded_length`) with isolated padding slots, then cut back.
    interpret: run the kernel in Pallas interpret mode (plain XLA ops; slow, any backend);
    None means interpret unless the program is traced for TPU (the mesh's devices, else the
    default backend). scale: what q is multiplied by (None: 1 / sqrt(H) in q's dtype; 1.0
    for queries scaled already, as `Attention.qkv` returns them). Returns `[B, T, N, H]`
    in q's dtype.
    """
    t = q_BxTxNxH.shape[1]
    tp = padded_length(t)
    seg = _isolate_padding(pad_axis(jnp.asarray(segment_ids_BxT, jnp.int32), 1, tp, -1))
    return _splash_run(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, seg, seg, interpret, scale)


def splash_attend_prefix(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                         segment_ids_BxT: jax.Array, prefix_segment_ids_BxP: jax.Array, *,
                         interpret: bool | None = None, scale: float | None = None,
                         ) -> jax.Array:
    """`splash_attend` for T new queries against a prefix of P keys and the T new keys.

    k/v hold S = P + T positions: the prefix (e.g. a shared prompt's keys) first, then the
    new tokens'; the mask is `PrefixSegmentMask`'s (padding isolated as in `splash_attend`).
    The prefix and T are each padded (`padded_length`); ``scale`` as in `splash_attend`.
    Returns `[B, T, N, H]` in q's dtype.
    """
    t, p = q_BxTxNxH.shape[1], prefix_segment_ids_BxP.shape[1]
    if k_BxSxKxH.shape[1] != p + t:
        raise ValueError(f"splash_attend_prefix: keys hold {k_BxSxKxH.shape[1]} positions; "
                         f"expected prefix {p} + new {t}")
    tp, pp = padded_length(t), padded_length(p)
    seg_kv = jnp.concatenate(
        [pad_axis(jnp.asarray(prefix_segment_ids_BxP, jnp.int32), 1, pp, -1),
         pad_axis(jnp.asarray(segment_ids_BxT, jnp.int32), 1, tp, -1)], axis=1)
    seg_kv = _isolate_padding(seg_kv)
    k, v = (jnp.concatenate([pad_axis(x[:, :p], 1, pp), pad_axis(x[:, p:], 1, tp)], axis=1)
            for x in (k_BxSxKxH, v_BxSxKxH))
    return _splash_run(q_BxTxNxH, k, v, seg_kv[:, pp:], seg_kv, interpret, scale)


def _splash_run(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_seg_BxTp, kv_seg_BxS, interpret, scale):
    """The kernel on q padded to `q_seg`'s length and k/v padded to `kv_seg`'s (the queries
    are the last of the kv positions); `[B, T, N, H]` cut back to q's T."""
    b, t, n, h = q_BxTxNxH.shape
    tp, s = q_seg_BxTp.shape[1], kv_seg_BxS.shape[1]
    if interpret is None:
        interpret = not _traced_for_tpu()
    q = pad_axis(scale_queries(q_BxTxNxH, scale).transpose(0, 2, 1, 3), 2, tp)  # splash does not scale
    k, v = (pad_axis(x.transpose(0, 2, 1, 3), 2, s) for x in (k_BxSxKxH, v_BxSxKxH))

    def per_device(q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, q_seg, kv_seg):
        kernel = _splash_kernel(q_BxNxTxH.shape[1], tp, s, bool(interpret))
        one = lambda qq, kk, vv, qs, ks: kernel(qq, kk, vv, segment_ids=splash.SegmentIds(qs, ks))
        return jax.vmap(one)(q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, q_seg, kv_seg)

    o_BxNxTxH = _on_mesh(per_device, q, k, v, q_seg_BxTp, kv_seg_BxS)
    return o_BxNxTxH[:, :, :t].transpose(0, 2, 1, 3)


def scale_queries(q: jax.Array, scale: float | None) -> jax.Array:
    """``q * scale`` in q's dtype (``None``: 1 / sqrt(H)); ``q`` itself for scale 1.0
    (queries already scaled in float32, as `rljax.models.attention.Attention.qkv`
    returns them)."""
    return q if scale == 1.0 else q * jnp.asarray(
        q.shape[-1] ** -0.5 if scale is None else scale, q.dtype)


def cudnn_attend(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                 segment_ids_BxT: jax.Array, scale: float | None = None) -> jax.Array:
    """The same attention with cuDNN flash attention (`jax.nn.dot_product_attention`).

    GPU only, float16 / bfloat16 inputs; GQA is native. cuDNN's sequence-length arguments
    describe right padding only, so the segment mask goes in as a boolean `[B, 1, T, T]`
    mask (cuDNN turns it into a bias shared by all heads: T^2 per sequence, not N T^2)
    with `is_causal=True`; ``scale`` as in `splash_attend`. Returns `[B, T, N, H]`.
    """
    if jax.default_backend() != "gpu":
        raise ValueError(
            f"ModelConfig.attention='cudnn' needs a GPU backend; this one is "
            f"{jax.default_backend()!r}. Use attention='xla' (CPU) or 'splash' (TPU)."
        )
    seg = _isolate_padding(segment_ids_BxT)
    allowed_Bx1xTxT = (seg[:, :, None] == seg[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
                                        mask=allowed_Bx1xTxT, is_causal=True, scale=scale,
                                        implementation="cudnn")


def kernel_attend(implementation: str, q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array,
                  v_BxTxKxH: jax.Array, segment_ids_BxT: jax.Array,
                  scale: float | None = None) -> jax.Array:
    """`splash_attend` or `cudnn_attend`, by `ModelConfig.attention`."""
    if implementation == "splash":
        return splash_attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, scale=scale)
    if implementation == "cudnn":
        return cudnn_attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, scale)
    raise ValueError(f"kernel_attend: implementation={implementation!r}; allowed: "
                     "'splash', 'cudnn'")


def kernel_attend_prefix(implementation: str, q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array,
                         v_BxSxKxH: jax.Array, mask: PrefixSegmentMask,
                         scale: float | None = None) -> jax.Array:
    """`splash_attend_prefix` by `ModelConfig.attention` (only 'splash' has one here)."""
    if implementation == "splash":
        return splash_attend_prefix(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask.segment_ids_BxT,
                                    mask.prefix_segment_ids_BxP, scale=scale)
    raise ValueError(f"kernel_attend_prefix: implementation={implementation!r}; allowed: "
                     "'splash' (a cuDNN prefix path is not built; use 'xla')")
