"""The frozen KL reference: a copy of the policy's parameters, float32 or bfloat16.

With ``RLConfig.ref_dtype="bfloat16"`` every floating leaf of the copy is rounded to
bfloat16 once, when the state is made, and stays bfloat16: in the ``TrainState``, in
checkpoints (saved and restored as bfloat16, so a resumed run is bit-identical) and as an
argument of the learning program. That halves the reference's memory (an 8B model: 16 GB
instead of 32 GB across the slice). Each leaf keeps the policy's sharding.

The reference forward is the policy's program on these weights: matmuls take the model's
``compute_dtype`` (bfloat16 on accelerators; with "float32" each bfloat16 weight is
widened inside its matmul, never stored wide), norms, logits, log-softmax and the
returned log-probs are float32 (``rljax.train.learn.logprobs``). Rounding to bfloat16 moves
each weight by at most 2^-9 of its magnitude (8 significand bits, round to nearest).

The reference is the policy at the start of RL, after any SFT warm-up, in full-parameter
and LoRA runs alike. A policy with LoRA adapters keeps no copy of its base: its reference
is a frozen copy of its adapters as they are when the state is made (a LoRA warm-up's
trained ones; fresh ones, B = 0, compute the base's function), stored in the compute dtype
(what every forward casts them to: the same function from fewer bytes), and inside the
program ``reference_model`` puts them on the policy's own base, read in place. The base is
never merged with adapters, so the adapters a run exports still go on the published base.
The base is stored in the compute dtype too (``lora_base``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.layers import cast_matmul_weights, compute_dtype
from rljax.models.lora import Trainable

__all__ = ["lora_base", "make_reference", "reference_copy", "reference_model"]


@functools.partial(jax.jit, static_argnums=(1,))
def _cast_tree(tree: Any, dtype: str) -> Any:
    """Fresh buffers for every leaf, floating leaves as ``dtype`` (one program)."""
    def one(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        # An explicit copy: jit may hand back an unchanged input as its output, and the
        # policy's buffers are donated by the updates.
        return jnp.copy(x)

    return jax.tree.map(one, tree)


def reference_copy(params: Any, dtype: str = "float32") -> Any:
    """A frozen copy of ``params`` with floating leaves stored as ``dtype``.

    Args:
      params: the policy's parameters (an NNX state of global arrays).
      dtype: "float32" (an exact copy) or "bfloat16" (half the bytes).

    Returns:
      New arrays (never aliases of ``params``: the policy's are donated by updates), each
      with the sharding of the leaf it copies.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"reference_copy: dtype={dtype!r}; allowed: 'float32', 'bfloat16'")
    # An elementwise cast: each output keeps its input's sharding (and, on one device, its
    # committedness, which the learning program's compile cache sees).
    return _cast_tree(params, dtype)


def make_reference(policy_gd, policy_params, dtype: str = "float32", *,
                   trainable: Trainable) -> Any:
    """The frozen KL reference's parameters: the policy as it is now (the start of RL).

    Args:
      policy_gd, policy_params: the policy's graphdef and NNX state (global arrays).
      dtype: a full copy's storage dtype (:func:`reference_copy`, ``RLConfig.ref_dtype``).
      trainable: the policy's filter (``rljax.models.lora.Trainable``): every parameter,
        or its adapters.

    Returns:
      :func:`reference_copy` of ``policy_params``; for a policy that trains its LoRA
      adapters, a copy of its adapters only (new buffers, each leaf's sharding kept),
      stored in the model's compute dtype (``rljax.models.layers.compute_dtype``: the forward casts them to it,
      so the reference computes what the policy computes now, bit for bit).

    Raises:
      ValueError: ``dtype`` other than "float32" for a LoRA policy (its copy's dtype is the
        compute dtype, which the forward reads; rounding the adapters further would make
        the reference another model).
    """
    if not trainable.adapters:
        return reference_copy(policy_params, dtype)
    if dtype != "float32":
        raise ValueError(f"RLConfig.ref_dtype={dtype!r} sets a reference copy's dtype; a LoRA "
                         "policy's reference copies only its adapters, in the compute dtype "
                         "its forward reads (its base is its own, stored in the compute "
                         "dtype): leave ref_dtype='float32'")
    cd = jnp.dtype(compute_dtype(nnx.merge(policy_gd, policy_params).config)).name
    return _cast_tree(trainable.split(policy_params)[0], cd)


def reference_model(policy_gd, policy_params, ref_params,
                    trainable: Trainable) -> tuple[Any, Any]:
    """``(graphdef, params)`` of the KL reference inside a program: ``ref_params`` under
    the policy's graphdef, or, for a policy whose filter ``trainable`` is its adapters,
    the policy's frozen base
    (read in place, never copied) with the reference's adapters (:func:`make_reference`)
    in place of the trained ones."""
    if ref_params is None:
        raise ValueError("reference_model: no reference parameters (make_reference makes "
                         "them; a LoRA policy's are a copy of its adapters)")
    if not trainable.adapters:
        return policy_gd, ref_params
    return policy_gd, Trainable.merge(ref_params, trainable.split(policy_params)[1])


def lora_base(policy_gd, policy_params, trainable: Trainable) -> Any:
    """A LoRA policy's state (``trainable``: its adapters) with its frozen base's matmul
    weights stored in the compute dtype (``rljax.models.layers.cast_matmul_weights``: every
    forward casts them to it anyway, so it computes the same, from half the bytes under
    bfloat16); adapters stay float32. A policy that trains every parameter is returned as
    it is."""
    if not trainable.adapters:
        return policy_params
    config = nnx.merge(policy_gd, policy_params).config
    return cast_matmul_weights(policy_params, compute_dtype(config))
