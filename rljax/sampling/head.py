"""The sampler's output projection, vocab-major, and its weight kept across calls.

On XLA:CPU the decode step's output projection runs ~1.5x faster as
``logits_VxR = W_VxD . h^T`` than as ``h . W_DxV`` (see ``ops.sample_tokens_VxR``). A
tied model's embedding is already ``[V, D]``; an untied ``lm_head`` is stored ``[D, V]``,
and transposing it is a copy of the whole matrix (32000 x 256 float32 on the benchmark
model: 8-10 ms alone, up to 33 ms in a profile under load; 0.5-2.5% of a 128-token
``generate`` call). :func:`cached_vocab_major_weight` builds it once per weight array and
reuses it while that array is alive.

On an x86-64 CPU with AVX2 the sampler instead packs the weight once for the
hand-written kernel in :mod:`rljax.kernels.cpu_matmul` (:func:`sampler_head_weight`),
which also returns each row's max logit; :func:`sampler_head` dispatches on the
weight's rank.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp

from rljax.kernels import cpu_matmul
from rljax.models.layers import compute_dtype
from rljax.sampling.ops import SamplingParams, _block_size

__all__ = [
    "cached_vocab_major_weight",
    "sampler_head",
    "sampler_head_weight",
    "vocab_major_head",
    "vocab_major_weight",
]


def _source(config):
    """(attribute holding the output projection, whether it is already [V, D])."""
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:
        return None, False
    return ("embed", True) if tied else ("lm_head", False)


def _to_VxD(w, already_VxD: bool, dtype):
    return (w if already_VxD else w.T).astype(dtype)


_to_VxD_jit = jax.jit(_to_VxD, static_argnums=(1, 2))


def vocab_major_weight(model):
    """The model's output projection as ``W_VxD`` in its compute dtype, or None when the
    model has no ``embed`` / ``lm_head`` (then :func:`vocab_major_head` falls back to
    ``logits_from_hidden``). Inside jit it is traced; outside, computed eagerly."""
    name, already = _source(model.config)
    if name is None or not hasattr(model, name):
        return None
    return _to_VxD(getattr(model, name)[...], already, compute_dtype(model.config))


def vocab_major_head(model, w_VxD=None):
    """``h_RxD -> logits_VxR``: the model's output projection as ``W_VxD . h^T``.

    Same math as ``model.logits_from_hidden`` (tied: the embedding), laid out vocab-major.
    ``w_VxD``: the weight from :func:`cached_vocab_major_weight` (an argument of the
    compiled program) or the kernel's packed weight from :func:`sampler_head_weight`;
    without it the weight is built from ``model`` here (inside jit: once per call,
    outside the decode loop).
    """
    head = sampler_head(model, w_VxD)
    return lambda h_RxD: head(h_RxD)[0]


def sampler_head(model, w=None, params: SamplingParams | None = None):
    """``h_RxD -> (logits_VxR, max_R, block_sums)``: :func:`vocab_major_head` plus what
    the CPU kernel computes with the logits when ``w`` is packed (``[ceil(V/6), D, 6]``):
    each row's max, and for ``params`` that draw from ``softmax(logits / T)`` without
    top-k / top-p, the inverse-CDF draw's block sums (see ``ops.sample_tokens_VxR``).
    With a ``[V, D]`` weight or none: XLA's dot, and None for both."""
    if w is not None and w.ndim == 3:
        vocab = model.config.vocab_size
        if params is None or params.is_greedy or params.filters:
            return lambda h_RxD: cpu_matmul.matmul_NxR(h_RxD, w, vocab) + (None,)
        block, t = _block_size(vocab), params.temperature
        return lambda h_RxD: cpu_matmul.softmax_block_sums(h_RxD, w, vocab, block, t)
    w_VxD = vocab_major_weight(model) if w is None else w
    if w_VxD is None:
        return lambda h_RxD: (model.logits_from_hidden(h_RxD).T, None, None)
    return lambda h_RxD: (jnp.einsum(
        "vd,rd->vr", w_VxD, h_RxD.astype(w_VxD.dtype), preferred_element_type=jnp.float32
    ), None, None)


# (id(source array), packed) -> (weak reference to it, the derived weight). Latest only.
_CACHE: dict[tuple[int, bool], tuple[weakref.ref, jax.Array]] = {}


def _cached(w, packed: bool, build):
    key = (id(w), packed)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is w:
        return hit[1]
    out = build()
    _CACHE.clear()
    _CACHE[key] = (weakref.ref(w, lambda _ref: _CACHE.pop(key, None)), out)
    return out


def cached_vocab_major_weight(state, config):
    """``W_VxD`` for the model state ``state`` (an ``nnx.State``), or None.

    Built once per output-projection array and returned again while that array is alive
    and still the latest one asked for (a training step's new weights replace it; the
    copy is dropped with its source). A tied float32 embedding is returned as it is.
    """
    name, already = _source(config)
    if name is None or name not in state:
        return None
    w = state[name][...]
    dtype = compute_dtype(config)
    if already and w.dtype == dtype:
        return w
    return _cached(w, False, lambda: _to_VxD_jit(w, already, dtype))


def _kernel_applies(w, config) -> bool:
    devices = getattr(w, "devices", lambda: set())()
    return (
        compute_dtype(config) == jnp.float32
        and w.dtype == jnp.float32
        and len(devices) == 1
        and next(iter(devices)).platform == "cpu"
        and cpu_matmul.available()
    )


def sampler_head_weight(state, config):
    """The output weight the sampler passes to :func:`sampler_head`, kept across calls
    like :func:`cached_vocab_major_weight`: packed for :mod:`rljax.kernels.cpu_matmul`
    when the weight is float32 on one CPU device and the kernel is available, else
    ``W_VxD`` (or None)."""
    name, already = _source(config)
    if name is None or name not in state:
        return None
    w = state[name][...]
    if not _kernel_applies(w, config):
        return cached_vocab_major_weight(state, config)
    return _cached(w, True, lambda: _pack_jit(w, already))


@functools.partial(jax.jit, static_argnums=(1,))
def _pack_jit(w, already_VxD: bool):
    return cpu_matmul.pack_weight_NxD(w) if already_VxD else cpu_matmul.pack_weight_DxN(w)
