"""Causal self-attention through maintained kernels: Pallas TPU splash attention and cuDNN.

Both kernels take the mask the decoder needs — causal, padding on either side, packed
sequences — as *segment ids* plus causality: token t attends to token s iff s <= t and
both carry the same id. Real tokens carry ids >= 0; a negative id marks padding. Each
padding slot is given an id of its own (`-1 - t`), so its query row attends to itself
only: never an empty row (an empty softmax row would be 0/0 = NaN, and a NaN reaches
the gradients even where the row's output is unused), and no real row sees padding.

Neither kernel materialises the [B, N, T, S] scores that `rljax.models.attention.attend`
does; see the README's "Attention implementations" paragraph for when each is used.
"""

from __future__ import annotations

import contextlib
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

# Splash's key blocks must be multiples of the TPU's 128 lanes: sequences are padded up
# to a multiple of 128 (padding slots isolated as above) and the largest of these block
# sizes that divides the padded length is used for every block of the forward and of the
# fused backward kernel.
_LANES = 128
_BLOCKS = (512, 256, 128)
# Set by `tpu_kernels()`: trace the real TPU kernel whatever the default backend.
_FORCE_TPU_KERNEL = False


@contextlib.contextmanager
def tpu_kernels():
    """Within this block `splash_attend(interpret=None)` traces the real TPU kernel even
    when the default backend is not TPU: for compiling TPU programs ahead of time on a CPU
    host (`jax.experimental.topologies`; see experiments/memory_budget.py). Only programs
    first traced inside the block see it (jit caches a trace by its arguments)."""
    global _FORCE_TPU_KERNEL
    before, _FORCE_TPU_KERNEL = _FORCE_TPU_KERNEL, True
    try:
        yield
    finally:
        _FORCE_TPU_KERNEL = before


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentMask:
    """The mask of a full causal forward, as the kernel paths take it.

    segment_ids_BxT: int32; tokens attend causally to earlier tokens with the same id;
      a negative id marks a padding slot (see the module docstring).
    """

    segment_ids_BxT: jax.Array


def segment_ids_from_mask(mask_BxT: jax.Array) -> jax.Array:
    """Segment ids of one sequence per row: 0 on real tokens (mask True), -1 on padding."""
    return jnp.where(jnp.asarray(mask_BxT, bool), 0, -1).astype(jnp.int32)


def _isolate_padding(segment_ids_BxT: jax.Array) -> jax.Array:
    """Give every padding slot (negative id) an id of its own, -1 - t."""
    seg = jnp.asarray(segment_ids_BxT, jnp.int32)
    own = -1 - jnp.arange(seg.shape[1], dtype=jnp.int32)
    return jnp.where(seg >= 0, seg, own[None, :])


def splash_block(t: int) -> int:
    """The splash block size used for a (padded) sequence length t, a multiple of 128."""
    return next(b for b in _BLOCKS if t % b == 0)


def _splash_kernel(num_heads: int, t: int, interpret: bool) -> splash.SplashAttentionKernel:
    # The kernel holds the block structure of the causal mask (numpy, cached by splash per
    # shape) as arrays made inside the caller's trace: so it is built per call, never kept
    # across traces (a kept one leaks tracers). Segment ids are runtime inputs. GQA is
    # native: query head i reads kv head i // (num_heads / num_kv_heads).
    b = splash_block(t)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                              block_kv_dkv=b, block_kv_dkv_compute=b,
                              use_fused_bwd_kernel=True)
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * num_heads)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def _on_mesh(fn, q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, seg_BxT):
    """Run `fn` per device under `shard_map` when a mesh is set (`jax.set_mesh`).

    A Pallas kernel is a custom call that GSPMD cannot split: without this every chip would
    gather the whole batch. Batch goes over its logical axes; heads over "tensor" where
    the kv heads divide it (query heads then follow their kv head), else replicated.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, seg_BxT)
    batch = fitted_spec(("batch",), seg_BxT.shape[:1], mesh)[0]
    heads = fitted_spec(("kv_heads",), k_BxKxTxH.shape[1:2], mesh)[0]
    qkv = PartitionSpec(batch, heads, None, None)
    return jax.shard_map(fn, in_specs=(qkv, qkv, qkv, PartitionSpec(batch, None)),
                         out_specs=qkv, check_vma=False)(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH,
                                                         seg_BxT)


def _pad_time(x, axis, t_to, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, t_to - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def splash_attend(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                  segment_ids_BxT: jax.Array, *, interpret: bool | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(H) + causal segment mask) v with JAX's Pallas splash kernel.

    Same math as `attend` on rows that are not padding (Vaswani et al. 2017 eq. (1), GQA
    with G = N / K). Forward and backward are the kernel's own (fused backward). T is
    padded up to a multiple of 128 with isolated padding slots, then cut back.
    interpret: run the kernel in Pallas interpret mode (plain XLA ops; slow, any backend);
    None means interpret unless the default backend is TPU (or inside `tpu_kernels()`). Returns `[B, T, N, H]` in
    q's dtype.
    """
    b, t, n, h = q_BxTxNxH.shape
    if interpret is None:
        interpret = jax.default_backend() != "tpu" and not _FORCE_TPU_KERNEL
    tp = -(-t // _LANES) * _LANES
    seg = _isolate_padding(_pad_time(jnp.asarray(segment_ids_BxT, jnp.int32), 1, tp, -1))
    q = q_BxTxNxH * jnp.asarray(h**-0.5, q_BxTxNxH.dtype)  # splash does not scale
    q, k, v = (_pad_time(x.transpose(0, 2, 1, 3), 2, tp)
               for x in (q, k_BxTxKxH, v_BxTxKxH))

    def per_device(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, seg_BxT):
        kernel = _splash_kernel(q_BxNxTxH.shape[1], tp, bool(interpret))
        one = lambda qq, kk, vv, ss: kernel(qq, kk, vv, segment_ids=splash.SegmentIds(ss, ss))
        return jax.vmap(one)(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, seg_BxT)

    o_BxNxTxH = _on_mesh(per_device, q, k, v, seg)
    return o_BxNxTxH[:, :, :t].transpose(0, 2, 1, 3)


def cudnn_attend(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                 segment_ids_BxT: jax.Array) -> jax.Array:
    """The same attention with cuDNN flash attention (`jax.nn.dot_product_attention`).

    GPU only, float16 / bfloat16 inputs; GQA is native. cuDNN's sequence-length arguments
    describe right padding only, so the segment mask goes in as a boolean `[B, 1, T, T]`
    mask (cuDNN turns it into a bias shared by all heads: T^2 per sequence, not N T^2)
    with `is_causal=True`. Returns `[B, T, N, H]`.
    """
    if jax.default_backend() != "gpu":
        raise ValueError(
            f"ModelConfig.attention='cudnn' needs a GPU backend; this one is "
            f"{jax.default_backend()!r}. Use attention='xla' (CPU) or 'splash' (TPU)."
        )
    seg = _isolate_padding(segment_ids_BxT)
    allowed_Bx1xTxT = (seg[:, :, None] == seg[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
                                        mask=allowed_Bx1xTxT, is_causal=True,
                                        implementation="cudnn")


def kernel_attend(implementation: str, q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array,
                  v_BxTxKxH: jax.Array, segment_ids_BxT: jax.Array) -> jax.Array:
    """`splash_attend` or `cudnn_attend`, by `ModelConfig.attention`."""
    if implementation == "splash":
        return splash_attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
    if implementation == "cudnn":
        return cudnn_attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
    raise ValueError(f"kernel_attend: implementation={implementation!r}; allowed: "
                     "'splash', 'cudnn'")
