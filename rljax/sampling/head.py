"""The sampler's output projection, vocab-major, and its weight built once per call.

The decode step computes ``logits_VxR = W_VxD . h^T`` (on XLA:CPU ~1.5x faster than
``h . W_DxV``; see ``ops.sample_tokens_VxR``). A tied model's embedding is already
``[V, D]``; an untied ``lm_head`` is stored ``[D, V]`` and its transpose is a copy of the
whole matrix, so :func:`state_vocab_major_weight` builds it once, outside the sampler's
programs, and they take it as an argument (one copy per sampling call, not per program).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models import Decoder, ModelConfig
from rljax.models.layers import compute_dtype

__all__ = [
    "state_vocab_major_weight",
    "vocab_major_head",
    "vocab_major_weight",
]


def _source(config: ModelConfig) -> tuple[str | None, bool]:
    """(attribute holding the output projection, whether it is already [V, D])."""
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:
        return None, False
    return ("embed", True) if tied else ("lm_head", False)


def _to_VxD(w: jax.Array, already_VxD: bool, dtype: jnp.dtype) -> jax.Array:
    return (w if already_VxD else w.T).astype(dtype)


# One program per (layout, dtype) and weight shape: JAX's cache keys it.
_to_VxD_jit = jax.jit(_to_VxD, static_argnums=(1, 2))


def vocab_major_weight(model: Decoder) -> jax.Array | None:
    """The model's output projection as ``W_VxD`` in its compute dtype, or None when the
    model has no ``embed`` / ``lm_head`` (then :func:`vocab_major_head` falls back to
    ``logits_from_hidden``). Inside jit it is traced; outside, computed eagerly."""
    name, already = _source(model.config)
    if name is None or not hasattr(model, name):
        return None
    return _to_VxD(getattr(model, name)[...], already, compute_dtype(model.config))


def vocab_major_head(model: Decoder, w_VxD: jax.Array | None = None,
                     ) -> Callable[[jax.Array], jax.Array]:
    """``h_RxD -> logits_VxR``: the model's output projection as ``W_VxD . h^T`` (float32).

    Same math as ``model.logits_from_hidden`` (tied: the embedding), laid out vocab-major.
    ``w_VxD``: the weight from :func:`state_vocab_major_weight` (an argument of the
    compiled program); without it the weight is built from ``model`` here (inside jit:
    once per call, outside the decode loop).
    """
    w = vocab_major_weight(model) if w_VxD is None else w_VxD
    if w is None:
        return lambda h_RxD: model.logits_from_hidden(h_RxD).T
    return lambda h_RxD: jnp.einsum(
        "vd,rd->vr", w, h_RxD.astype(w.dtype), preferred_element_type=jnp.float32)


def state_vocab_major_weight(state: nnx.State, config: ModelConfig) -> jax.Array | None:
    """``W_VxD`` for the model state ``state`` (an ``nnx.State``) in the compute dtype of
    ``config``, or None when the model has no output projection.

    A tied embedding already in the compute dtype is returned as it is (no copy); else one
    jitted transpose / cast. The caller builds it once per set of weights (a sampling
    call, a multi-turn rollout) and passes it to every program that decodes with them.
    """
    name, already = _source(config)
    if name is None or name not in state:
        return None
    w = state[name][...]
    dtype = compute_dtype(config)
    if already and w.dtype == dtype:
        return w
    return _to_VxD_jit(w, already, dtype)

