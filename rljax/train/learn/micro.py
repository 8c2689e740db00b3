"""Micro-batch layout: how a batch splits into accumulation micro-batches and back.

Micro-batch i holds rows i, i+M, i+2M, ... (or whole groups of G consecutive rows, when
the forwards share each group's prompt), so every micro-batch stays spread across the
devices a batch-sharded array lives on (contiguous blocks would put a small micro-batch on
a single device). Their metric pairs combine with :func:`combine_metrics`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

Array = Any


def loss_mask(mb: dict) -> Array:
    """A learning batch's per-token loss mask: ``loss_mask_BxT`` (the tokens the model
    chose; 0 on a tool's output), or ``completion_mask_BxT`` where the batch has none."""
    return mb["loss_mask_BxT"] if "loss_mask_BxT" in mb else mb["completion_mask_BxT"]


def split_micro(x_BxN: Array, num_micro: int, group: int = 1) -> Array:
    """``[B, ...] -> [M, B/M, ...]`` with micro-batch i = rows i, i+M, i+2M, ...; with
    ``group`` G > 1, whole groups of G consecutive rows: groups i, i+M, i+2M, ...
    """
    b, rest = x_BxN.shape[0], x_BxN.shape[1:]
    x = x_BxN.reshape(b // (num_micro * group), num_micro, group, *rest).swapaxes(0, 1)
    return x.reshape(num_micro, b // num_micro, *rest)


def merge_micro(x_MxNx: Array, group: int = 1) -> Array:
    """The inverse of :func:`split_micro`: ``[M, B/M, ...] -> [B, ...]`` in row order."""
    m, n, rest = x_MxNx.shape[0], x_MxNx.shape[1], x_MxNx.shape[2:]
    x = x_MxNx.reshape(m, n // group, group, *rest).swapaxes(0, 1)
    return x.reshape(m * n, *rest)


def num_micro_batches(batch_size: int, micro_batch_size: int, what: str = "batch") -> int:
    """Micro-batches per update (``micro_batch_size`` 0 means one); validates division."""
    if micro_batch_size == 0 or micro_batch_size >= batch_size:
        return 1
    if batch_size % micro_batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} does not divide the {what} of "
            f"{batch_size} sequences; allowed: a divisor of {batch_size} or 0 (no split)"
        )
    return batch_size // micro_batch_size


def extreme(name: str) -> bool:
    """Whether loss metric ``name`` is an extreme (``*_max`` / ``*_min``): its pair is
    ``(value, count)``, combined over micro-batches by max / min and never divided."""
    return name.endswith(("_max", "_min"))


def combine_metrics(a: dict, b: dict) -> dict:
    """Two micro-batches' metric pairs as one: sums and counts add; an extreme's value
    is the max / min of the two (:func:`extreme`)."""
    out = {}
    for k, (s, c) in a.items():
        s2, c2 = b[k]
        pick = jnp.maximum if k.endswith("_max") else jnp.minimum
        out[k] = (pick(s, s2) if extreme(k) else s + s2, c + c2)
    return out
