"""Expert parallelism: each chip of the "fsdp" mesh axis holds E / fsdp whole experts.

Experts are split over the "fsdp" axis (logical axis "expert", `rljax.sharding.rules`;
docs/design.md says why not a mesh axis of their own). Tokens are already split over
data x fsdp, so a layer runs per chip under `jax.shard_map`:

1. route the chip's own tokens (router replicated; statistics summed over the batch axes);
2. dispatch: all-gather the tokens, their expert ids and gate weights over "fsdp";
3. compute the pairs that go to this chip's experts (the others are given a sentinel id
   past the local experts: the ragged form skips them, the tiled form weighs them by 0);
4. combine: each chip's weighted sum of its experts' outputs, reduce-scattered over
   "fsdp" back to the rows' owners.

Dropless by construction: the gathered buffer holds every pair of the fsdp group, so any
routing fits (the static capacity is fsdp x the local pairs). Its cost on XLA:CPU (the
tiled form computes every gathered row) is the price of static shapes; a ragged form
(`jax.lax.ragged_dot`) skips the sentinel rows, and a ragged all-to-all would move only
the routed rows on TPU. Used whenever a mesh is set whose "fsdp" axis (size > 1) divides
both the experts and the rows; otherwise the layer runs as GSPMD partitions it (expert
weights gathered like FSDP weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rljax.sharding import fitted_spec

AXIS = "fsdp"


def expert_axis_size(rows: int, num_experts: int) -> int:
    """The number of expert shards a layer on the current mesh uses: the "fsdp" size when
    it is > 1 and divides ``num_experts`` and the rows are split over it, else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.shape or mesh.shape[AXIS] == 1:
        return 1
    size = mesh.shape[AXIS]
    batch = fitted_spec(("batch",), (rows,), mesh)[0]
    axes = (batch,) if isinstance(batch, str) else (batch or ())
    return size if num_experts % size == 0 and AXIS in axes else 1


def run_expert_parallel(local_fn, x_BxTxD, mask_BxT, replay_BxTxK, router, experts):
    """``local_fn(x, mask, replay, router, experts, axis)`` per chip under `shard_map`:
    rows over the batch axes, ``experts`` (gate, up, down ``[E, ...]``) over "fsdp",
    the router replicated. ``local_fn`` returns ``(out_BxTxD, ids_BxTxK, stats)`` with
    ``stats`` already summed over the batch axes."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = fitted_spec(("batch",), x_BxTxD.shape[:1], mesh)[0]
    rows3, rows2 = P(batch, None, None), P(batch, None)
    ex = P(AXIS, None, None)
    has_replay = replay_BxTxK is not None
    args = (x_BxTxD, mask_BxT, router, experts) + ((replay_BxTxK,) if has_replay else ())
    specs = (rows3, rows2, P(), (ex, ex, ex)) + ((rows3,) if has_replay else ())

    def body(x, mask, w_router, ws, *replay):
        return local_fn(x, mask, replay[0] if replay else None, w_router, ws, AXIS,
                        _batch_axes(batch))

    return jax.shard_map(body, in_specs=specs, out_specs=(rows3, rows3, P()),
                         check_vma=False)(*args)


def _batch_axes(batch) -> tuple[str, ...]:
    return (batch,) if isinstance(batch, str) else tuple(batch or ())


def dispatch(x_NxD, ids_NxK, weights_NxK, num_local: int, axis: str):
    """All-gather over ``axis`` and localise: ``(rows [P N, D], local ids [P N, k] (the
    sentinel ``num_local`` for pairs of other chips' experts), weights [P N, k] (0 there))``."""
    r = jax.lax.axis_index(axis)
    xa, ida, wa = (jax.lax.all_gather(a, axis, tiled=True) for a in (x_NxD, ids_NxK, weights_NxK))
    local = ida // num_local == r
    return xa, jnp.where(local, ida - r * num_local, num_local), jnp.where(local, wa, 0.0)


def combine(out_PNxD: jax.Array, axis: str) -> jax.Array:
    """Each chip's partial outputs of the gathered rows, summed and scattered back to the
    rows' owners over ``axis``: ``[N, D]``."""
    return jax.lax.psum_scatter(out_PNxD, axis, scatter_dimension=0, tiled=True)
