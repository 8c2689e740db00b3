"""Value / reward model: the decoder backbone with a scalar head, `value_BxT`."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.typing import ArrayLike, DTypeLike

from rljax.models.config import ModelConfig
from rljax.models.decoder import Decoder
from rljax.models.hf_io import from_pretrained
from rljax.models.layers import annotated_param
from rljax.models.lora import merged_weight


def _start_weight(src_flat: dict, path: tuple, lora) -> jax.Array:
    """A fresh copy of the policy's weight at ``path`` as its forward uses it: with an
    adapter pair beside it (``<name>_lora``), ``W + scale A B`` in ``W``'s dtype."""
    w = src_flat[path].get_value()
    pair = (*path[:-1], f"{path[-1]}_lora")
    if lora is None or (*pair, "a") not in src_flat:
        return jnp.copy(w)
    a, b = (src_flat[(*pair, n)].get_value() for n in ("a", "b"))
    return merged_weight(w, a, b, lora.scale).astype(w.dtype)


class ValueModel(nnx.Module):
    """Scalar head on the decoder's final hidden states: v_t = h_t . w + b (float32).

    Used as PPO's value function V(s_t) (Schulman et al. 2017) and as a learned reward
    model (score at the last real token). The backbone has no output projection (its
    config is the policy's with `tie_word_embeddings=True`, so the only vocab-sized
    parameter is the input embedding). `config` is the policy config it was built from.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"ValueModel: config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.backbone = Decoder(dataclasses.replace(config, tie_word_embeddings=True), rngs=rngs)
        d = config.hidden_size
        w = jax.random.normal(rngs.params(), (d,), jnp.float32) / jnp.sqrt(d)
        self.head = annotated_param(w, ("embed",))
        self.head_bias = annotated_param(jnp.zeros(()), ())

    def hidden_states(self, input_ids_BxT: ArrayLike, positions_BxT: ArrayLike | None = None,
                      mask_BxT: ArrayLike | None = None, *, remat: bool = False,
                      segment_ids_BxT: ArrayLike | None = None) -> jax.Array:
        """Backbone final-norm hidden states `[B, T, D]` (see `Decoder.hidden_states`)."""
        return self.backbone.hidden_states(input_ids_BxT, positions_BxT, mask_BxT, remat=remat,
                                           segment_ids_BxT=segment_ids_BxT)

    def values_from_hidden(self, h_xD: jax.Array) -> jax.Array:
        """Scalar values `[...]` (float32) from hidden states `[..., D]`."""
        return jnp.einsum("...d,d->...", h_xD.astype(jnp.float32), self.head[...]) + \
            self.head_bias[...]

    def __call__(self, input_ids_BxT: ArrayLike, positions_BxT: ArrayLike | None = None,
                 mask_BxT: ArrayLike | None = None) -> jax.Array:
        """value_BxT, float32."""
        return self.values_from_hidden(self.hidden_states(input_ids_BxT, positions_BxT, mask_BxT))

    @classmethod
    def from_policy(cls, policy: Decoder, *, rngs: nnx.Rngs | None = None) -> ValueModel:
        """A value model whose backbone is a copy of `policy`'s (embedding, layers, norm).

        The head is freshly initialised from `rngs` (default `nnx.Rngs(0)`); the policy's
        output projection is not used. A LoRA policy's critic has no adapters and trains in
        full (its head must train, and an adapter-only critic would freeze it); its
        backbone starts as the policy computes now: each adapted projection's weight is
        ``W + (alpha / r) A B`` in ``W``'s dtype (`rljax.models.lora.merged_weight`; the
        policy's own base is not touched), so after a LoRA warm-up the critic starts from
        the warmed-up policy, as after a full-parameter one.
        """
        if not isinstance(policy, Decoder):
            raise TypeError(f"from_policy: policy must be a Decoder, got {type(policy).__name__}")
        rngs = nnx.Rngs(0) if rngs is None else rngs
        config = dataclasses.replace(policy.config, lora=None)
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        flat = dict(nnx.to_flat_state(state))
        src_flat = dict(nnx.to_flat_state(nnx.state(policy, nnx.Param)))
        for path in flat:
            if path[0] == "backbone":
                flat[path] = flat[path].replace(_start_weight(src_flat, path[1:],
                                                              policy.config.lora))
        d = policy.config.hidden_size
        w = jax.random.normal(rngs.params(), (d,), jnp.float32) / jnp.sqrt(d)
        flat[("head",)] = flat[("head",)].replace(w)
        flat[("head_bias",)] = flat[("head_bias",)].replace(jnp.zeros((), jnp.float32))
        return nnx.merge(graphdef, nnx.from_flat_state(sorted(flat.items())))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: DTypeLike = jnp.float32,
                        mesh: Mesh | None = None, rngs: nnx.Rngs | None = None) -> ValueModel:
        """A value model with the backbone of an HF policy checkpoint (see `from_pretrained`)."""
        return cls.from_policy(from_pretrained(path, dtype=dtype, mesh=mesh), rngs=rngs)
