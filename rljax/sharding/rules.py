"""The one table mapping logical axis names to mesh axes, and shardings derived from it.

Parameters and activations name their dimensions logically ("embed", "heads", "batch"...);
`LOGICAL_RULES` says which mesh axis (or axes) each logical name is split over. A
dimension whose size is not divisible by its mesh axes is replicated instead, so small
models (e.g. one kv head) still place on any mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical name -> mesh axis, tuple of mesh axes, or None (replicated).
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("cache_length", None),
    ("act_embed", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("norm", None),
    ("layers", None),
)
_RULES = dict(LOGICAL_RULES)


def _mesh_axes(name):
    if name is None:
        return None
    if name not in _RULES:
        raise ValueError(
            f"unknown logical axis name {name!r}; allowed: {sorted(_RULES)} or None"
        )
    return _RULES[name]


def logical_spec(names: Sequence[str | None]) -> PartitionSpec:
    """PartitionSpec for a tuple of logical axis names, via `LOGICAL_RULES` (no size checks)."""
    return PartitionSpec(*(_mesh_axes(n) for n in names))


def _axis_size(mesh: Mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else axes
    size = 1
    for a in axes:
        if a not in mesh.shape:
            raise ValueError(
                f"mesh axes {tuple(mesh.shape)} lack {a!r}; build meshes with "
                "rljax.sharding.make_mesh (axes 'data', 'fsdp', 'tensor')"
            )
        size *= mesh.shape[a]
    return size


def fitted_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Like `logical_spec`, but replicates any dimension not divisible by its mesh axes."""
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    out = []
    for name, dim in zip(names, shape):
        axes = _mesh_axes(name)
        out.append(axes if axes is not None and dim % _axis_size(mesh, axes) == 0 else None)
    return PartitionSpec(*out)


def logical_sharding(names, shape, mesh: Mesh) -> NamedSharding:
    """NamedSharding of an array with the given logical axis names and shape on `mesh`."""
    return NamedSharding(mesh, fitted_spec(names, shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding for a batch array of rank `ndim`: leading axis over ("data", "fsdp")."""
    if ndim < 1:
        raise ValueError(f"batch_sharding: ndim must be >= 1, got {ndim}")
    return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1)))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def _names_of(var) -> tuple | None:
    names = var.get_metadata("logical_axes", None) if isinstance(var, nnx.Variable) else None
    return None if names is None else tuple(names)


def state_shardings(state, mesh: Mesh):
    """NamedSharding pytree for an NNX state (or abstract state) from its logical annotations.

    Variables annotated with `logical_axes` metadata (see `rljax.models`) are placed per
    `LOGICAL_RULES`; anything else (RNG counters, scalars) is replicated.
    """

    def one(x):
        if isinstance(x, nnx.Variable):
            names = _names_of(x)
            val = x.get_value() if hasattr(x, "get_value") else x[...]
            shape = getattr(val, "shape", ())
            spec = fitted_spec(names, shape, mesh) if names else PartitionSpec()
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_params(state, mesh: Mesh):
    """Place every array of an NNX state on `mesh` per its logical annotations."""
    shardings = state_shardings(state, mesh)
    return jax.device_put(state, shardings)
