"""Device meshes: the three named axes ("data", "fsdp", "tensor") with Auto axis types."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from rljax.sharding.layout import check_process_blocks, device_grid

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; at most one may be -1, meaning "the remaining devices".

    data: pure data parallelism (batch split, parameters replicated).
    fsdp: batch split AND parameters sharded along their "embed" dimension (ZeRO-3 style).
    tensor: parameters sharded along heads / mlp / vocab (Megatron-style tensor parallelism).
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for name, size in zip(MESH_AXES, sizes):
            if not isinstance(size, int) or isinstance(size, bool):
                raise TypeError(f"MeshConfig.{name} must be an int, got {size!r}")
            if size == 0 or size < -1:
                raise ValueError(
                    f"MeshConfig.{name}={size} is invalid: use a positive size or -1 (the rest)"
                )
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(
                f"MeshConfig has more than one axis set to -1 ({sizes}); at most one may be -1"
            )

    def sizes(self) -> tuple[int, int, int]:
        """The (data, fsdp, tensor) sizes as given (may contain one -1)."""
        return (self.data, self.fsdp, self.tensor)

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """Concrete axis sizes for `num_devices` devices (replaces -1 by the rest)."""
        sizes = list(self.sizes())
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(
                    f"MeshConfig{tuple(sizes)}: {num_devices} devices are not divisible by "
                    f"the fixed axis sizes (product {known})"
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"MeshConfig{tuple(sizes)} needs {math.prod(sizes)} devices but "
                f"{num_devices} were given; set one axis to -1 to use the rest"
            )
        return tuple(sizes)


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> Mesh:
    """Build a `Mesh` with axes ("data", "fsdp", "tensor"), all `AxisType.Auto`.

    Auto axes let GSPMD propagate shardings from the parameter and batch annotations.
    `devices` defaults to `jax.devices()`; a TPU topology description's devices give the
    same layout (`rljax.sharding.layout.device_grid`): each process's devices hold one
    contiguous block of batch rows, the fsdp rings follow the chip grid (hosts along a
    cycle of the host grid), the tensor axis stays inside a host, and several TPU slices
    split the data axis. Raises if the layout cannot give that (`check_process_blocks`).
    """
    cfg = MeshConfig() if cfg is None else cfg
    if not isinstance(cfg, MeshConfig):
        raise TypeError(f"make_mesh: cfg must be a MeshConfig, got {type(cfg).__name__}")
    devices = jax.devices() if devices is None else list(devices)
    grid = device_grid(cfg.resolve(len(devices)), devices)
    check_process_blocks(grid)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def mesh_context(mesh: Mesh | None):
    """``jax.set_mesh(mesh)``, or no context without a mesh.

    Code that reads the abstract mesh while it is traced (splash attention's per-chip
    ``shard_map``, parameter placement in ``rljax.models.layers``) sees ``mesh`` only when
    the program is traced inside this context.
    """
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


class OnMesh:
    """A jitted function that is traced, lowered and run under ``jax.set_mesh(mesh)``.

    The trainers' programs are wrapped in it (``on_mesh``), so a run on a mesh traces its
    attention kernels per chip as ``experiments/memory_budget.py`` compiles them. Every
    other attribute (``_cache_size``, ...) is the wrapped function's.
    """

    def __init__(self, fn: Callable, mesh: Mesh):
        self.fn, self.mesh = fn, mesh

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)


def on_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn`` run under ``jax.set_mesh(mesh)`` (an ``OnMesh``); ``fn`` itself when
    ``mesh`` is None."""
    return fn if mesh is None else OnMesh(fn, mesh)


def mesh_of(params):
    """The mesh the parameters live on (None for a single device / unsharded)."""
    for leaf in jax.tree.leaves(params):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None
