"""Grouped-query self-attention with rotary embeddings, Qwen2 biases and Qwen3 q/k norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.attention_kernels import (PrefixSegmentMask, SegmentMask, kernel_attend,
                                            kernel_attend_prefix, scale_queries)
from rljax.models.config import ModelConfig
from rljax.models.layers import (RMSNorm, annotated_param, apply_rope, compute_dtype, dense,
                                 matmul_precision, normal_param)
from rljax.models.lora import adapter_arrays, make_pairs

_NEG = float(jnp.finfo(jnp.float32).min)


def attend(q_BxTxNxH: jax.Array, k_BxKxHxS: jax.Array, v_BxKxSxH: jax.Array,
           allowed_BxTxS: jax.Array, scale: float | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(H) + mask) v with G = N / K query heads per kv head.

    Vaswani et al. 2017 eq. (1); grouped-query attention, Ainslie et al. 2023. Scores
    and softmax are float32; masked slots get the most negative float32 (not -inf, so a
    row with nothing allowed stays finite). ``scale``: what q is multiplied by (None:
    1 / sqrt(H) in q's dtype; 1.0 for queries scaled already).
    """
    b, t, n, h = q_BxTxNxH.shape
    k = k_BxKxHxS.shape[1]
    prec = matmul_precision(q_BxTxNxH.dtype)
    # Queries moved to [B, K, G, T, H] before both dots: with the batch and kv-head axes
    # leading on every operand XLA:CPU emits one batched dot instead of slow per-batch
    # dots (measured ~40% faster decode on the sampler benchmark model).
    q_BxKxGxTxH = q_BxTxNxH.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    s = jnp.einsum("bkgth,bkhs->bkgts", scale_queries(q_BxKxGxTxH, scale), k_BxKxHxS,
                   preferred_element_type=jnp.float32, precision=prec)
    # The mask as an additive bias (0 or the most negative float32; adding a score to it
    # rounds back to it): XLA:CPU fuses the add into the dot, where a select was a pass.
    s = s + jnp.where(allowed_BxTxS, 0.0, _NEG)[:, None, None]
    # Softmax normalised after the second dot: dividing the [.., T, H] output by the sums
    # is one pass over H values instead of S scores (one fusion fewer per layer and step).
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.einsum("bkgts,bksh->bkgth", e.astype(v_BxKxSxH.dtype), v_BxKxSxH,
                   preferred_element_type=jnp.float32, precision=prec)
    o = o / jnp.sum(e, axis=-1, keepdims=True)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def attend_group_prefix(q_BxTxNxH: jax.Array, prefix_k_CxKxHxP: jax.Array,
                        prefix_v_CxKxPxH: jax.Array, prefix_valid_CxP: jax.Array,
                        k_BxKxHxS: jax.Array, v_BxKxSxH: jax.Array,
                        allowed_BxTxS: jax.Array, scale: float | None = None) -> jax.Array:
    """`attend` over a prefix shared by consecutive rows, then each row's own slots.

    Rows ``c R .. c R + R - 1`` (R = B / C) continue prefix c (a sampled group's prompt):
    its keys and values are read once per prefix, never copied per row. Every query sees
    the prefix's valid slots (queries come after the prefix) and its own slots where
    ``allowed_BxTxS``; one softmax over both. Equals `attend` over the rows' concatenated
    ``prefix + own`` keys up to float32 summation order. ``scale`` as in `attend`.
    """
    b, t, n, h = q_BxTxNxH.shape
    c, k, _, p = prefix_k_CxKxHxP.shape
    g, r = n // k, b // c
    prec = matmul_precision(q_BxTxNxH.dtype)
    q_BxKxGxTxH = scale_queries(q_BxTxNxH, scale).reshape(
        b, t, k, g, h).transpose(0, 2, 3, 1, 4)
    s_own = jnp.einsum("bkgth,bkhs->bkgts", q_BxKxGxTxH, k_BxKxHxS,
                       preferred_element_type=jnp.float32, precision=prec)
    s_own = s_own + jnp.where(allowed_BxTxS, 0.0, _NEG)[:, None, None]
    # The prefix dot batched over (prefix, kv head), its R rows' queries stacked: [C,K,RGT,H].
    q_CxKxQxH = q_BxKxGxTxH.reshape(c, r, k, g * t, h).transpose(0, 2, 1, 3, 4).reshape(
        c, k, r * g * t, h)
    s_pre = jnp.einsum("ckqh,ckhp->ckqp", q_CxKxQxH, prefix_k_CxKxHxP,
                       preferred_element_type=jnp.float32, precision=prec)
    s_pre = s_pre + jnp.where(prefix_valid_CxP, 0.0, _NEG)[:, None, None, :]
    s_pre = s_pre.reshape(c, k, r, g, t, p).transpose(0, 2, 1, 3, 4, 5).reshape(b, k, g, t, p)
    m = jnp.maximum(jnp.max(s_own, axis=-1, keepdims=True), jnp.max(s_pre, axis=-1, keepdims=True))
    e_own, e_pre = jnp.exp(s_own - m), jnp.exp(s_pre - m)
    o = jnp.einsum("bkgts,bksh->bkgth", e_own.astype(v_BxKxSxH.dtype), v_BxKxSxH,
                   preferred_element_type=jnp.float32, precision=prec)
    e_CxKxQxP = e_pre.reshape(c, r, k, g * t, p).transpose(0, 2, 1, 3, 4).reshape(
        c, k, r * g * t, p)
    o_pre = jnp.einsum("ckqp,ckph->ckqh", e_CxKxQxP.astype(prefix_v_CxKxPxH.dtype),
                       prefix_v_CxKxPxH, preferred_element_type=jnp.float32, precision=prec)
    o = o + o_pre.reshape(c, k, r, g, t, h).transpose(0, 2, 1, 3, 4, 5).reshape(b, k, g, t, h)
    o = o / (jnp.sum(e_own, axis=-1, keepdims=True) + jnp.sum(e_pre, axis=-1, keepdims=True))
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


class Attention(nnx.Module):
    """Self-attention block: q/k/v projections, (q/k norm), RoPE, GQA, output projection.

    Weights: q `[D, N, H]`, k and v `[D, K, H]`, o `[N, H, D]`; with ``config.lora`` the
    targeted ones own a `rljax.models.lora.LoraPair` (``q_lora``, ...) drawn from
    ``lora_rngs``.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs,
                 lora_rngs: nnx.Rngs | None = None) -> None:
        d, n, kv, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        shapes = {"q": ((d, n, h), ("embed", "heads", "head_dim"), 1),
                  "k": ((d, kv, h), ("embed", "kv_heads", "head_dim"), 1),
                  "v": ((d, kv, h), ("embed", "kv_heads", "head_dim"), 1),
                  "o": ((n, h, d), ("heads", "head_dim", "embed"), 2)}
        for name, (shape, names, _) in shapes.items():
            setattr(self, name, normal_param(rngs, shape, names))
        make_pairs(self, config.lora, lora_rngs, shapes)
        if config.qkv_bias:
            self.q_bias = annotated_param(jnp.zeros((n, h)), ("heads", "head_dim"))
            self.k_bias = annotated_param(jnp.zeros((kv, h)), ("kv_heads", "head_dim"))
            self.v_bias = annotated_param(jnp.zeros((kv, h)), ("kv_heads", "head_dim"))
        if config.qk_norm:
            self.q_norm = RMSNorm(h, config.rms_norm_eps, names=("head_dim",))
            self.k_norm = RMSNorm(h, config.rms_norm_eps, names=("head_dim",))
        self.qkv_bias = config.qkv_bias
        self.qk_norm = config.qk_norm
        self.attention = config.attention
        self.dtype = compute_dtype(config)

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        y = dense(x, getattr(self, name)[...].astype(self.dtype),
                  preferred_element_type=jnp.float32,
                  adapter=adapter_arrays(self, name, self.dtype))
        if self.qkv_bias:
            y = y + getattr(self, f"{name}_bias")[...]
        return y

    def qkv(self, x_BxTxD: jax.Array, cos_sin: tuple[jax.Array, jax.Array],
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries `[B,T,N,H]` (rotated, scaled by 1 / sqrt(H) in float32), keys and values
        `[B,T,K,H]` (rotated), in the compute dtype."""
        x = x_BxTxD.astype(self.dtype)
        q, k, v = (self._project(x, name) for name in ("q", "k", "v"))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # Scaled by 1 / sqrt(H) in float32, before the cast: 128**-0.5 is not a power of
        # two, and q * scale rounded in bfloat16 adds a second rounding to every query.
        q = (apply_rope(q, cos_sin) * q.shape[-1] ** -0.5).astype(self.dtype)
        k = apply_rope(k, cos_sin).astype(self.dtype)
        return q, k, v.astype(self.dtype)

    def __call__(self, x_BxTxD: jax.Array, cos_sin: tuple[jax.Array, jax.Array],
                 allowed_BxTxS: jax.Array | SegmentMask | PrefixSegmentMask,
                 cache_kv: tuple[jax.Array, jax.Array] | None = None,
                 slot: jax.Array | int | None = None,
                 prefix_kv: tuple[jax.Array, jax.Array] | None = None,
                 group_prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention output `[B,T,D]` (float32) and this layer's (keys, values) buffers.

        Without `cache_kv` the keys/values are the T new ones (S = T). With it, the new
        keys/values are written at slots [slot, slot + T) of the given buffers first.
        With `prefix_kv` (keys `[B,K,H,P]`, values `[B,K,P,H]`, e.g. a shared prompt's)
        they are the prefix followed by the T new ones (S = P + T).
        A `SegmentMask` (causal attention among the T new tokens only: a full forward, or
        a prefill at slot 0) runs `config.attention`'s kernel, a `PrefixSegmentMask` its
        prefix kernel; a boolean `[B,T,S]` mask runs `attend`.
        With `group_prefix` (keys `[C,K,H,P]`, values `[C,K,P,H]`, valid slots `[C,P]`: a
        prefix per group of B / C consecutive rows, e.g. the sampler's prompts) the
        queries attend to their group's prefix, then to the cache (`attend_group_prefix`).
        """
        q, k, v = self.qkv(x_BxTxD, cos_sin)
        k_BxKxHxT = jnp.transpose(k, (0, 2, 3, 1))
        v_BxKxTxH = jnp.transpose(v, (0, 2, 1, 3))
        if prefix_kv is not None:
            pk, pv = prefix_kv
            keys = jnp.concatenate([pk.astype(k.dtype), k_BxKxHxT], axis=3)
            values = jnp.concatenate([pv.astype(v.dtype), v_BxKxTxH], axis=2)
        elif cache_kv is None:
            keys, values = k_BxKxHxT, v_BxKxTxH
        else:
            ck, cv = cache_kv
            keys = jax.lax.dynamic_update_slice(ck, k_BxKxHxT.astype(ck.dtype), (0, 0, 0, slot))
            values = jax.lax.dynamic_update_slice(cv, v_BxKxTxH.astype(cv.dtype), (0, 0, slot, 0))
        if group_prefix is not None:
            o = attend_group_prefix(q, *group_prefix, keys, values, allowed_BxTxS, scale=1.0)
        elif isinstance(allowed_BxTxS, SegmentMask):
            o = kernel_attend(self.attention, q, k, v, allowed_BxTxS.segment_ids_BxT, scale=1.0)
        elif isinstance(allowed_BxTxS, PrefixSegmentMask):
            o = kernel_attend_prefix(self.attention, q, keys.transpose(0, 3, 1, 2),
                                     values.transpose(0, 2, 1, 3), allowed_BxTxS, scale=1.0)
        else:
            o = attend(q, keys, values, allowed_BxTxS, scale=1.0)
        # (n, h) contracted as one flattened axis (`dense`): contracting both made
        # XLA:CPU copy the weight and transpose the activations in every decode step.
        out = dense(o.astype(self.dtype), self.o[...].astype(self.dtype), contract=2,
                    preferred_element_type=jnp.float32,
                    adapter=adapter_arrays(self, "o", self.dtype))
        return out, (keys, values)
