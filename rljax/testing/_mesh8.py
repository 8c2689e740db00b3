"""check_objective's mesh check in a child process with 8 emulated CPU devices, for a
process that has one device: `run_in_subprocess` pickles the objective, its coefficients
and the batches (the objective must be importable: defined at a module's top level; the
child gets this process's `sys.path`), the child (`python -m rljax.testing._mesh8`,
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, `JAX_PLATFORMS=cpu`) runs the
same comparison as the in-process check, and a failed check comes back as the same
AssertionError."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any, Sequence

import jax
import numpy as np

DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
_FAILED = "@@check_objective failed@@"

__all__ = ["DEVICES", "run_in_subprocess"]


def run_in_subprocess(fn: Any, coef: Any, batches: Sequence[Any], *,
                      micro_batches: Sequence[int], rtol: float | None,
                      timeout_s: float = 600) -> str | None:
    """The mesh check of every batch on `DEVICES` CPU devices in a child process: None
    when it ran and passed, else why it could not run (the objective or its coefficients
    do not pickle). Raises the child's AssertionError when a check failed, RuntimeError
    when the child itself failed."""
    host = [jax.tree.map(np.asarray, b) for b in batches]
    try:
        blob = pickle.dumps((fn, coef, host, tuple(micro_batches), rtol))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        return (f"the objective or its coefficients do not pickle ({e}), so the {DEVICES}-"
                "device check cannot run in a subprocess: define the objective at a "
                "module's top level, or run with XLA_FLAGS="
                f"{_FLAG}={DEVICES} set before jax is imported")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    env = {**os.environ, "XLA_FLAGS": " ".join([*flags, f"{_FLAG}={DEVICES}"]),
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    p = subprocess.run([sys.executable, "-m", "rljax.testing._mesh8"], input=blob, env=env,
                       capture_output=True, timeout=timeout_s)
    out = p.stdout.decode(errors="replace")
    if p.returncode == 0:
        return None
    if _FAILED in out:
        raise AssertionError(out.split(_FAILED, 1)[1].strip())
    raise RuntimeError(f"check_objective: the {DEVICES}-device subprocess failed (exit code "
                       f"{p.returncode}):\n{p.stderr.decode(errors='replace')[-4000:]}")


def _main() -> None:
    import jax.numpy as jnp
    from jax.sharding import AxisType

    from rljax import testing as t
    from rljax.testing._harness import Harness, check_mesh, magnitudes, micro_outputs

    fn, coef, batches, micro_batches, rtol = pickle.loads(sys.stdin.buffer.read())
    if jax.device_count() != DEVICES:
        raise SystemExit(f"expected {DEVICES} devices, got {jax.device_count()}")
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))
    h = Harness(fn)
    try:
        for b in batches:
            b = jax.tree.map(jnp.asarray, b)
            ref = h(b, coef)
            parts = micro_outputs(h, b, coef, max(micro_batches)) if micro_batches else []
            check_mesh(h, b, coef, ref, mesh, t.float32_rtol(b) if rtol is None else rtol,
                       magnitudes(parts, ref))
    except AssertionError as e:
        print(_FAILED + str(e), flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    _main()
