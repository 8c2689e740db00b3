"""The KV cache: a pytree dataclass of per-layer key/value buffers and a valid-slot mask.

Layout (per layer): keys `[B, K, H, S]` and values `[B, K, S, H]` -- the sequence axis
last for keys and second-to-last for values, so both attention dots (q.k over H, p.v over
S) contract without transposing the cache; with `[B, S, K, H]` XLA:CPU spent most of a
decode step on transposes (measured, see docs/design.md). A scanned decoder
(`ModelConfig.scan_layers`) stacks the layers (`KVCache`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.typing import DTypeLike

from rljax.models.attention_kernels import pad_axis
from rljax.sharding import fitted_spec

KEY_AXES = ("batch", "kv_heads", "head_dim", "cache_length")
VALUE_AXES = ("batch", "kv_heads", "cache_length", "head_dim")
VALID_AXES = ("batch", "cache_length")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys, values and the valid-slot mask of a batch of sequences.

    keys: tuple over layers of `[B, K, H, S]` arrays (compute dtype), or one stacked
      `[L, B, K, H, S]` array (scanned decoders).
    values: tuple over layers of `[B, K, S, H]` arrays, or one `[L, B, K, S, H]` array.
    valid_BxS: bool, True where a slot holds a real (non-padding) token.
    """

    keys: tuple | jax.Array
    values: tuple | jax.Array
    valid_BxS: jax.Array

    @property
    def batch_size(self) -> int:
        """B."""
        return self.valid_BxS.shape[0]

    @property
    def max_len(self) -> int:
        """S, the number of slots."""
        return self.valid_BxS.shape[1]


def _per_layer(fn, buffers):
    """`fn` over a tuple of per-layer buffers, or applied once to a stacked array."""
    return tuple(fn(b) for b in buffers) if isinstance(buffers, tuple) else fn(buffers)


def init_kv_cache(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype: DTypeLike, *, stacked: bool = False) -> KVCache:
    """An empty cache (zeros, no valid slots); `stacked`: one `[L, ...]` array each."""
    for name, v in (("batch", batch), ("max_len", max_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"init_cache: {name} must be a positive int, got {v!r}")
    k = jnp.zeros((batch, num_kv_heads, head_dim, max_len), dtype)
    v = jnp.zeros((batch, num_kv_heads, max_len, head_dim), dtype)
    if stacked:
        k, v = jnp.zeros((num_layers, *k.shape), dtype), jnp.zeros((num_layers, *v.shape), dtype)
    else:
        k, v = (k,) * num_layers, (v,) * num_layers
    return KVCache(keys=k, values=v, valid_BxS=jnp.zeros((batch, max_len), bool))


def grow_kv_cache(cache: KVCache, max_len: int) -> KVCache:
    """The same cache with ``max_len`` slots: new slots are empty (zeros, not valid).

    The sampler decodes in phases and grows the cache between them, so each phase
    attends only to a cache about as long as the slots filled so far.
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < cache.max_len:
        raise ValueError(
            f"grow_kv_cache: max_len must be an int >= the current {cache.max_len} slots, "
            f"got {max_len!r}"
        )
    if max_len == cache.max_len:
        return cache
    return KVCache(
        keys=_per_layer(lambda k: pad_axis(k, k.ndim - 1, max_len), cache.keys),
        values=_per_layer(lambda v: pad_axis(v, v.ndim - 2, max_len), cache.values),
        valid_BxS=pad_axis(cache.valid_BxS, 1, max_len),
    )


def kv_cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """NamedShardings for a cache (batch over ("data","fsdp"), kv heads over "tensor")."""

    def sh(x, names):
        names = ("layers", *names) if x.ndim == len(names) + 1 else names  # stacked
        return NamedSharding(mesh, fitted_spec(names, x.shape, mesh))

    return KVCache(
        keys=_per_layer(lambda k: sh(k, KEY_AXES), cache.keys),
        values=_per_layer(lambda v: sh(v, VALUE_AXES), cache.values),
        valid_BxS=sh(cache.valid_BxS, VALID_AXES),
    )
