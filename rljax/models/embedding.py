"""The embedding lookup with a backward pass that needs no table-sized reduction.

Autodiff of ``jnp.take(table_VxD, ids_BxT)`` on a mesh scatters each chip's row
cotangents into a whole ``[V, D]`` table and all-reduces it over the batch axes (Qwen2.5-
0.5B: 519 MiB float32 per micro-batch pass). :func:`lookup`'s backward first moves the
cotangents so that each chip holds every row of its ``data`` shard for its own columns of
the table (the table's hidden dimension is split over ``fsdp``: the transpose of the
forward's all-to-all, activation-sized), then scatters them into its own shard: no
collective but the ``data`` axis's reduction remains. Off a mesh (or inside
``rljax.sharding.logical_constraints(False)``) it is ``jnp.take``'s own backward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from rljax.sharding import BATCH_AXES, constraints_enabled, fitted_spec

TABLE_AXES = ("vocab", "embed")


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _constrain_cotangent(g_BxTxD, ids_BxT, table_VxD):
    """The row cotangents and ids laid out for a local scatter into the table's shard:
    rows over the batch axes that do not split the table's D, D as the table splits it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not constraints_enabled():
        return g_BxTxD, ids_BxT
    d_spec = fitted_spec(TABLE_AXES, table_VxD.shape, mesh)[1]
    rows = tuple(a for a in BATCH_AXES if a in mesh.shape and a not in _axes(d_spec))
    if math.prod(mesh.shape[a] for a in rows) > 1 and g_BxTxD.shape[0] % math.prod(
            mesh.shape[a] for a in rows) == 0:
        r = rows
    else:
        r = None
    g = jax.lax.with_sharding_constraint(g_BxTxD, PartitionSpec(r, None, d_spec))
    ids = jax.lax.with_sharding_constraint(ids_BxT, PartitionSpec(r, None))
    return g, ids


@jax.custom_vjp
def lookup(table_VxD: jax.Array, ids_BxT: jax.Array) -> jax.Array:
    """``table_VxD[ids_BxT]``: rows ``[B, T, D]`` (see the module docstring)."""
    return jnp.take(table_VxD, ids_BxT, axis=0)


def _lookup_fwd(table_VxD, ids_BxT):
    return lookup(table_VxD, ids_BxT), (table_VxD, ids_BxT)


def _lookup_bwd(res, g_BxTxD):
    table_VxD, ids_BxT = res
    g, ids = _constrain_cotangent(g_BxTxD.astype(table_VxD.dtype), ids_BxT, table_VxD)
    d_table = jnp.zeros_like(table_VxD).at[ids].add(g)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and constraints_enabled():
        d_table = jax.lax.with_sharding_constraint(
            d_table, fitted_spec(TABLE_AXES, table_VxD.shape, mesh))
    return d_table, None


lookup.defvjp(_lookup_fwd, _lookup_bwd)
