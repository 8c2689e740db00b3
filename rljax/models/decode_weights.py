"""A block's weights laid out once per sampler call for its decode loop.

A decode step multiplies a few rows of activations (R = batch x group) by every weight of
every block. Two layouts make that cheaper than the parameters as stored, and both are
built once per ``generate`` call, outside the loop (:meth:`Decoder.decode_weights`):

- q, k and v as one ``[D, K, G + 2, H]`` weight (``Attention.fused_qkv``): one dot per
  block instead of three.
- ``packed=True``: every weight packed for :mod:`rljax.kernels.cpu_matmul` (float32 on an
  x86-64 CPU with AVX2), whose small-batch matmul runs the decode step's dots several
  times faster than XLA:CPU's (measured in ``experiments/bench_sampler.py``). The gate
  and up projections become one ``[D, 2F]`` weight.

The results equal the plain forward's to float32 rounding (each output is the same sum
over D, in another order).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.kernels import cpu_matmul

__all__ = ["DecodeWeights", "packed_linear"]


class DecodeWeights(NamedTuple):
    """One block's decode-loop weights (a pytree; None where the stored weight is used).

    qkv: ``(w, bias)``: w ``[D, K, G + 2, H]``, or packed ``[P, D, 6]`` for the kernel
      (then its output is ``[.., K * (G + 2) * H]``); bias ``[K, G + 2, H]`` or None.
    o: the attention output weight ``[N * H, D]`` packed, or None.
    gate_up: ``concat(gate, up)`` ``[D, 2F]`` packed, or None.
    down: ``[F, D]`` packed, or None.
    """

    qkv: tuple
    o: jax.Array | None = None
    gate_up: jax.Array | None = None
    down: jax.Array | None = None

    @property
    def packed(self) -> bool:
        """True when the weights are packed for :mod:`rljax.kernels.cpu_matmul`."""
        return self.o is not None


def build_decode_weights(block, packed: bool) -> DecodeWeights:
    """``block``'s :class:`DecodeWeights` (``packed`` needs float32 weights)."""
    w, bias = block.attn.fused_qkv()
    if not packed:
        return DecodeWeights((w, bias))
    d = w.shape[0]
    o = block.attn.o[...]
    return DecodeWeights(
        qkv=(cpu_matmul.pack_weight_DxN(w.reshape(d, -1)), bias),
        o=cpu_matmul.pack_weight_DxN(o.reshape(-1, o.shape[-1])),
        gate_up=cpu_matmul.pack_weight_DxN(
            jnp.concatenate([block.mlp.gate[...], block.mlp.up[...]], axis=1)),
        down=cpu_matmul.pack_weight_DxN(block.mlp.down[...]),
    )


def packed_linear(x_xD: jax.Array, wp: jax.Array, n: int) -> jax.Array:
    """``x_xD @ W`` for a weight packed by ``cpu_matmul.pack_weight_DxN`` with ``n``
    outputs: float32 ``[..., n]`` (leading axes flattened into the kernel's rows)."""
    lead = x_xD.shape[:-1]
    y = cpu_matmul.matmul_RxN(x_xD.reshape(-1, x_xD.shape[-1]), wp, n)
    return y.reshape(lead + (n,))
