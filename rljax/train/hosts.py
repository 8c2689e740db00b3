"""The host boundary of an SPMD step: which rows this process owns, and the named
transfers across it (prompt ids in, own rows' token ids out, rewards in, scalars out;
per turn of a multi-turn rollout: the turn's tokens out, the turn flags out, the
observations in).

On a pod every process runs the same programs on global ``jax.Array`` s; a process may
only read the shards it holds. Batch rows are split over the mesh's ("data", "fsdp")
axes. ``rljax.sharding.make_mesh`` lays devices out so that the rows a process holds form
one contiguous block (``rljax.sharding.layout``; on a TPU slice ``jax.make_mesh`` does
not), not necessarily in process order; that block is also the prompts the process reads
and scores.
Host rows cross processes by their global position (``gather_blocks``), never by
assuming an order.
Every function here that moves data runs under ``jax.transfer_guard("allow")``, so a
step can run under ``"disallow_explicit"`` and fail on any other transfer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from rljax.sharding import batch_sharding, logical_sharding, replicated

Array = Any


def _rows_of(index, n: int) -> tuple[int, int]:
    s = index[0] if index else slice(None)
    return (s.start or 0), (n if s.stop is None else s.stop)


def own_rows(n_rows: int, mesh) -> tuple[int, int]:
    """``[lo, hi)``: the block of a batch-sharded ``[n_rows]`` array this process holds.

    One process (or no mesh): all rows. Raises when the rows do not split evenly over
    the ("data", "fsdp") devices or a process's rows are not one block.
    """
    if mesh is None or jax.process_count() == 1:
        return 0, n_rows
    n_dev = mesh.shape["data"] * mesh.shape["fsdp"]
    if n_rows % n_dev:
        raise ValueError(f"{n_rows} batch rows do not split over the data x fsdp = {n_dev} "
                         "devices; on several processes the batch must divide evenly")
    idx = batch_sharding(mesh, 1).addressable_devices_indices_map((n_rows,))
    blocks = sorted({_rows_of(i, n_rows) for i in idx.values()})
    lo, hi = blocks[0][0], blocks[0][0]
    for a, b in blocks:
        if a != hi:
            raise ValueError(f"process {jax.process_index()} holds rows {blocks}, not one "
                             "block: build the mesh with rljax.sharding.make_mesh")
        hi = b
    return lo, hi


def own_groups(n_rows: int, group_size: int, mesh) -> tuple[int, int]:
    """``own_rows`` of a batch of groups of ``group_size`` consecutive rows; raises unless
    this process holds whole groups (it scores and steps whole groups)."""
    lo, hi = own_rows(n_rows, mesh)
    if lo % group_size or hi % group_size:
        raise ValueError(f"process {jax.process_index()} holds rows [{lo}, {hi}), not "
                         f"whole groups of {group_size}: make rows per process a multiple "
                         "of group_size")
    return lo, hi


def to_global(local_N: np.ndarray, n_rows: int, mesh) -> jax.Array:
    """This process's rows ``own_rows(n_rows)`` -> a global batch-sharded array."""
    local_N = np.asarray(local_N)
    with jax.transfer_guard("allow"):
        if mesh is None:
            return jnp.asarray(local_N)
        sh = batch_sharding(mesh, max(local_N.ndim, 1))
        if jax.process_count() == 1:
            n_dev = mesh.shape["data"] * mesh.shape["fsdp"]
            return jax.device_put(local_N, sh if n_rows % n_dev == 0 else replicated(mesh))
        return jax.make_array_from_process_local_data(sh, local_N,
                                                      (n_rows, *local_N.shape[1:]))


def host_rows(x: jax.Array, lo: int, hi: int) -> np.ndarray:
    """Rows ``[lo, hi)`` of a global array, read from this process's own shards only."""
    n = x.shape[0]
    out = np.empty((hi - lo, *x.shape[1:]), x.dtype)
    filled = np.zeros(hi - lo, bool)
    with jax.transfer_guard("allow"):
        for shard in x.addressable_shards:
            a, b = _rows_of(shard.index, n)
            s, e = max(a, lo), min(b, hi)
            if s < e and not filled[s - lo:e - lo].all():
                out[s - lo:e - lo] = np.asarray(shard.data)[s - a:e - a]
                filled[s - lo:e - lo] = True
    if not filled.all():
        raise ValueError(f"rows [{lo}, {hi}) are not all held by process "
                         f"{jax.process_index()}; it may read only its own rows")
    return out


def fetch_scalars(tree):
    """A pytree of replicated scalars -> Python floats (the step's metrics out)."""
    with jax.transfer_guard("allow"):
        return jax.tree.map(lambda v: float(np.asarray(v)), jax.device_get(tree))


def fetch_small(tree):
    """A pytree of small replicated arrays (per-seed metrics) -> numpy arrays."""
    with jax.transfer_guard("allow"):
        return jax.tree.map(np.asarray, jax.device_get(tree))


def put_replicated(value, mesh, dtype) -> jax.Array:
    """A host scalar (the same on every process) -> a replicated global array."""
    with jax.transfer_guard("allow"):
        x = np.asarray(value, dtype)
        return jnp.asarray(x) if mesh is None else jax.device_put(x, replicated(mesh))


def put_rows(x: np.ndarray, mesh) -> jax.Array:
    """Identical host rows on every process (every process's prompt ids or task arrays)
    -> a global array split by rows."""
    with jax.transfer_guard("allow"):
        if mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, logical_sharding(("batch",) + (None,) * (x.ndim - 1),
                                                  x.shape, mesh))


def gather_rows(local_NxW: np.ndarray) -> np.ndarray:
    """Every process's rows, concatenated in process order, on every host (small arrays
    whose order does not matter, e.g. partial sums; rows of a batch: ``gather_blocks``)."""
    if jax.process_count() == 1:
        return local_NxW
    with jax.transfer_guard("allow"):
        out = multihost_utils.process_allgather(local_NxW, tiled=True)
    return np.asarray(out)


def gather_blocks(local_NxW: np.ndarray, lo: int, n_rows: int) -> np.ndarray:
    """The ``[n_rows, ...]`` host array whose rows ``[lo, lo + N)`` are this process's
    ``local_NxW``, assembled on every host by each process's ``lo`` (small arrays only:
    the step's prompt ids and task arrays). Raises unless the processes' blocks tile
    ``[0, n_rows)``."""
    if jax.process_count() == 1:
        if (lo, len(local_NxW)) != (0, n_rows):
            raise ValueError(f"one process holds rows [{lo}, {lo + len(local_NxW)}), not "
                             f"all {n_rows}")
        return local_NxW
    with jax.transfer_guard("allow"):
        los = np.asarray(multihost_utils.process_allgather(np.asarray([lo, len(local_NxW)])))
        rows = np.asarray(multihost_utils.process_allgather(local_NxW, tiled=True))
    los = los.reshape(-1, 2)
    out, starts = np.empty((n_rows, *rows.shape[1:]), rows.dtype), 0
    covered = np.zeros(n_rows, np.int32)
    for (a, n) in los:
        out[a:a + n] = rows[starts:starts + n]
        covered[a:a + n] += 1
        starts += n
    if not (covered == 1).all():
        raise ValueError(f"the processes' row blocks {[(int(a), int(a + n)) for a, n in los]}"
                         f" do not tile [0, {n_rows})")
    return out


# --- Multi-turn rollouts (rljax.train.multiturn): the transfers of each turn. --------


def turn_tokens_out(arrays: tuple, lo: int, hi: int) -> tuple:
    """"Turn tokens out": this process's rows ``[lo, hi)`` of the turn's tokens and
    counts (``[R, N]`` and ``[R]`` global arrays), read from its own shards."""
    return tuple(host_rows(x, lo, hi) for x in arrays)


def turn_flags(flags: tuple) -> tuple[bool, int]:
    """"Turn flags out": ``(all rows done, widest observation)`` from replicated scalars
    that a program reduced from global arrays, so every process reads the same pair."""
    done, widest = fetch_scalars(flags)
    return bool(done), int(widest)


def observations_in(local: tuple, n_rows: int, mesh) -> tuple:
    """"Observations in": this process's rows of the next turn's inputs (observation ids,
    their lengths, which rows continue, their budgets) -> global arrays split by rows."""
    return tuple(to_global(x, n_rows, mesh) for x in local)
