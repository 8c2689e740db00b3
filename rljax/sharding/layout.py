"""Where each device sits in the ("data", "fsdp", "tensor") mesh: rows follow processes,
rings follow the chips.

Batch rows are split over ("data", "fsdp") in row-major order: block ``b = d * fsdp + f``
is held by the devices at ``[d, f, :]``. Every host-side step reads and scores the rows
of its own process, so the mesh must give each process one contiguous block of rows
(``k`` = blocks per process); which block a process holds is read from the mesh
(``rljax.train.hosts.own_rows``), and host rows cross processes by their global position
(``gather_blocks``), so blocks need not be in process order. On a TPU slice
``jax.make_mesh`` orders chips by physical topology, and a process's chips land anywhere
along an axis (v5e-16, fsdp=16: process 0 held blocks 0, 1, 6, 15).

:func:`device_grid` lays each slice out in two levels and keeps the cheaper of two
layouts by the cost of the fsdp collective-matmul rings (``rljax.sharding.rings``):

- processes tiled in process order, as
  ``jax.experimental.mesh_utils.create_hybrid_device_mesh(..., process_is_granule=True)``
  does, each over one host's chips placed by their ICI coordinates;
- hosts along a cycle of the host grid ("ring of rings", ``rings.ring_grid``), each
  host's chips along a path from a chip beside the previous host to one beside the next.

The tensor axis never leaves a host. Several slices (``slice_index``) split the ``data``
axis: slice ``s`` holds data rows ``[s * data / S, (s + 1) * data / S)``, so only the
data axis crosses DCN. Given the same devices in any order (``jax.devices()`` or a TPU
topology description's), it returns the same grid, so ahead-of-time compiles and a real
run lay chips out alike.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from rljax.sharding.rings import ring_cost, ring_grid

# Device kinds for which jax.make_mesh lets the physical axes be split (as it passes).
_SPLIT_KINDS = ("TPU v5 lite", "TPU v5e")


def _by_process(devices: Sequence) -> list[list]:
    """The devices grouped by ``process_index``, processes in increasing order."""
    groups = collections.defaultdict(list)
    for d in devices:
        groups[d.process_index].append(d)
    return [groups[p] for p in sorted(groups)]


def _by_slice(devices: Sequence) -> list[list]:
    """The devices grouped by ``slice_index`` (0 where absent), slices in order."""
    groups = collections.defaultdict(list)
    for d in devices:
        groups[getattr(d, "slice_index", 0)].append(d)
    return [groups[s] for s in sorted(groups)]


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
    """An object array ``[data, fsdp, tensor]`` of ``devices`` in which each process's
    devices hold one contiguous block of batch rows, laid out as the module docstring says
    (several slices split ``data``; within a slice, the cheaper of process order and the
    ring of rings).

    Raises when the slices hold different numbers of devices or do not divide ``data``,
    when processes hold different numbers of devices, or when ``tensor`` exceeds (or does
    not divide) one host's devices.
    """
    data, fsdp, tensor = sizes
    devices = list(devices)
    if data * fsdp * tensor != len(devices):
        raise ValueError(f"mesh {sizes} needs {data * fsdp * tensor} devices, got "
                         f"{len(devices)}")
    slices = _by_slice(devices)
    if len(slices) == 1:
        return _slice_grid(sizes, devices)
    if data % len(slices) or any(len(s) != len(slices[0]) for s in slices):
        raise ValueError(
            f"mesh {sizes} over {len(slices)} TPU slices of {[len(s) for s in slices]} "
            f"devices: the slices must be equal and split the data axis (data={data} must "
            f"be a multiple of {len(slices)}); fsdp and tensor stay inside a slice, only "
            "data crosses DCN")
    per_slice = (data // len(slices), fsdp, tensor)
    return np.concatenate([_slice_grid(per_slice, s) for s in slices], axis=0)


def _slice_grid(sizes: tuple[int, int, int], devices: list) -> np.ndarray:
    """``device_grid`` of one slice's devices."""
    data, fsdp, tensor = sizes
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
        placed = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=split)
    elif getattr(devices[0], "coords", None) is None:
        return _listed(sizes, devices, per)
    else:
        local, dcn = _split_blocks(per // tensor, data, fsdp, tensor)
        placed = mesh_utils.create_hybrid_device_mesh(
            local, dcn, devices, process_is_granule=True, allow_split_physical_axes=split)
    ring = ring_grid(sizes, groups)
    return placed if ring is None or ring_cost(placed) <= ring_cost(ring) else ring


def _listed(sizes: tuple[int, int, int], devices: list, per: int) -> np.ndarray:
    """Devices without ICI coordinates (CPU processes): each process's devices as one
    block, processes in the order their devices are first listed (so a list that starts
    with process 1's devices gives process 1 the first rows)."""
    data, fsdp, tensor = sizes
    local, dcn = _split_blocks(per // tensor, data, fsdp, tensor)
    order = list(dict.fromkeys(d.process_index for d in devices))
    groups = {p: [d for d in devices if d.process_index == p] for p in order}
    grid = np.empty(sizes, dtype=object)
    for i, p in enumerate(order):
        at = [slice(j * n, (j + 1) * n) for j, n in zip(np.unravel_index(i, dcn), local)]
        grid[tuple(at)] = np.asarray(groups[p], dtype=object).reshape(local)
    return grid


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
    """Raise unless the processes' batch blocks partition ``[0, data x fsdp)``, each
    process holding one contiguous block of the same size (what the host side of a step
    relies on; blocks need not be in process order: host rows cross processes by their
    global position, ``rljax.train.hosts.gather_blocks``)."""
    blocks = process_blocks(mesh_or_grid)
    shape = _as_grid(mesh_or_grid).shape
    n = shape[0] * shape[1]
    k = n // len(blocks)
    starts = sorted(b[0] for b in blocks.values())
    if (any(b != list(range(b[0], b[0] + k)) for b in blocks.values())
            or starts != list(range(0, n, k))):
        raise ValueError(
            f"mesh (data, fsdp, tensor)={tuple(shape)}: the processes' batch blocks "
            f"are {blocks}, not one contiguous block of {k} per process; build the mesh "
            "with rljax.sharding.make_mesh")
