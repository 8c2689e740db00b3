"""One process of a 2 x 4 test pair (tests/_multiprocess.py): several `rljax train` runs,
one after another, in this one process.

    python tests/_mp_driver.py LOG_DIR '[["name", [argv...]], ...]'

The first run's argv carries the launch flags (`--distributed --coordinator ...`), so
`jax.distributed` starts once, through the CLI; the later runs are the same CLI in the
same two-process runtime (`jax.distributed` cannot start twice in a process). Each run's
stdout and stderr (file descriptors 1 and 2, so logging and native output too) go to
LOG_DIR/name. The process exits with the first non-zero status.

With RLJAX_TEST_DEVICE_ORDER="i,j,..." (positions in the process-ordered device list) the
run's mesh is built from the devices in that order, as a TPU slice's topology order
interleaves its hosts' chips (tests/_multiprocess.py sets it for the pair). Only the
run's `make_mesh` sees the order: JAX's own multihost utilities keep `jax.devices()`,
which on a TPU slice too lists each process's chips together.
"""

import json
import os
import sys

from rljax import cli


def _run(argv: list, log_path: str) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "w") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        try:
            return cli.main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)


def _permute_devices(order: str) -> None:
    """The run's make_mesh gets the devices in `order` (read when it is called: after
    the CLI has started jax.distributed)."""
    import jax
    import numpy as np

    from rljax.run import builders
    from rljax.sharding import make_mesh, process_blocks

    def permuted_make_mesh(cfg=None, devices=None):
        listed = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        devices = [listed[int(i)] for i in order.split(",")]
        naive = np.asarray(devices, dtype=object).reshape(1, len(devices), 1)
        print(f"devices in mesh order {[d.id for d in devices]}; a plain reshape would "
              f"give blocks {process_blocks(naive)}", flush=True)
        return make_mesh(cfg, devices=devices)

    builders.make_mesh = permuted_make_mesh


def main() -> int:
    if os.environ.get("RLJAX_TEST_DEVICE_ORDER"):
        _permute_devices(os.environ["RLJAX_TEST_DEVICE_ORDER"])
    log_dir, runs = sys.argv[1], json.loads(sys.argv[2])
    for name, argv in runs:
        rc = _run(argv, os.path.join(log_dir, name))
        if rc:
            print(f"run {name} exited with {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
