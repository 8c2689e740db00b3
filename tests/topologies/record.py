"""Record the device lists of Cloud TPU slices from libtpu's topology descriptions.

Run by hand in an environment with libtpu (``pip install "jax[tpu]==<jax version>"``);
the tests read the JSON files it writes and need no libtpu:

    python tests/topologies/record.py

Each file is what ``jax.devices()`` returns on that slice as a run sees it: one device per
chip (v4 slices are recorded with libtpu's "megacore" chip config, as a v4 VM reports
them), each with ``id``, ``process_index``, ``coords``, ``core_on_chip``, ``device_kind``,
``platform`` and ``slice_index`` (several slices: ``num_slices``). Slices with one host of 8 chips (v5litepod-8, v6e-8) pass that host's
bounds; libtpu's default describes their 2x4 chips as two hosts of 2x2.
"""

from __future__ import annotations

import json
import pathlib

# slice name -> (topology name, extra get_topology_desc arguments)
SLICES = {
    "v4-8": ("v4:2x2x1", {"chip_config_name": "megacore"}),
    "v4-16": ("v4:2x2x2", {"chip_config_name": "megacore"}),
    "v5e-4": ("v5e:2x2", {}),
    "v5e-8": ("v5e:2x4", {"chips_per_host_bounds": [2, 4, 1]}),
    "v5e-16": ("v5e:4x4", {}),
    "v5e-32": ("v5e:4x8", {}),
    "v5e-64": ("v5e:8x8", {}),
    "v5p-64": ("v5p:2x4x4", {}),
    "v6e-8": ("v6e:2x4", {"chips_per_host_bounds": [2, 4, 1]}),
    "v6e-16": ("v6e:4x4", {}),
    "v5e-256": ("v5e:16x16", {}),
    "v5p-32": ("v5p:2x2x4", {}),
    "v5p-128": ("v5p:4x4x4", {}),
    # Two v5e-16 slices joined over DCN (a multislice job): devices carry slice_index.
    "v5e-16x2": ("v5e:4x4", {"num_slices": 2}),
}


def record(name: str) -> dict:
    from jax.experimental import topologies

    topology, kwargs = SLICES[name]
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs)
    devices = [{"id": d.id, "process_index": d.process_index, "coords": list(d.coords),
                "core_on_chip": d.core_on_chip, "device_kind": d.device_kind,
                "platform": d.platform, "slice_index": getattr(d, "slice_index", 0)} for d in desc.devices]
    return {"slice": name, "topology": topology, "kwargs": kwargs, "devices": devices}


def main() -> None:
    here = pathlib.Path(__file__).parent
    for name in SLICES:
        (here / f"{name}.json").write_text(json.dumps(record(name), indent=None) + "\n")
        print("wrote", here / f"{name}.json")


if __name__ == "__main__":
    main()
