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
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["reference_copy"]


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
