"""``generate``: the public entry point of the sampler (validation + packing + run)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.typing import ArrayLike

from rljax.models import Decoder, ModelConfig

from rljax.sampling.ops import SamplingParams
from rljax.sampling.prompts import PackedPrompts, pack_prompts
from rljax.sampling.result import SampleResult
from rljax.sampling.sampler import DecodeSpec, plan_phases, run

__all__ = ["config_of", "generate", "prepare"]


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


def _stop_ids(stop_ids, vocab_size) -> tuple[int, ...]:
    if isinstance(stop_ids, int):
        stop_ids = (stop_ids,)
    if not isinstance(stop_ids, Iterable):
        raise ValueError(f"stop_ids must be an iterable of token ids, got {stop_ids!r}")
    out = tuple(sorted({int(t) for t in stop_ids}))
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_ids {bad} are outside the vocabulary [0, {vocab_size})")
    return out


def _split(model: Decoder | tuple[nnx.GraphDef, nnx.State],
           ) -> tuple[nnx.GraphDef, nnx.State, ModelConfig]:
    """(graphdef, state, config) from a Decoder or a (graphdef, state) pair."""
    if isinstance(model, tuple) and len(model) == 2:
        graphdef, state = model
        return graphdef, state, config_of(graphdef, state)
    if not hasattr(model, "forward_cached") or not hasattr(model, "config"):
        raise TypeError(
            "model must be an rljax.models.Decoder or a (graphdef, state) pair from "
            f"nnx.split(decoder), got {type(model).__name__}"
        )
    graphdef, state = nnx.split(model)
    return graphdef, state, model.config


def config_of(graphdef: nnx.GraphDef, state: nnx.State) -> ModelConfig:
    """The ``ModelConfig`` of a split decoder, read from the merged module (a few ms for
    a deep unscanned model: small beside the sampling call it prepares)."""
    return nnx.merge(graphdef, state).config


def generate(
    model: Decoder | tuple[nnx.GraphDef, nnx.State],
    prompts: Sequence[Sequence[int]] | ArrayLike,
    *,
    key: jax.Array,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Iterable[int] = (),
    num_samples: int = 1,
    prompt_mask: ArrayLike | None = None,
    max_len: int | None = None,
    length_multiple: int = 16,
    pad_id: int = 0,
    mesh: Mesh | None = None,
    decode_phases: int = 4,
) -> SampleResult:
    """Sample ``num_samples`` completions of each prompt with a KV cache, in two jitted calls.

    Args:
      model: an ``rljax.models.Decoder``, or ``(graphdef, state)`` from ``nnx.split`` (the
        trainer passes the current policy state; it is not copied).
      prompts: a non-empty list of token-id lists, or an int ``[B, T]`` array (with
        ``prompt_mask``, True on real tokens, when it is padded).
      key: a PRNG key; the draws depend only on it and the inputs (not on the mesh).
      max_new_tokens: ``N >= 1``, completion tokens per row (the stop token included).
      temperature, top_k, top_p: see :class:`rljax.sampling.SamplingParams`;
        ``temperature=0`` is greedy.
      stop_ids: token ids that end a completion (kept in it, masked after it).
      num_samples: ``G >= 1`` completions per prompt; each prompt is prefilled once.
      max_len: cache slots; default ``P + N - 1`` where ``P`` is the bucketed prompt
        length. Prompts longer than ``max_len - N + 1`` are an error.
      length_multiple: prompts are left-padded to a multiple of this, so calls with
        prompts in the same bucket (and the same B, G, N, settings) reuse the compiled
        programs.
      pad_id: the token written in padding (prompt and after the stop).
      mesh: the mesh to shard rows over; default: the mesh the state lives on, if any.
      decode_phases: decode in up to this many loops of at least 16 steps, each with a
        cache just long enough for it (attention cost follows the filled slots); the
        results do not depend on it.

    Returns:
      A :class:`rljax.sampling.SampleResult` with ``R = B * G`` rows (prompt-major).
    """
    graphdef, state, config = _split(model)
    batch, spec = prepare(
        config, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, stop_ids=stop_ids, num_samples=num_samples, prompt_mask=prompt_mask,
        max_len=max_len, length_multiple=length_multiple, pad_id=pad_id,
        decode_phases=decode_phases)
    return run(graphdef, state, batch, spec, key, mesh, config)


def prepare(config: ModelConfig, prompts, *, max_new_tokens: int, temperature: float = 1.0,
            top_k: int | None = None, top_p: float | None = None,
            stop_ids: Iterable[int] = (), num_samples: int = 1, prompt_mask=None,
            max_len: int | None = None, length_multiple: int = 16, pad_id: int = 0,
            decode_phases: int = 4) -> tuple[PackedPrompts, DecodeSpec]:
    """:func:`generate`'s checks and host packing: ``(packed prompts, DecodeSpec)`` for
    ``rljax.sampling.sampler.sample_arrays`` (the same arguments and errors as
    :func:`generate`, less the model and key)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    n = _positive_int("max_new_tokens", max_new_tokens)
    g = _positive_int("num_samples", num_samples)
    phases = _positive_int("decode_phases", decode_phases)
    mult = _positive_int("length_multiple", length_multiple)
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or not 0 <= pad_id < config.vocab_size:
        raise ValueError(f"pad_id must be a token id in [0, {config.vocab_size}), got {pad_id!r}")
    stops = _stop_ids(stop_ids, config.vocab_size)
    room = config.max_position_embeddings - n
    if max_len is not None:
        room = min(room, _positive_int("max_len", max_len) - n + 1)
    if room < 1:
        raise ValueError(
            f"max_new_tokens={n} leaves no room for a prompt (max_len={max_len}, "
            f"max_position_embeddings={config.max_position_embeddings})"
        )
    batch = pack_prompts(
        prompts, vocab_size=config.vocab_size, length_multiple=mult,
        max_prompt_len=room, prompt_mask=prompt_mask, pad_id=pad_id,
    )
    p = batch.tokens_BxP.shape[1]
    cache_len = max(p + n - 1, p) if max_len is None else max_len
    return batch, DecodeSpec(params, stops, g, n, plan_phases(p, n, cache_len, phases), pad_id)
