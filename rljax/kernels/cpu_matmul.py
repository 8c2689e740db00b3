"""Small-batch matmuls against pre-packed weights: a hand-written AVX2 kernel for XLA:CPU.

A decode step multiplies R = 32 rows of activations by every weight matrix of the model
and by the output projection. XLA:CPU runs those products at 25-35 GFLOP/s inside the
decode loop (the layers' dots) and ~110-125 GFLOP/s (the 32000-row output projection):
it packs the weight in every call and threads the small ones poorly. ``cpu_matmul.cc``
(next to this file) takes the weight packed once (:func:`pack_weight_NxD`,
:func:`pack_weight_DxN`) in panels of 6 output rows, runs a 6 x 16 FMA tile on the
calling thread plus XLA's intra-op pool, and writes ``y_RxN`` (:func:`matmul_RxN`, a
linear layer) or ``y_NxR`` with its per-row max (:func:`matmul_NxR`, the sampler's
vocab-major head), and optionally the softmax's block sums for the sampler's inverse-CDF
draw (:func:`softmax_block_sums`), taken while the logits are still in cache.

Built on first use (:mod:`rljax.kernels.cpu_build`, whose :func:`available`,
:func:`unavailable_reason` and :func:`set_enabled` are re-exported here); where it is
unavailable callers keep XLA's dot. Float32 only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rljax.kernels.cpu_build import available, set_enabled, unavailable_reason

__all__ = [
    "PANEL",
    "available",
    "matmul_NxR",
    "matmul_RxN",
    "pack_weight_DxN",
    "pack_weight_NxD",
    "set_enabled",
    "softmax_block_sums",
    "unavailable_reason",
]

PANEL = 6  # output rows per packed panel (the kernel's tile height)


def _check_weight(name, w):
    if w.ndim != 2 or w.dtype != jnp.float32:
        raise ValueError(f"{name}: needs a float32 rank-2 weight, got {w.dtype}{tuple(w.shape)}")


def pack_weight_NxD(w_NxD: jax.Array) -> jax.Array:
    """A weight stored ``[N, D]`` (output rows first, like an embedding used as the
    output projection) as the kernel's panels ``[ceil(N/6), D, 6]``, zero rows past N."""
    _check_weight("pack_weight_NxD", w_NxD)
    n, d = w_NxD.shape
    p = -(-n // PANEL)
    return jnp.pad(w_NxD, ((0, p * PANEL - n), (0, 0))).reshape(p, PANEL, d).transpose(0, 2, 1)


def pack_weight_DxN(w_DxN: jax.Array) -> jax.Array:
    """A weight stored ``[D, N]`` (inputs first: ``y = x @ w``) as the kernel's panels
    ``[ceil(N/6), D, 6]``, zero rows past N."""
    _check_weight("pack_weight_DxN", w_DxN)
    d, n = w_DxN.shape
    p = -(-n // PANEL)
    return jnp.pad(w_DxN, ((0, 0), (0, p * PANEL - n))).reshape(d, p, PANEL).transpose(1, 0, 2)


def _check_call(wp, n, h_RxD):
    if not available():
        raise RuntimeError(f"rljax's CPU kernels are unavailable: {unavailable_reason()}")
    if wp.ndim != 3 or wp.shape[2] != PANEL or wp.shape[0] != -(-n // PANEL):
        raise ValueError(f"packed weight {tuple(wp.shape)} is not [ceil({n}/{PANEL}), D, "
                         f"{PANEL}]")
    if h_RxD.ndim != 2 or h_RxD.shape[1] != wp.shape[1]:
        raise ValueError(f"activations {tuple(h_RxD.shape)} are not [R, {wp.shape[1]}]")
    return h_RxD.astype(jnp.float32)


def matmul_RxN(h_RxD: jax.Array, wp: jax.Array, n: int) -> jax.Array:
    """``y_RxN = h_RxD @ W^T`` (float32) with ``wp`` the packed ``W`` (N output rows).
    A CPU custom call: raises RuntimeError unless :func:`available`."""
    h = _check_call(wp, n, h_RxD)
    out = jax.ShapeDtypeStruct((h.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call("rljax_packed_matmul_RxN", out)(wp, h)


def matmul_NxR(h_RxD: jax.Array, wp: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """``(y_NxR, max_R)``: ``y = W . h^T`` laid out output-major, and its max over N per
    row (NaN if any entry is NaN). Raises RuntimeError unless :func:`available`."""
    y, m, _ = softmax_block_sums(h_RxD, wp, n, 0)
    return y, m


def softmax_block_sums(h_RxD: jax.Array, wp: jax.Array, n: int, block: int,
                       temperature: float = 1.0):
    """:func:`matmul_NxR` plus the sums of ``exp((y - max) / temperature)`` over blocks of
    ``block`` consecutive outputs (the last may be shorter): ``(y_NxR, max_R, sums)``,
    sums ``[ceil(n / block), R]`` (``[0, R]`` for ``block=0``). Each block's sum is taken
    relative to the max of the rows in cache at the time, then rescaled: equal to the
    sums of the exps to float32 rounding (``exp`` itself is within 2 ulp of XLA's)."""
    if not isinstance(block, int) or block < 0:
        raise ValueError(f"block must be an int >= 0, got {block!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    h = _check_call(wp, n, h_RxD)
    r = h.shape[0]
    nb = -(-n // block) if block else 0
    out = (jax.ShapeDtypeStruct((n, r), jnp.float32), jax.ShapeDtypeStruct((r,), jnp.float32),
           jax.ShapeDtypeStruct((nb, r), jnp.float32))
    call = jax.ffi.ffi_call("rljax_packed_matmul_NxR", out)
    return call(wp, h, block=np.int64(block), inv_temperature=np.float32(1.0 / temperature))
