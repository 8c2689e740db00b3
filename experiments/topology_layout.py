"""Mesh layouts on real Cloud TPU slices: which batch blocks each process holds, how many
mesh neighbours are not ICI neighbours, and what the fsdp collective-matmul rings cost,
for `jax.make_mesh`'s layout and `rljax.sharding.make_mesh`'s.

The slices' devices are read from `tests/topologies/*.json`, recorded from libtpu's
topology descriptions by `tests/topologies/record.py` (coords, process_index, core_on_chip,
device_kind, slice_index as a run sees them; no libtpu needed here). For each slice it lays
out every recipe's mesh (`RECIPES` of the GSM8K experiments) and the standard shapes
(1, N, 1), (2, N/2, 1), (1, N/2, 2) and (1, N/4, 4) where tensor fits a host:

    python experiments/topology_layout.py

A mesh neighbour is a pair of devices at consecutive positions along one mesh axis; it is
an ICI neighbour when the chips' coordinates differ by one in one dimension (or it is the
same chip). The rings are XLA:TPU's collective-permute rings along fsdp in logical order
(`rljax.sharding.rings.ring_cost`): the busiest directed link's ring edges and the longest
edge in chip hops. Slices of several TPU slices (`v5e-16x2`) are laid out by rljax only
(`jax.make_mesh` does not split by slice). The last line: RESULT layouts=<n>
ordered_before=<a> ordered_after=<b> ici_misses_before=<x> ici_misses_after=<y>
worse_than_make_mesh=<w> max_link_load=<m> (`ordered`: one contiguous block of rows per
process; `worse_than_make_mesh`: layouts whose busiest link, then longest hop, is worse
than `jax.make_mesh`'s; `max_link_load`: the largest busiest-link load of rljax's layouts).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
from jax.experimental import mesh_utils

from rljax.sharding import MeshConfig, check_process_blocks, device_grid, process_blocks
from rljax.sharding.rings import ring_cost

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOPOLOGIES = ROOT / "tests" / "topologies"
EXPERIMENTS = ("gsm8k_qwen25_grpo", "gsm8k_qwen25_ppo", "gsm8k_llama3_grpo")


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """A TPU chip as `jax.devices()` describes it (what `mesh_utils` reads)."""

    id: int
    process_index: int
    coords: tuple
    core_on_chip: int
    device_kind: str
    platform: str
    slice_index: int = 0

    def __repr__(self):
        return f"TPU_{self.id}(process={self.process_index}, coords={self.coords})"


def slice_names() -> list[str]:
    return sorted(p.stem for p in TOPOLOGIES.glob("*.json"))


def load_slice(name: str) -> list[FakeDevice]:
    """The devices of slice `name` (e.g. "v5e-16") in the order the runtime lists them."""
    rec = json.loads((TOPOLOGIES / f"{name}.json").read_text())
    return [FakeDevice(d["id"], d["process_index"], tuple(d["coords"]), d["core_on_chip"],
                       d["device_kind"], d["platform"], d.get("slice_index", 0))
            for d in rec["devices"]]


def old_grid(sizes, devices) -> np.ndarray | None:
    """`jax.make_mesh`'s layout on TPU: chips by physical topology only (None where it
    raises, as it does when a mesh axis is no product of physical axes)."""
    split = devices[0].device_kind in ("TPU v5 lite", "TPU v5e")
    if len({d.slice_index for d in devices}) > 1:
        return None
    try:
        return mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=split)
    except NotImplementedError:
        return None


def ici_neighbours(a: FakeDevice, b: FakeDevice) -> bool:
    return sum(abs(x - y) for x, y in zip(a.coords, b.coords)) <= 1


def ici_misses(grid: np.ndarray) -> tuple[int, int]:
    """(mesh neighbour pairs that are not ICI neighbours, all mesh neighbour pairs)."""
    miss = total = 0
    for axis in range(grid.ndim):
        lo = np.take(grid, range(grid.shape[axis] - 1), axis=axis).ravel()
        hi = np.take(grid, range(1, grid.shape[axis]), axis=axis).ravel()
        total += len(lo)
        miss += sum(not ici_neighbours(a, b) for a, b in zip(lo, hi))
    return miss, total


def standard_meshes(n: int, per_host: int, slices: int = 1) -> list[tuple[int, int, int]]:
    """(1, N, 1), (2, N/2, 1), (1, N/2, 2), (1, N/4, 4) (tensor where it fits a host),
    with ``data`` multiplied by the number of slices."""
    s, m = slices, n // slices
    out = [(s, m, 1), (2 * s, m // 2, 1)]
    out += [(s, m // t, t) for t in (2, 4) if t <= per_host and m % t == 0]
    return out


def recipe_meshes() -> dict[str, list[tuple[str, tuple]]]:
    """{slice: [(recipe label, mesh sizes)]} over the GSM8K experiments' recipes."""
    from rljax.run.experiment_files import experiment_module
    from rljax.run.recipes import SLICES

    out: dict[str, list] = {}
    for exp in EXPERIMENTS:
        recipes = experiment_module(ROOT / "experiments" / f"{exp}.py").RECIPES
        for name, r in recipes.items():
            sizes = r.mesh.resolve(SLICES[r.slice].chips)
            out.setdefault(r.slice, []).append((f"{exp}/{name}", sizes))
    return out


def ordered(grid: np.ndarray | None) -> bool:
    if grid is None:
        return False
    try:
        check_process_blocks(grid)
    except ValueError:
        return False
    return True


def layouts() -> list[dict]:
    """One row per (slice, mesh): old and new layouts' order and ICI misses."""
    rows, by_recipe = [], recipe_meshes()
    for name in slice_names():
        devices = load_slice(name)
        per_host = len(devices) // len({d.process_index for d in devices})
        slices = len({d.slice_index for d in devices})
        meshes = {m: [] for m in standard_meshes(len(devices), per_host, slices)}
        for label, m in by_recipe.get(name, []):
            meshes.setdefault(m, []).append(label)
        for sizes, labels in meshes.items():
            label = ", ".join(labels)
            old = old_grid(sizes, devices)
            new = device_grid(MeshConfig(*sizes).resolve(len(devices)), devices)
            rows.append(dict(slice=name, mesh=sizes, recipe=label, old_ordered=ordered(old),
                             new_ordered=ordered(new),
                             old_blocks=None if old is None else process_blocks(old),
                             old_miss=None if old is None else ici_misses(old),
                             new_miss=ici_misses(new),
                             old_ring=None if old is None else ring_cost(old),
                             new_ring=ring_cost(new)))
    return rows


def worse(row: dict) -> bool:
    """rljax's rings cost more than jax.make_mesh's: a busier link, or as busy a link and
    a longer hop."""
    old, new = row["old_ring"], row["new_ring"]
    return old is not None and (new.max_link_load, new.longest_hop) > (old.max_link_load,
                                                                        old.longest_hop)


def _ring(cost) -> str:
    return "-" if cost is None else f"{cost.max_link_load} / {cost.longest_hop}"


def _verdict(row: dict) -> str:
    if row["old_miss"] is None:
        return "raises (no such physical split, or several slices)"
    if row["old_ordered"]:
        return "yes"
    blocks = row["old_blocks"]
    if blocks[0] == blocks[1]:
        return f"no: processes 0 and 1 both hold {blocks[0]}"
    return f"no: process 0 holds {blocks[0]}, process 1 {blocks[1]}"


def main() -> None:
    rows = layouts()
    print("| slice | mesh (data, fsdp, tensor) | recipe | jax.make_mesh: rows in process "
          "order | non-ICI mesh neighbours (jax.make_mesh / rljax, of all) | rings: busiest "
          "link / longest hop, jax.make_mesh | rings, rljax |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['slice']} | {r['mesh']} | {r['recipe'] or '-'} | "
              f"{_verdict(r)} | {'-' if r['old_miss'] is None else r['old_miss'][0]} / "
              f"{r['new_miss'][0]} of {r['new_miss'][1]} | {_ring(r['old_ring'])} | "
              f"{_ring(r['new_ring'])}{' (worse)' if worse(r) else ''} |")
    print(f"RESULT layouts={len(rows)} ordered_before={sum(r['old_ordered'] for r in rows)} "
          f"ordered_after={sum(r['new_ordered'] for r in rows)} "
          f"ici_misses_before={sum(r['old_miss'][0] for r in rows if r['old_miss'])} "
          f"ici_misses_after={sum(r['new_miss'][0] for r in rows)} "
          f"worse_than_make_mesh={sum(worse(r) for r in rows)} "
          f"max_link_load={max(r['new_ring'].max_link_load for r in rows)}")


if __name__ == "__main__":
    main()
