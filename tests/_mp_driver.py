"""One process of a 2 x 4 test pair (tests/_multiprocess.py): several `rljax train` runs,
one after another, in this one process.

    python tests/_mp_driver.py LOG_DIR '[["name", [argv...]], ...]'

The first run's argv carries the launch flags (`--distributed --coordinator ...`), so
`jax.distributed` starts once, through the CLI; the later runs are the same CLI in the
same two-process runtime (`jax.distributed` cannot start twice in a process). Each run's
stdout and stderr (file descriptors 1 and 2, so logging and native output too) go to
LOG_DIR/name. The process exits with the first non-zero status.

With RLJAX_TEST_DEVICE_ORDER="i,j,..." (positions in the process-ordered device list)
`jax.devices()` returns the devices in that order, as a TPU slice lists its chips by
topology rather than by process (tests/_multiprocess.py sets it for the pair).
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
    import jax

    listed = jax.devices

    def devices(backend=None):
        ds = sorted(listed(backend), key=lambda d: (d.process_index, d.id))
        return [ds[int(i)] for i in order.split(",")]

    jax.devices = devices


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
