"""Building blocks: annotated float32 parameters, RMSNorm, rotary embeddings, the dense
matmul, SwiGLU MLP."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from rljax.models.config import ModelConfig
from rljax.models.lora import adapter_arrays, lora_delta, make_pairs
from rljax.sharding import constrain_logical

INIT_STD = 0.02


def annotated_param(value: ArrayLike, names: Sequence[str | None]) -> nnx.Param:
    """A float32 `nnx.Param` carrying its logical axis names as `logical_axes` metadata.

    The names are turned into mesh axes by `rljax.sharding.LOGICAL_RULES` (see
    `rljax.sharding.state_shardings`). Flax's own eager sharding is turned off so the
    same code builds a model with or without a mesh.
    """
    names = tuple(names)
    if len(names) != value.ndim:
        raise ValueError(f"logical names {names} do not match parameter shape {value.shape}")
    value = constrain_logical(jnp.asarray(value, jnp.float32), names)
    return nnx.Param(value, eager_sharding=False, logical_axes=names)


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], names: Sequence[str | None],
                 ) -> nnx.Param:
    """N(0, 0.02^2) initialised float32 parameter (the HF initializer_range default).

    The barrier keeps XLA from fusing the scaling into the draw when the model is built
    inside ``jax.jit``, so a jitted build gives bit-identical weights to an eager one.
    """
    draw = jax.lax.optimization_barrier(jax.random.normal(rngs.params(), shape, jnp.float32))
    return annotated_param(INIT_STD * draw, names)


def compute_dtype(config: ModelConfig) -> DTypeLike:
    """The jnp dtype matmul inputs are cast to."""
    return jnp.bfloat16 if config.compute_dtype == "bfloat16" else jnp.float32


def matmul_precision(dtype: DTypeLike) -> jax.lax.Precision:
    """The matmul precision of a dtype path, set explicitly: float32 operands (the parity
    path) at HIGHEST, so a TPU runs them in float32 instead of its default bf16 passes;
    bfloat16 operands (the compute path) at DEFAULT, one bf16 pass with float32
    accumulation (what they hold already)."""
    return (jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32
            else jax.lax.Precision.DEFAULT)


# The decoder's parameters that every forward casts to the compute dtype right before its
# matmul (attention q / k / v / o, MLP gate / up / down, an untied lm_head). Norm scales,
# biases and the embedding table (looked up in float32) are used as stored.
MATMUL_WEIGHTS = frozenset({"q", "k", "v", "o", "gate", "up", "down", "lm_head"})


def cast_matmul_weights(state, dtype: DTypeLike):
    """A decoder's ``nnx.State`` with its `MATMUL_WEIGHTS` in ``dtype`` (others as they are).

    With ``dtype`` the config's compute dtype the model computes exactly what it computes
    from ``state`` (each forward casts those weights to it anyway), from a copy of that
    dtype's size: the sampler's inference copy. Sharding is kept; float32 returns ``state``.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return state

    def cast(path, x):
        names = [getattr(k, "key", None) for k in path]
        hit = any(n in MATMUL_WEIGHTS for n in names[-2:]) and x.dtype != dtype
        return x.astype(dtype) if hit else x

    return jax.tree_util.tree_map_with_path(cast, state)


class RMSNorm(nnx.Module):
    """Root-mean-square norm, y = w * x / sqrt(mean(x^2) + eps), computed in float32.

    Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. (4).
    """

    def __init__(self, dim: int, eps: float, names: Sequence[str | None] = ("norm",)) -> None:
        self.scale = annotated_param(jnp.ones((dim,), jnp.float32), names)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return self.scale[...] * (x32 * jax.lax.rsqrt(var + self.eps))


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies theta^(-2i/H), i < H/2, in float32, with Llama 3 scaling.

    Su et al. 2021 (RoFormer) eq. (15); Llama 3 scaling as in Meta's Llama 3.1 reference:
    low frequencies (wavelength > original / low_freq_factor) are divided by `factor`,
    high frequencies (wavelength < original / high_freq_factor) are kept, and in between
    inv_freq = (1 - a) * f / factor + a * f with a = (original / wavelength - low) / (high - low).
    """
    h = config.head_dim
    exponent = np.arange(0, h, 2, dtype=np.float32) / np.float32(h)
    inv = (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponent)).astype(np.float32)
    sc = config.rope_scaling
    if sc is None:
        return inv
    orig = float(sc.original_max_position_embeddings)
    wavelen = 2 * np.pi / inv
    low_wavelen = orig / sc.low_freq_factor
    high_wavelen = orig / sc.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    alpha = (orig / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - alpha) * scaled / sc.factor + alpha * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: ModelConfig, positions_BxT: jax.Array,
                 ) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) tables of shape [B, T, H/2] in float32 for integer positions."""
    angles = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BxTxNxH: jax.Array, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate pairs (x_i, x_{i+H/2}) by the position angle (the HF "rotate_half" layout)."""
    cos, sin = (c[:, :, None, :] for c in cos_sin)
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def dense(x: jax.Array, w: jax.Array, contract: int = 1,
          preferred_element_type: DTypeLike | None = None,
          adapter: tuple | None = None) -> jax.Array:
    """``x``'s last ``contract`` axes times ``w``'s first ``contract`` axes, as one 2-D
    matmul ``[tokens, in] x [in, out]`` with the token axes and the weight's axes flattened
    (free reshapes of row-major arrays; a sharded leading axis stays sharded).

    Written as an einsum over ``[B, T, ...]``, the weight gradient contracts two axes
    (b, t), and XLA lowers such a dot by writing a transposed copy of an operand first:
    on XLA:CPU, the SwiGLU MLP's ``[B, T, F]`` activation gradient (measured: MLP forward +
    backward at 2560 tokens x 256 x 1024, 105 -> 216 GFLOP/s, 37% -> 77% of the float32
    matmul peak). Flattened, each of the three dots (forward, input and weight gradient)
    contracts one axis, the plain GEMM form. Measured on XLA:CPU only; on TPU, merging
    ``B`` and ``T`` is a relayout unless ``T`` fills whole tiles (unmeasured).

    ``adapter``: a LoRA pair ``(A [*in, r], B [r, *out], scale)`` of this weight
    (`rljax.models.lora.adapter_arrays`); its ``scale (x A) B`` is added to the output.
    """
    lead, k = x.shape[:x.ndim - contract], x.shape[x.ndim - contract:]
    if w.shape[:contract] != k:
        raise ValueError(f"dense: x{tuple(x.shape)}'s last {contract} axes do not match "
                         f"w{tuple(w.shape)}'s first {contract}")
    n = int(np.prod(k))
    y = jnp.dot(x.reshape(-1, n), w.reshape(n, -1), precision=matmul_precision(x.dtype),
                preferred_element_type=preferred_element_type)
    if adapter is not None:
        a, b, scale = adapter
        r = a.shape[-1]
        y = y + lora_delta(x.reshape(-1, n), a.reshape(n, r), b.reshape(r, -1), scale,
                           preferred_element_type).astype(y.dtype)
    return y.reshape(*lead, *w.shape[contract:])


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x W_gate) * (x W_up)) (Shazeer 2020, eq. 6)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs,
                 lora_rngs: nnx.Rngs | None = None) -> None:
        """``lora_rngs``: the adapters' key stream (`rljax.models.lora.lora_rngs`), used
        when ``config.lora`` targets an MLP projection."""
        d, f = config.hidden_size, config.intermediate_size
        shapes = {"gate": ((d, f), ("embed", "mlp"), 1), "up": ((d, f), ("embed", "mlp"), 1),
                  "down": ((f, d), ("mlp", "embed"), 1)}
        for name, (shape, names, _) in shapes.items():
            setattr(self, name, normal_param(rngs, shape, names))
        self.dtype = compute_dtype(config)
        make_pairs(self, config.lora, lora_rngs, shapes)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        """Float32 output ``[B, T, D]``."""
        cd = self.dtype
        x = x_BxTxD.astype(cd)
        g = dense(x, self.gate[...].astype(cd), adapter=adapter_arrays(self, "gate", cd))
        u = dense(x, self.up[...].astype(cd), adapter=adapter_arrays(self, "up", cd))
        hidden = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(cd)
        return dense(hidden, self.down[...].astype(cd), preferred_element_type=jnp.float32,
                     adapter=adapter_arrays(self, "down", cd))
