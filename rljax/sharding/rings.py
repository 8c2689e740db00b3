"""Collective-matmul rings on the chip grid: what a layout costs, and a layout that follows
a cycle of the host grid ("ring of rings").

XLA:TPU emits the FSDP weight gradient (a collective matmul) as collective-permute rings
in *logical* mesh order along ``fsdp``: for every (data, tensor) index the chips at
``[d, 0, t], [d, 1, t], ..., [d, F-1, t]`` pass shards to their successor, and the last to
the first. All these rings run at once. A ring edge whose chips are not ICI neighbours
crosses several links, and links that several edges cross run at a fraction of their
bandwidth (each slice has its own links; the data axis alone crosses slices).
:func:`ring_cost` scores a ``[data, fsdp, tensor]`` device grid by the busiest
directed link's number of ring edges and the longest edge in chip hops, routing each edge
dimension by dimension (x, then y, then z) over a mesh without wraparound links (the
slices recorded in tests/topologies are all below the sizes that have them).

:func:`ring_grid` builds a grid in which every process still holds one contiguous block of
batch rows: hosts are visited along a Hamiltonian cycle of the host grid (one cycle per
``data`` index, over a box of hosts), and each host's chips along a path from a chip beside
the previous host to a chip beside the next, so each ring is a cycle of the chip grid
wherever the host grid has one. Blocks then follow the cycle, not process order.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

Cell = tuple[int, ...]


@dataclasses.dataclass(frozen=True, order=True)
class RingCost:
    """The fsdp rings of a layout: ``max_link_load`` ring edges on the busiest directed
    link, ``longest_hop`` chips for the longest edge, ``total_hops`` over all edges (0
    when the devices carry no coordinates or fsdp is 1). Ordered: lower is better."""

    max_link_load: int
    longest_hop: int
    total_hops: int


def _route(a: Cell, b: Cell) -> list[tuple[Cell, Cell]]:
    """The directed links from chip ``a`` to chip ``b``, dimension by dimension."""
    cur, links = list(a), []
    for i in range(len(a)):
        step = 1 if b[i] > cur[i] else -1
        while cur[i] != b[i]:
            nxt = list(cur)
            nxt[i] += step
            links.append((tuple(cur), tuple(nxt)))
            cur = nxt
    return links


def ring_edges(grid: np.ndarray) -> list[tuple]:
    """Every fsdp ring edge ``(device, successor)`` of a ``[data, fsdp, tensor]`` grid."""
    data, fsdp, tensor = grid.shape
    if fsdp == 1:
        return []
    return [(grid[d, f, t], grid[d, (f + 1) % fsdp, t])
            for d in range(data) for t in range(tensor) for f in range(fsdp)]


def ring_cost(grid: np.ndarray) -> RingCost:
    """The busiest link's ring edges and the longest hop of ``grid``'s fsdp rings."""
    edges = ring_edges(grid)
    if not edges or getattr(edges[0][0], "coords", None) is None:
        return RingCost(0, 0, 0)
    load, longest, total = collections.Counter(), 0, 0
    for a, b in edges:
        links = _route(tuple(a.coords), tuple(b.coords))
        load.update((getattr(a, "slice_index", 0), link) for link in links)
        longest, total = max(longest, len(links)), total + len(links)
    return RingCost(max(load.values(), default=0), longest, total)


# --- cycles and paths over boxes of cells ------------------------------------------


def _snake(dims: Sequence[int]) -> list[Cell]:
    """A Hamiltonian path through the box ``dims`` (boustrophedon, last axis fastest)."""
    if not dims:
        return [()]
    out = []
    for i, rest in enumerate(_snake(dims[:-1])):
        run = range(dims[-1]) if i % 2 == 0 else range(dims[-1] - 1, -1, -1)
        out += [rest + (j,) for j in run]
    return out


def box_cycle(dims: Sequence[int]) -> tuple[list[Cell], bool]:
    """``(cells, is_cycle)``: the box's cells in an order whose consecutive cells are
    neighbours, and whether the last is also a neighbour of the first (a Hamiltonian
    cycle; possible only with an even cell count, or at most 2 cells)."""
    big = [i for i, n in enumerate(dims) if n > 1]
    n = math.prod(dims)
    if len(big) < 2 or n % 2:
        return _snake(dims), n <= 2
    # Rows along the first even axis, columns along a snake through the other axes.
    a = next(i for i in big if dims[i] % 2 == 0)
    others = [i for i in range(len(dims)) if i != a]
    cols = _snake([dims[i] for i in others])

    def cell(r: int, c: int) -> Cell:
        out = [0] * len(dims)
        out[a] = r
        for i, v in zip(others, cols[c]):
            out[i] = v
        return tuple(out)

    order = [cell(0, c) for c in range(len(cols))]
    for r in range(1, dims[a]):
        run = range(len(cols) - 1, 0, -1) if r % 2 else range(1, len(cols))
        order += [cell(r, c) for c in run]
    order += [cell(r, 0) for r in range(dims[a] - 1, 0, -1)]
    return order, True


def box_paths(dims: Sequence[int], limit: int = 16) -> dict[tuple[Cell, Cell], list[Cell]]:
    """``{(first, last): path}``: one Hamiltonian path of the box per pair of ends (boxes
    of at most ``limit`` cells; a larger box gives its snake only)."""
    cells = _snake(dims)
    if len(cells) > limit:
        return {(cells[0], cells[-1]): cells}
    nbr = {c: [d for d in cells if sum(abs(x - y) for x, y in zip(c, d)) == 1] for c in cells}
    found: dict = {}

    def walk(path, seen):
        if len(path) == len(cells):
            found.setdefault((path[0], path[-1]), list(path))
            return
        for d in nbr[path[-1]]:
            if d not in seen:
                seen.add(d)
                path.append(d)
                walk(path, seen)
                path.pop()
                seen.discard(d)

    for c in cells:
        walk([c], {c})
    return found


def _factor_boxes(grid_dims: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """Every ``c`` with ``prod(c) == parts`` and ``c[i]`` dividing ``grid_dims[i]``."""
    out = []
    for c in itertools.product(*[[f for f in range(1, n + 1) if n % f == 0]
                                 for n in grid_dims]):
        if math.prod(c) == parts:
            out.append(c)
    return out


# --- the ring-of-rings layout -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Hosts:
    """The hosts of a slice as boxes of chips: ``ext`` chips per host along each
    dimension, ``cells`` {host-grid cell: that host's devices}, ``dims`` the host grid,
    ``chip`` {coords relative to the slice's corner: device}."""

    ext: tuple
    cells: dict
    dims: tuple
    chip: dict


def _hosts(groups: Sequence[Sequence]) -> _Hosts | None:
    """The host boxes of ``groups`` (devices per process), or None where the devices
    carry no coordinates, share a chip, or the hosts do not tile a box of equal boxes."""
    devices = [d for g in groups for d in g]
    if any(getattr(d, "coords", None) is None for d in devices):
        return None
    corner = np.min([tuple(d.coords) for d in devices], axis=0)
    chip = {tuple(int(x) for x in np.asarray(d.coords) - corner): d for d in devices}
    if len(chip) != len(devices):
        return None  # several devices per chip (v4 without megacore)
    los, exts = [], set()
    for g in groups:
        c = np.asarray([tuple(d.coords) for d in g]) - corner
        los.append(c.min(axis=0))
        exts.add(tuple(int(x) for x in c.max(axis=0) - c.min(axis=0) + 1))
    ext = exts.pop()
    if exts or math.prod(ext) != len(groups[0]) or any((lo % ext).any() for lo in los):
        return None
    cells = {tuple(int(x) for x in lo // ext): g for lo, g in zip(los, groups)}
    dims = tuple(int(x) + 1 for x in np.max(list(cells), axis=0))
    if len(cells) != len(groups) or math.prod(dims) != len(groups):
        return None
    return _Hosts(ext, cells, dims, chip)


def _row_cycles(dims: tuple, rows: int) -> list[list[Cell]] | None:
    """``rows`` lists of host cells, each a cycle (where one exists) over an equal box of
    the host grid; None where the host grid does not split into ``rows`` boxes."""
    options = _factor_boxes(dims, rows)
    if not options:
        return None
    box = max((tuple(n // c for n, c in zip(dims, cut)) for cut in options),
              key=lambda b: box_cycle(b)[1])
    cut = tuple(n // b for n, b in zip(dims, box))
    out = []
    for corner in _snake(cut):
        cycle, _ = box_cycle(box)
        out.append([tuple(k * b + x for k, b, x in zip(corner, box, c)) for c in cycle])
    return out


def _choose_paths(hosts: list[Cell], ends: list, units: tuple, unit: tuple) -> list:
    """For each host along a ring, the (first, last) unit cells of its path, chosen so
    that the chip hops from each host's last unit to the next host's first (and from the
    last host back to the first) sum to the least."""
    weight = np.asarray(unit)

    def at(h: Cell, c: Cell) -> np.ndarray:
        return np.asarray(h) * np.asarray(units) + np.asarray(c)

    first = np.asarray([[at(h, e[0]) for e in ends] for h in hosts])  # [n, E, dims]
    last = np.asarray([[at(h, e[1]) for e in ends] for h in hosts])

    def hop(i: int, j: int) -> np.ndarray:  # [E, E]: last of host i -> first of host j
        return (np.abs(last[i][:, None] - first[j][None]) * weight).sum(-1)

    n, size = len(hosts), len(ends)
    acc = np.where(np.eye(size, dtype=bool), 0, np.inf)  # [start choice, current choice]
    back = []
    for i in range(1, n):
        total = acc[:, :, None] + hop(i - 1, i)[None]  # [start, previous, current]
        back.append(total.argmin(axis=1))
        acc = total.min(axis=1)
    close = acc + hop(n - 1, 0).T  # the ring's last edge back to the start
    start, cur = np.unravel_index(int(close.argmin()), close.shape)
    choice = [int(cur)]
    for b in reversed(back):
        choice.append(int(b[start, choice[-1]]))
    return [ends[c] for c in reversed(choice)]


def _unit_grid(sizes: tuple, hosts: _Hosts, unit: tuple) -> np.ndarray | None:
    """The ring-of-rings grid with the tensor axis over boxes of shape ``unit`` chips."""
    data, fsdp, tensor = sizes
    units = tuple(e // u for e, u in zip(hosts.ext, unit))
    rows = _row_cycles(hosts.dims, data)
    if rows is None:
        return None
    paths = box_paths(units)
    ends = list(paths)
    offsets = _snake(unit)  # consecutive tensor indices on neighbouring chips
    grid = np.empty(sizes, dtype=object)
    for d, ring in enumerate(rows):
        f = 0
        for h, key in zip(ring, _choose_paths(ring, ends, units, unit)):
            for cell in paths[key]:
                for t, off in enumerate(offsets):
                    grid[d, f, t] = hosts.chip[tuple((hi * n + c) * u + o for hi, n, c, u, o
                                                     in zip(h, units, cell, unit, off))]
                f += 1
    return grid


def ring_grid(sizes: tuple[int, int, int], groups: Sequence[Sequence]) -> np.ndarray | None:
    """The ring-of-rings ``[data, fsdp, tensor]`` grid of the devices ``groups`` (one list
    per process): each data index's hosts along a cycle of a box of the host grid, each
    host's chips (in boxes of ``tensor`` chips) along a path between its neighbours, so
    every process holds one contiguous block of batch rows. Of the shapes the tensor box
    can take, the one whose rings cost least (:func:`ring_cost`). None where it does not
    apply: devices without coordinates, hosts holding more blocks than fsdp has, or hosts
    that do not tile the slice as equal boxes."""
    data, fsdp, tensor = sizes
    k = len(groups[0]) // tensor
    hosts = _hosts(groups)
    if hosts is None or fsdp % k or len(hosts.cells) != data * (fsdp // k):
        return None
    shapes = [s for s in itertools.product(*[[f for f in range(1, e + 1) if e % f == 0]
                                             for e in hosts.ext]) if math.prod(s) == tensor]
    grids = [g for g in (_unit_grid(sizes, hosts, s) for s in shapes) if g is not None]
    return min(grids, key=ring_cost, default=None)
