"""Where each device sits in the ("data", "fsdp", "tensor") mesh: rows follow processes.

Batch rows are split over ("data", "fsdp") in row-major order: block ``b = d * fsdp + f``
is held by the devices at ``[d, f, :]``. Every host-side step reads and scores the rows
of its own process, and gathers small host arrays in process order, so the mesh must give
process ``p`` (of ``P``) exactly the blocks ``[p * k, (p + 1) * k)``, ``k`` = blocks per
process. On CPU that is what a plain reshape of ``jax.devices()`` gives; on a TPU slice
``jax.make_mesh`` orders chips by physical topology, and a process's chips land anywhere
along an axis (v5e-16, fsdp=16: process 0 held blocks 0, 1, 6, 15).

:func:`device_grid` lays the mesh out in two levels, as
``jax.experimental.mesh_utils.create_hybrid_device_mesh(..., process_is_granule=True)``
does: a per-process mesh over one host's chips (placed by their ICI coordinates, so
neighbours on the tensor and fsdp axes stay physical neighbours inside a host), tiled over
processes in process order along the batch axes. The tensor axis never leaves a host.
Given the same devices in any order (``jax.devices()`` or a TPU topology description's),
it returns the same grid, so ahead-of-time compiles and a real run lay chips out alike.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

# Device kinds for which jax.make_mesh lets the physical axes be split (as it passes).
_SPLIT_KINDS = ("TPU v5 lite", "TPU v5e")


def _by_process(devices: Sequence) -> list[list]:
    """The devices grouped by ``process_index``, processes in increasing order."""
    groups = collections.defaultdict(list)
    for d in devices:
        groups[d.process_index].append(d)
    return [groups[p] for p in sorted(groups)]


def _check_single_slice(devices: Sequence) -> None:
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1:
        raise ValueError(
            f"the devices span {len(slices)} TPU slices (slice_index {sorted(slices)}): "
            "multi-slice (DCN between slices) meshes are not supported yet; run on one "
            "slice")


def _split_blocks(k: int, data: int, fsdp: int, tensor: int) -> tuple[tuple, tuple]:
    """(per-process mesh shape, process grid shape) giving each process ``k`` consecutive
    row blocks of the (data, fsdp) grid, processes in row-major order."""
    if fsdp % k == 0:
        return (1, k, tensor), (data, fsdp // k, 1)
    if k % fsdp == 0 and data % (k // fsdp) == 0:
        return (k // fsdp, fsdp, tensor), (data // (k // fsdp), 1, 1)
    raise ValueError(
        f"mesh (data={data}, fsdp={fsdp}, tensor={tensor}): a process holds {k} batch "
        f"blocks, which must divide fsdp={fsdp} or be a multiple of it that divides "
        f"data x fsdp; choose data and fsdp so that each process's rows are whole blocks")


def device_grid(sizes: tuple[int, int, int], devices: Sequence) -> np.ndarray:
    """An object array ``[data, fsdp, tensor]`` of ``devices`` whose batch blocks follow
    processes: process ``p``'s devices hold blocks ``[p * k, (p + 1) * k)`` in order.

    Raises when the devices span several TPU slices, when processes hold different
    numbers of devices, or when ``tensor`` exceeds (or does not divide) one host's devices.
    """
    data, fsdp, tensor = sizes
    devices = list(devices)
    if data * fsdp * tensor != len(devices):
        raise ValueError(f"mesh {sizes} needs {data * fsdp * tensor} devices, got "
                         f"{len(devices)}")
    _check_single_slice(devices)
    groups = _by_process(devices)
    per = len(groups[0])
    if any(len(g) != per for g in groups):
        raise ValueError("processes hold different numbers of devices: "
                         f"{[len(g) for g in groups]}; every host must bring the same count")
    if tensor > per or per % tensor:
        raise ValueError(
            f"tensor={tensor} must divide the {per} devices of one host: the tensor axis "
            "stays within a host, where its chips have the fastest links; use a smaller "
            "tensor size and more fsdp")
    split = devices[0].device_kind in _SPLIT_KINDS
    if len(groups) == 1:
        return mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=split)
    local, dcn = _split_blocks(per // tensor, data, fsdp, tensor)
    return mesh_utils.create_hybrid_device_mesh(
        local, dcn, devices, process_is_granule=True, allow_split_physical_axes=split)


def _as_grid(mesh_or_grid) -> np.ndarray:
    """A ``[data, fsdp, rest]`` device array of a ``Mesh`` (its batch axes first; a
    missing axis counts as size 1) or of a ``[data, fsdp, tensor]`` grid."""
    if not isinstance(mesh_or_grid, Mesh):
        return np.asarray(mesh_or_grid)
    names = list(mesh_or_grid.axis_names)
    devices = mesh_or_grid.devices
    for axis in ("data", "fsdp"):
        if axis not in names:
            devices, names = devices[None], [axis] + names
    order = [names.index("data"), names.index("fsdp")]
    order += [i for i in range(len(names)) if i not in order]
    devices = np.transpose(devices, order)
    return devices.reshape(devices.shape[0], devices.shape[1], -1)


def process_blocks(mesh_or_grid) -> dict[int, list[int]]:
    """``{process: [batch block indices its devices hold]}`` of a ``Mesh`` or a
    ``[data, fsdp, tensor]`` device grid (block ``d * fsdp + f``)."""
    grid = _as_grid(mesh_or_grid)
    data, fsdp, _ = grid.shape
    out = collections.defaultdict(set)
    for d in range(data):
        for f in range(fsdp):
            for dev in grid[d, f]:
                out[dev.process_index].add(d * fsdp + f)
    return {p: sorted(b) for p, b in sorted(out.items())}


def check_process_blocks(mesh_or_grid) -> None:
    """Raise unless the processes' batch blocks partition ``[0, data x fsdp)`` in process
    order, each one contiguous block (what the host side of a step relies on)."""
    blocks = process_blocks(mesh_or_grid)
    shape = _as_grid(mesh_or_grid).shape
    n = shape[0] * shape[1]
    k = n // len(blocks)
    want = {p: list(range(i * k, (i + 1) * k)) for i, p in enumerate(sorted(blocks))}
    if blocks != want:
        raise ValueError(
            f"mesh (data, fsdp, tensor)={tuple(shape)}: the processes' batch blocks "
            f"are {blocks}, not consecutive blocks in process order; build the mesh with "
            "rljax.sharding.make_mesh")
