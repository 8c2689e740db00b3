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
    ("batch", ("data", "fsdp")),  # == BATCH_AXES
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
    # Mixture-of-experts weights [E, D, F] / [E, F, D]: experts over fsdp (expert
    # parallelism, rljax/models/moe_parallel.py), each expert's hidden dim whole.
    ("expert", "fsdp"),
    ("expert_embed", None),
    ("expert_mlp", "tensor"),
)
_RULES = dict(LOGICAL_RULES)
# The mesh axes that split the batch (and, for fsdp, the training layout's parameters).
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")


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


def _without(axes, drop: tuple[str, ...]):
    """`axes` (a mesh axis, a tuple of them or None) less the mesh axes in `drop`."""
    if axes is None or not drop:
        return axes
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in drop)
    return kept[0] if len(kept) == 1 else (kept or None)


def fitted_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                drop: tuple[str, ...] = ()) -> PartitionSpec:
    """Like `logical_spec`, but replicates any dimension not divisible by its mesh axes.

    drop: mesh axes left out of every dimension's axes (before the divisibility check),
    e.g. `BATCH_AXES` for the inference layout (`inference_shardings`).
    """
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    out = []
    for name, dim in zip(names, shape):
        axes = _without(_mesh_axes(name), drop)
        out.append(axes if axes is not None and dim % _axis_size(mesh, axes) == 0 else None)
    return PartitionSpec(*out)


def logical_sharding(names, shape, mesh: Mesh, drop: tuple[str, ...] = ()) -> NamedSharding:
    """NamedSharding of an array with the given logical axis names and shape on `mesh`
    (`drop`: mesh axes left out, as in `fitted_spec`)."""
    return NamedSharding(mesh, fitted_spec(names, shape, mesh, drop))


# A context in JAX's jit cache key (`jax.make_user_context`): a program traced inside
# `logical_constraints(False)` is compiled apart, never handed to a caller outside it.
_CONSTRAINTS = jax.make_user_context(True)


def logical_constraints(enabled: bool):
    """A context within which programs traced get (``True``) or lack (``False``) the
    constraints of :func:`constrain_logical` and the layouts that ask
    :func:`constraints_enabled`: the collective audit's control compiles a program as it
    was before them (``tests/test_collectives.py``). The value is part of JAX's cache
    key, so each setting has its own compiled programs."""
    return _CONSTRAINTS(bool(enabled))


def constraints_enabled() -> bool:
    """Whether :func:`constrain_logical` constrains (see :func:`logical_constraints`)."""
    return _CONSTRAINTS.value


def constrain_logical(value, names: Sequence[str | None]):
    """``value`` constrained to the sharding of its logical axis ``names`` on the mesh set
    by ``jax.set_mesh`` (inside jit: a sharding constraint); ``value`` itself without one
    (or inside ``logical_constraints(False)``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not constraints_enabled():
        return value
    return jax.lax.with_sharding_constraint(value, logical_sharding(names, value.shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding for a batch array of rank `ndim`: leading axis over ("data", "fsdp")."""
    if ndim < 1:
        raise ValueError(f"batch_sharding: ndim must be >= 1, got {ndim}")
    return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1)))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def logical_axes(var) -> tuple | None:
    """The logical axis names an ``nnx.Variable`` carries (``logical_axes`` metadata), or
    None (not a variable, or not annotated)."""
    names = var.get_metadata("logical_axes", None) if isinstance(var, nnx.Variable) else None
    return None if names is None else tuple(names)


def state_shardings(state, mesh: Mesh, drop: tuple[str, ...] = ()):
    """NamedSharding pytree for an NNX state (or abstract state) from its logical annotations.

    Variables annotated with `logical_axes` metadata (see `rljax.models`) are placed per
    `LOGICAL_RULES` (less the mesh axes in `drop`); anything else (RNG counters, scalars)
    is replicated.
    """

    def one(x):
        if isinstance(x, nnx.Variable):
            names = logical_axes(x)
            shape = getattr(x.get_value(), "shape", ())
            spec = fitted_spec(names, shape, mesh, drop) if names else PartitionSpec()
            return x.replace(NamedSharding(mesh, spec))
        return replicated(mesh)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def inference_shardings(state, mesh: Mesh):
    """The inference (decode) layout of an NNX state: `state_shardings` with the batch
    axes `BATCH_AXES` ("data", "fsdp") dropped from every parameter.

    Each parameter is replicated over data x fsdp and keeps its "tensor" split (heads,
    kv heads, mlp, vocab), stacked `[L, ...]` layers included (their "layers" axis is
    never sharded). A decode loop over parameters in this layout needs no FSDP
    all-gather per step: the sampler reshards to it once per call (one gather), and a
    chip holds the params / tensor copy beside its training shard, so large models keep
    tensor >= 4 (see `rljax.sampling.sampler`).
    """
    return state_shardings(state, mesh, drop=BATCH_AXES)


def shard_params(state, mesh: Mesh):
    """Place every array of an NNX state on `mesh` per its logical annotations."""
    return jax.device_put(state, state_shardings(state, mesh))
