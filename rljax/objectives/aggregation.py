"""Loss aggregation as (sum, count) so that micro-batch accumulation is exact.

The trainer adds `sum` and `count` over micro-batches and divides once; every mode below
is chosen so that this equals aggregating the whole batch at once.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from rljax.objectives._validate import check_choice, check_ndim, check_same_shape

Array = Any

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    values_BxT: Array, mask_BxT: Array, mode: str, *, norm_const: float | None = None
) -> tuple[Array, Array]:
    """Reduce per-token values to (sum, count); the aggregate is sum / count.

    Modes (L_b = number of real tokens of sequence b, S = number of sequences with L_b > 0;
    fully masked rows are padding and count for nothing):
      "token-mean": (sum_b sum_t m x, sum_b L_b). Every token weighs the same (DAPO's
        token-level loss, arXiv:2503.14476 §3.3).
      "seq-mean-token-mean": (sum_b [sum_t m x / L_b], S). Each sequence's mean, then the
        mean over sequences (GRPO as in DeepSeekMath Eq. 3, 1/G sum_i 1/|o_i| sum_t).
      "seq-mean-token-sum": (sum_b sum_t m x, S). Per-sequence sums, mean over sequences.
      "seq-mean-token-sum-norm": (sum_b sum_t m x, norm_const * S). Dr.GRPO
        (arXiv:2503.20783 §3.1) divides by a constant (e.g. the generation budget) instead
        of each sequence's length, removing the length bias. `norm_const` is required:
        defaulting it to the padded width T would make the loss depend on padding.

    Masked positions are selected away with `where`, so junk (even NaN) there is ignored
    and gets exactly zero gradient.
    """
    check_choice("mode", mode, AGGREGATIONS)
    check_ndim("values_BxT", values_BxT, 2, "[B, T]")
    check_same_shape("mask_BxT", mask_BxT, "values_BxT", values_BxT)
    m_BxT = jnp.asarray(mask_BxT, jnp.float32) > 0
    x_BxT = jnp.where(m_BxT, values_BxT, 0.0)
    len_B = m_BxT.sum(axis=1).astype(jnp.float32)
    n_seqs = (len_B > 0).sum().astype(jnp.float32)
    if mode == "token-mean":
        return x_BxT.sum(), len_B.sum()
    if mode == "seq-mean-token-mean":
        return (x_BxT.sum(axis=1) / jnp.maximum(len_B, 1.0)).sum(), n_seqs
    if mode == "seq-mean-token-sum":
        return x_BxT.sum(), n_seqs
    if norm_const is None:
        raise ValueError(
            "norm_const is required for mode='seq-mean-token-sum-norm' (Dr.GRPO's constant, "
            "e.g. the maximum number of generated tokens); got None"
        )
    if isinstance(norm_const, (int, float)) and not norm_const > 0:
        raise ValueError(f"norm_const must be > 0; got {norm_const!r}")
    return x_BxT.sum(), norm_const * n_seqs


def masked_mean_pair(values_BxT: Array, mask_BxT: Array) -> tuple[Array, Array]:
    """(sum over real tokens, number of real tokens): a token-mean metric pair."""
    return aggregate(values_BxT, mask_BxT, "token-mean")
