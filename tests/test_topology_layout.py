"""rljax.sharding.make_mesh on real Cloud TPU slices: batch rows follow processes.

The devices are libtpu's topology descriptions, recorded in tests/topologies/*.json by
tests/topologies/record.py (coords, process_index, core_on_chip, device_kind as a run
sees them), so this runs without libtpu. On CPU, a mesh is a plain reshape and every
layout comes out in process order; these slices are where it did not.
"""

import random

import numpy as np
import pytest

from rljax.sharding import MeshConfig, check_process_blocks, device_grid, process_blocks
from _experiments import load_experiment

topo = load_experiment("topology_layout")

# Every recipe's slice and every tpu_setup example's (v4-8, v4-16, v5litepod-8 / -16).
SLICES = ["v4-8", "v4-16", "v5e-4", "v5e-8", "v5e-16", "v5e-32", "v5e-64", "v5p-64", "v6e-8",
          "v6e-16"]
# (chips, processes, chips per process) as the slices report them.
HOSTS = {"v4-8": (4, 1, 4), "v4-16": (8, 2, 4), "v5e-4": (4, 1, 4), "v5e-8": (8, 1, 8),
         "v5e-16": (16, 4, 4), "v5e-32": (32, 8, 4), "v5e-64": (64, 16, 4), "v5p-64": (32, 8, 4),
         "v6e-8": (8, 1, 8), "v6e-16": (16, 4, 4)}


def _meshes(name):
    devices = topo.load_slice(name)
    per = HOSTS[name][2]
    meshes = set(topo.standard_meshes(len(devices), per))
    meshes |= {m for _, m in topo.recipe_meshes().get(name, [])}
    return devices, sorted(meshes)


def test_fixtures_are_the_slices_a_run_sees():
    assert topo.slice_names() == sorted(SLICES)
    for name, (chips, procs, per) in HOSTS.items():
        devices = topo.load_slice(name)
        assert len(devices) == chips and len({d.id for d in devices}) == chips
        assert sorted({d.process_index for d in devices}) == list(range(procs))
        assert {d.core_on_chip for d in devices} == {0}  # one device per chip (megacore)
        assert len({d.coords for d in devices}) == chips
        for p in range(procs):
            assert sum(d.process_index == p for d in devices) == per


@pytest.mark.parametrize("name", SLICES)
def test_each_process_holds_one_block_in_order(name):
    devices, meshes = _meshes(name)
    for sizes in meshes:
        grid = device_grid(sizes, devices)
        assert grid.shape == sizes
        check_process_blocks(grid)
        blocks = process_blocks(grid)
        k = sizes[0] * sizes[1] // len(blocks)
        assert blocks == {p: list(range(p * k, (p + 1) * k)) for p in blocks}
        for p in blocks:  # a process's grid positions hold exactly its own chips
            mine = {d.id for d in grid.ravel() if d.process_index == p}
            assert mine == {d.id for d in devices if d.process_index == p}
        for row in grid.reshape(-1, sizes[2]):  # the tensor axis stays inside a host
            assert len({d.process_index for d in row}) == 1


@pytest.mark.parametrize("name", ["v5e-16", "v5p-64", "v4-16"])
def test_the_layout_does_not_depend_on_the_device_order(name):
    devices, meshes = _meshes(name)
    shuffled = list(devices)
    random.Random(0).shuffle(shuffled)
    for sizes in meshes:
        ids = np.vectorize(lambda d: d.id)
        np.testing.assert_array_equal(ids(device_grid(sizes, devices)),
                                      ids(device_grid(sizes, shuffled)))


def test_control_jax_make_mesh_layout_breaks_the_rows():
    """The previous layout (jax.make_mesh's on TPU) fails the check the way the issue
    found: v5e-16 scattered blocks, out-of-order blocks, and a tensor axis across hosts."""
    v5e16 = topo.load_slice("v5e-16")
    old = topo.old_grid((1, 16, 1), v5e16)
    assert process_blocks(old)[0] == [0, 1, 6, 15]
    assert process_blocks(topo.old_grid((1, 8, 2), v5e16))[1] == [4, 5]
    shared = process_blocks(topo.old_grid((1, 4, 4), v5e16))
    assert shared[0] == shared[1]  # two processes hold the same rows
    for sizes in [(1, 16, 1), (1, 8, 2), (1, 4, 4)]:
        with pytest.raises(ValueError, match="not consecutive blocks in process order"):
            check_process_blocks(topo.old_grid(sizes, v5e16))


def test_tensor_larger_than_a_host_is_refused():
    with pytest.raises(ValueError, match="tensor=8 must divide the 4 devices of one host"):
        device_grid((1, 2, 8), topo.load_slice("v5e-16"))


def test_multi_slice_is_refused():
    devices = topo.load_slice("v5e-8")

    class Sliced(type(devices[0])):
        slice_index = property(lambda self: self.id // 4)

    sliced = [Sliced(**{f: getattr(d, f) for f in d.__dataclass_fields__}) for d in devices]
    with pytest.raises(ValueError, match="multi-slice"):
        device_grid((1, 8, 1), sliced)


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
