"""Shared-prompt forwards: a group's prompt through the decoder once, its rows after it.

GRPO-style batches hold G completions of each prompt. A full causal forward over
``concat(prompt, completion)`` computes the prompt's positions G times over, identically
(left-padded prompts; causal attention keeps them from seeing the completions). Here the
N distinct prompts run through every layer once, and the B = N x G completion rows run
against their prompt's keys and values (repeated G times, so the gradients of the G rows
sum into the prompt's positions) followed by their own: the same hidden states, with the
prompt's share of the layer FLOPs divided by G in the forward and in the backward.

Rows are grouped consecutively: rows ``n G .. n G + G - 1`` continue prompt n.

On a mesh whose batch shards outnumber the prompts (4 prompts of 8 rows on 8 chips), each
prompt runs as k copies, one per shard that holds its rows (`prompt_copies`): the
prompt stream is then split evenly like the rows, every chip computes the copy its own
rows read, and no keys or values cross chips.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import math

from jax.sharding import NamedSharding, PartitionSpec

from rljax.models.attention_kernels import PrefixSegmentMask, segment_ids_from_mask
from rljax.models.config import ModelConfig
from rljax.sharding import BATCH_AXES


def completion_positions(prompt_mask_BxP: jax.Array, completion_mask_BxT: jax.Array) -> jax.Array:
    """Positions of the completion slots: those of `default_positions` over the
    concatenated row (``len(prompt) + cumsum(completion mask) - 1``, at least 0)."""
    n_B = jnp.sum(prompt_mask_BxP.astype(jnp.int32), axis=1)
    c = jnp.cumsum(completion_mask_BxT.astype(jnp.int32), axis=1)
    return jnp.maximum(n_B[:, None] + c - 1, 0)


def completion_mask(config: ModelConfig, prompt_mask_BxP: jax.Array,
                    completion_mask_BxT: jax.Array) -> jax.Array | PrefixSegmentMask:
    """The mask of completion queries over prompt + completion keys.

    "xla": booleans `[B, T, P + T]`, the rows of the full forward's causal mask for the
    completion slots (real prompt slots, real completion slots up to the query, and the
    query itself); "splash": a `PrefixSegmentMask` (padding isolated instead: padding rows
    differ, real rows equal). "cudnn" has no prefix kernel here: ValueError.
    """
    pm, cm = prompt_mask_BxP.astype(bool), completion_mask_BxT.astype(bool)
    if config.attention == "splash":
        return PrefixSegmentMask(segment_ids_from_mask(cm), segment_ids_from_mask(pm))
    if config.attention != "xla":
        raise ValueError(f"shared-prompt forward: attention={config.attention!r} has no prefix "
                         "kernel here; allowed: 'xla', 'splash'")
    b, t = cm.shape
    i = jnp.arange(t)
    own = (i[:, None] >= i[None, :])[None] & cm[:, None, :] | (i[:, None] == i[None, :])[None]
    prompt = jnp.broadcast_to(pm[:, None, :], (b, t, pm.shape[1]))
    return jnp.concatenate([prompt, own], axis=2)


def check_groups(prompt_NxP, prompt_mask_NxP, completion_BxT, completion_mask_BxT) -> int:
    """Validate the shapes of a shared-prompt forward; returns the group size G = B / N."""
    n, p = prompt_NxP.shape
    b, t = completion_BxT.shape
    if tuple(prompt_mask_NxP.shape) != (n, p) or tuple(completion_mask_BxT.shape) != (b, t):
        raise ValueError(
            f"shared-prompt forward: masks {tuple(prompt_mask_NxP.shape)} / "
            f"{tuple(completion_mask_BxT.shape)} do not match ids {(n, p)} / {(b, t)}")
    if n < 1 or b % n:
        raise ValueError(f"shared-prompt forward: {b} completion rows do not split into "
                         f"groups over {n} prompts; B must be a multiple of N")
    return b // n


def prompt_copies(num_prompts: int, group: int, mesh=None) -> int:
    """Copies k of each prompt in the prompt stream: 1 without a mesh (``mesh``, else the
    abstract mesh set by ``jax.set_mesh``); on one, the least k dividing ``group`` with
    ``num_prompts * k`` a multiple of the batch shards (data x fsdp), so rows split evenly
    over the shards read only the copies on their own shard; 1 if there is no such k."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty:
        return 1
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)
    k = shards // math.gcd(num_prompts, shards)
    return k if group % k == 0 else 1


def on_batch_shards(x_Cx):
    """`x` constrained to split its leading axis over the batch shards, when a mesh is set
    and the axis divides evenly (the prompt stream after `prompt_copies`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x_Cx
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    if x_Cx.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x_Cx
    spec = PartitionSpec(axes, *([None] * (x_Cx.ndim - 1)))
    return jax.lax.with_sharding_constraint(x_Cx, NamedSharding(mesh, spec))


def repeat_rows(x_Nx, g: int):
    """Each row G times, consecutively: ``[N, ...] -> [N G, ...]`` (its transpose sums).

    A broadcast and a reshape, not ``jnp.repeat`` (a gather): with the rows split over the
    batch shards, copies of a row land on the shard that holds it, so the partitioner
    keeps it local; the gather all-gathered the prompt keys and values over fsdp in every
    layer (docs/pods.md, "Collective audit")."""
    n = x_Nx.shape[0]
    return jnp.broadcast_to(x_Nx[:, None], (n, g, *x_Nx.shape[1:])).reshape(n * g,
                                                                          *x_Nx.shape[1:])


def can_share_prompts(graphdef) -> bool:
    """Whether a split model (``nnx.split``) runs `Decoder.grouped_hidden_states`: a
    `Decoder` whose attention is "xla" or "splash". Read from the graphdef's static
    attributes (no parameters needed); False for anything else."""
    from rljax.models.decoder import Decoder  # grouped.py is imported by decoder.py

    nodes = getattr(graphdef, "nodes", None)
    if not nodes or getattr(nodes[0], "type", None) is not Decoder:
        return False
    for _, attr in getattr(graphdef, "attributes", ()):
        config = getattr(attr, "value", None)
        if isinstance(config, ModelConfig):
            return config.attention in ("xla", "splash")
    return False
