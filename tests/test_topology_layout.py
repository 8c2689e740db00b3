"""rljax.sharding.make_mesh on real Cloud TPU slices: each process holds one block of batch
rows, and the fsdp rings follow the chips (ring of rings).

The devices are libtpu's topology descriptions, recorded in tests/topologies/*.json by
tests/topologies/record.py (coords, process_index, core_on_chip, device_kind as a run
sees them), so this runs without libtpu. On CPU, a mesh is a plain reshape and every
layout comes out in process order; these slices are where it did not, and where the
fsdp rings' route depends on the layout (rljax.sharding.rings).
"""

import random

import numpy as np
import pytest

from rljax.sharding import MeshConfig, check_process_blocks, device_grid, process_blocks, rings
from rljax.sharding.rings import RingCost, ring_cost
from _experiments import load_experiment

topo = load_experiment("topology_layout")

# Every recipe's slice and every tpu_setup example's (v4-8, v4-16, v5litepod-8 / -16), a
# full v5e pod, v5p slices whose hosts sit in a line (v5p-32) or a 2x2x4 grid (v5p-128),
# and two v5e-16 slices over DCN.
SLICES = ["v4-8", "v4-16", "v5e-4", "v5e-8", "v5e-16", "v5e-32", "v5e-64", "v5e-256", "v5p-32",
          "v5p-64", "v5p-128", "v6e-8", "v6e-16", "v5e-16x2"]
# (chips, processes, chips per process) as the slices report them.
HOSTS = {"v4-8": (4, 1, 4), "v4-16": (8, 2, 4), "v5e-4": (4, 1, 4), "v5e-8": (8, 1, 8),
         "v5e-16": (16, 4, 4), "v5e-32": (32, 8, 4), "v5e-64": (64, 16, 4),
         "v5e-256": (256, 64, 4), "v5p-32": (16, 4, 4), "v5p-64": (32, 8, 4),
         "v5p-128": (64, 16, 4), "v6e-8": (8, 1, 8), "v6e-16": (16, 4, 4),
         "v5e-16x2": (32, 8, 4)}
# Slices whose hosts form a grid with a Hamiltonian cycle (every one here but v5p-32).
CYCLES = [s for s in SLICES if s not in ("v4-8", "v5e-4", "v5e-8", "v6e-8", "v5p-32")]


def _meshes(name):
    devices = topo.load_slice(name)
    per = HOSTS[name][2]
    slices = len({d.slice_index for d in devices})
    meshes = set(topo.standard_meshes(len(devices), per, slices))
    meshes |= {m for _, m in topo.recipe_meshes().get(name, [])}
    return devices, sorted(meshes)


def test_fixtures_are_the_slices_a_run_sees():
    assert topo.slice_names() == sorted(SLICES)
    for name, (chips, procs, per) in HOSTS.items():
        devices = topo.load_slice(name)
        assert len(devices) == chips and len({d.id for d in devices}) == chips
        assert sorted({d.process_index for d in devices}) == list(range(procs))
        assert {d.core_on_chip for d in devices} == {0}  # one device per chip (megacore)
        assert len({(d.slice_index, d.coords) for d in devices}) == chips
        for p in range(procs):
            assert sum(d.process_index == p for d in devices) == per


@pytest.mark.parametrize("name", SLICES)
def test_each_process_holds_one_block(name):
    devices, meshes = _meshes(name)
    for sizes in meshes:
        grid = device_grid(sizes, devices)
        assert grid.shape == sizes
        check_process_blocks(grid)
        blocks = process_blocks(grid)
        k = sizes[0] * sizes[1] // len(blocks)
        assert sorted(b[0] for b in blocks.values()) == list(range(0, sizes[0] * sizes[1], k))
        for b in blocks.values():
            assert b == list(range(b[0], b[0] + k))
        for p in blocks:  # a process's grid positions hold exactly its own chips
            mine = {d.id for d in grid.ravel() if d.process_index == p}
            assert mine == {d.id for d in devices if d.process_index == p}
        for row in grid.reshape(-1, sizes[2]):  # the tensor axis stays inside a host
            assert len({d.process_index for d in row}) == 1


@pytest.mark.parametrize("name", ["v5e-16", "v5p-64", "v4-16", "v5e-16x2"])
def test_the_layout_does_not_depend_on_the_device_order(name):
    devices, meshes = _meshes(name)
    shuffled = list(devices)
    random.Random(0).shuffle(shuffled)
    for sizes in meshes:
        ids = np.vectorize(lambda d: d.id)
        np.testing.assert_array_equal(ids(device_grid(sizes, devices)),
                                      ids(device_grid(sizes, shuffled)))


def test_control_jax_make_mesh_layout_breaks_the_rows():
    """jax.make_mesh's layout on TPU fails the check where a process's blocks scatter
    (v5e-16) or a tensor axis crosses hosts; blocks merely out of process order pass."""
    v5e16 = topo.load_slice("v5e-16")
    old = topo.old_grid((1, 16, 1), v5e16)
    assert process_blocks(old)[0] == [0, 1, 6, 15]
    assert process_blocks(topo.old_grid((1, 8, 2), v5e16))[1] == [4, 5]
    shared = process_blocks(topo.old_grid((1, 4, 4), v5e16))
    assert shared[0] == shared[1]  # two processes hold the same rows
    for sizes in [(1, 16, 1), (1, 4, 4)]:
        with pytest.raises(ValueError, match="not one contiguous block of"):
            check_process_blocks(topo.old_grid(sizes, v5e16))
    check_process_blocks(topo.old_grid((1, 8, 2), v5e16))  # blocks out of order: fine


def test_tensor_larger_than_a_host_is_refused():
    with pytest.raises(ValueError, match="tensor=8 must divide the 4 devices of one host"):
        device_grid((1, 2, 8), topo.load_slice("v5e-16"))


def test_slices_split_the_data_axis():
    """Two v5e-16 slices: slice s holds data rows [s * data / 2, (s + 1) * data / 2), so
    only the data axis crosses DCN; each slice is laid out as one slice alone is."""
    devices = topo.load_slice("v5e-16x2")
    one = topo.load_slice("v5e-16")
    ids = np.vectorize(lambda d: d.id % 100000)
    for sizes in [(2, 16, 1), (4, 8, 1), (2, 8, 2)]:
        grid = device_grid(sizes, devices)
        half = sizes[0] // 2
        for s in range(2):
            rows = grid[s * half:(s + 1) * half]
            assert {d.slice_index for d in rows.ravel()} == {s}
            np.testing.assert_array_equal(ids(rows),
                                          ids(device_grid((half, *sizes[1:]), one)))
    with pytest.raises(ValueError, match="data=1 must be a multiple of 2"):
        device_grid((1, 32, 1), devices)


def test_ring_cost_counts_shared_links_and_hops():
    """A ring 0 -> 2 -> 1 -> 3 -> 0 on four chips in a line: edges of 2, 1, 2 and 3 hops;
    the link 1 -> 2 carries the edges 0 -> 2 and 1 -> 3."""
    line = [topo.FakeDevice(i, 0, (i, 0, 0), 0, "TPU v5 lite", "tpu") for i in range(4)]
    grid = np.asarray([line[0], line[2], line[1], line[3]], dtype=object).reshape(1, 4, 1)
    assert ring_cost(grid) == RingCost(max_link_load=2, longest_hop=3, total_hops=8)
    assert ring_cost(np.asarray(line, dtype=object).reshape(1, 4, 1)) == RingCost(1, 3, 6)


@pytest.mark.parametrize("dims", [(2, 2, 1), (4, 4, 1), (2, 3, 1), (1, 2, 4), (2, 2, 4),
                                  (3, 3, 2), (1, 1, 2), (4, 1, 1)])
def test_box_cycles_visit_every_cell_by_neighbours(dims):
    cells, is_cycle = rings.box_cycle(dims)
    assert sorted(cells) == sorted(np.ndindex(*dims))
    steps = list(zip(cells, cells[1:] + cells[:1] if is_cycle else cells[1:]))
    assert all(sum(abs(a - b) for a, b in zip(x, y)) == 1 for x, y in steps if x != y)
    assert is_cycle == (np.prod(dims) <= 2 or (np.prod(dims) % 2 == 0
                                               and sum(n > 1 for n in dims) >= 2))


@pytest.mark.parametrize("name", CYCLES)
def test_fsdp_rings_are_cycles_of_the_chips_where_hosts_form_one(name):
    """Pure fsdp over every slice whose host grid has a cycle: each ring edge is one ICI
    hop and no link carries two edges (the logical order is XLA:TPU's route)."""
    devices, _ = _meshes(name)
    slices = len({d.slice_index for d in devices})
    grid = device_grid((slices, len(devices) // slices, 1), devices)
    cost = ring_cost(grid)
    assert (cost.max_link_load, cost.longest_hop) == (1, 1), cost


def test_hosts_in_a_line_take_the_best_path():
    """v5p-32's four hosts sit in a line: no cycle keeps each host's chips together, so
    the ring's closing edge runs back along the line (3 hops; jax.make_mesh: 5)."""
    devices = topo.load_slice("v5p-32")
    assert ring_cost(device_grid((1, 16, 1), devices)) == RingCost(1, 3, 18)
    assert ring_cost(topo.old_grid((1, 16, 1), devices)).longest_hop == 5


def test_rings_are_never_worse_than_jax_make_mesh_with_the_tensor_axis_in_a_host():
    """Over every layout: rljax's rings are as good as jax.make_mesh's, except where
    jax.make_mesh spreads the tensor axis over hosts (tensor 4 on 4-chip hosts): there 4
    rings cross each host face of 2 links, and rljax's busiest link carries 2."""
    rows = topo.layouts()
    for r in rows:
        if topo.worse(r):
            assert r["mesh"][2] == 4 and r["new_ring"].max_link_load == 2, r
            grid = topo.old_grid(r["mesh"], topo.load_slice(r["slice"]))
            assert any(len({d.process_index for d in row}) > 1
                       for row in grid.reshape(-1, 4))
    assert sum(topo.worse(r) for r in rows) == 5


def test_blocks_that_cannot_follow_processes_are_refused():
    # 3 processes of 2 devices as (data=2, fsdp=3): a process's 2 blocks would straddle
    # the rows of two data indices.
    devices = [topo.FakeDevice(i, i // 2, (i, 0, 0), 0, "cpu", "cpu") for i in range(6)]
    with pytest.raises(ValueError, match="must divide fsdp=3"):
        device_grid((2, 3, 1), devices)
    assert process_blocks(device_grid((1, 6, 1), devices)) == {0: [0, 1], 1: [2, 3],
                                                               2: [4, 5]}


def test_rl_trainer_refuses_a_mesh_whose_rows_do_not_follow_processes():
    """A mesh built with jax.make_mesh on a v5e-16 slice (its layout, on the recorded
    chips) is refused before anything runs, naming each process's blocks."""
    from jax.sharding import AxisType, Mesh

    from rljax.train.config import AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig
    from rljax.train.rl import RLTrainer

    grid = topo.old_grid((1, 16, 1), topo.load_slice("v5e-16"))
    mesh = Mesh(grid, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    with pytest.raises(ValueError, match=r"0: \[0, 1, 6, 15\].*rljax.sharding.make_mesh"):
        RLTrainer(None, None, lambda c, m: np.zeros(len(c)), algorithm=AlgorithmConfig(),
                  optim=OptimConfig(), sampling=SamplingConfig(), rl=RLConfig(),
                  prompt_len=8, mesh=mesh)


def test_gather_blocks_on_one_process():
    from rljax.train import hosts

    rows = np.arange(12).reshape(6, 2)
    np.testing.assert_array_equal(hosts.gather_blocks(rows, 0, 6), rows)
    with pytest.raises(ValueError, match=r"holds rows \[2, 8\), not all 6"):
        hosts.gather_blocks(rows, 2, 6)
