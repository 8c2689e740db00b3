"""Small-batch matmuls against pre-packed weights: a hand-written AVX2 kernel for XLA:CPU.

A decode step multiplies R = 32 rows of activations by every weight matrix of the model
and by the output projection. XLA:CPU runs those products at 25-35 GFLOP/s inside the
decode loop (the layers' dots) and ~110-125 GFLOP/s (the 32000-row output projection):
it packs the weight in every call and threads the small ones poorly. ``cpu_matmul.cc``
(next to this file) takes the weight packed once (:func:`pack_weight_NxD`,
:func:`pack_weight_DxN`) in panels of 6 output rows, runs a 6 x 16 FMA tile on the
calling thread plus XLA's intra-op pool, and writes ``y_RxN`` (:func:`matmul_RxN`, a
linear layer) or ``y_NxR`` with its per-row max (:func:`matmul_NxR`, the sampler's
vocab-major head), and optionally the softmax's block sums for the sampler's inverse-CDF
draw (:func:`softmax_block_sums`), taken while the logits are still in cache.

The source is compiled on first use with the system's ``g++`` against the FFI headers
that ship with jaxlib, into ``$RLJAX_KERNEL_CACHE`` (default ``~/.cache/rljax/kernels``)
under a name that hashes the source, jaxlib's version and the flags, and registered as
XLA FFI targets for the CPU platform. Where that is not possible (not x86-64 Linux with
AVX2 and FMA, no ``g++``, a failed build), or with ``RLJAX_CPU_KERNELS=0`` or
:func:`set_enabled` ``(False)``, :func:`available` is False and says why in
:func:`unavailable_reason`; callers then keep XLA's dot. Float32 only.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "PANEL",
    "available",
    "matmul_NxR",
    "matmul_RxN",
    "pack_weight_DxN",
    "pack_weight_NxD",
    "set_enabled",
    "softmax_block_sums",
    "unavailable_reason",
]

PANEL = 6  # output rows per packed panel (the kernel's tile height)
_TARGETS = {"rljax_packed_matmul_RxN": "RljaxPackedMatmulRxN",
            "rljax_packed_matmul_NxR": "RljaxPackedMatmulNxR"}
_SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")
_FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread")

_lock = threading.Lock()
_state: dict = {"enabled": True}  # + "ok": bool, "why": str, "lib": the loaded library


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _precheck() -> str | None:
    if os.environ.get("RLJAX_CPU_KERNELS", "1") == "0":
        return "disabled by RLJAX_CPU_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return f"the CPU lacks {sorted(missing)}"
    if shutil.which("g++") is None:
        return "no g++ on PATH"
    return None


def _library_path() -> pathlib.Path:
    import jaxlib

    h = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(_FLAGS).encode()):
        h.update(part)
    root = os.environ.get("RLJAX_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "rljax", "kernels"
    )
    return pathlib.Path(root) / f"cpu_matmul-{h.hexdigest()[:16]}.so"


def _build(out: pathlib.Path) -> None:
    """Compile to a temporary file in ``out``'s folder, then rename: a reader never sees a
    half-written library, and concurrent builders each rename a whole one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = ["g++", *_FLAGS, "-I", jax.ffi.include_dir(), str(_SOURCE), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> None:  # under _lock
    why = _precheck()
    if why is None:
        try:
            path = _library_path()
            if not path.exists():
                _build(path)
            lib = ctypes.CDLL(str(path))
            for target, symbol in _TARGETS.items():
                jax.ffi.register_ffi_target(
                    target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _state.update(ok=True, why="", lib=lib)
            return
        except Exception as e:  # noqa: BLE001 - any failure means "use XLA's dot"
            why = f"build or load failed: {type(e).__name__}: {e}"
    _state.update(ok=False, why=why)


def available() -> bool:
    """True when the kernel is built, registered and enabled (builds it on the first call).

    Callers decide at trace time: a program compiled while it was True keeps using it.
    """
    with _lock:
        if "ok" not in _state:
            _load()
    return _state["ok"] and _state["enabled"]


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    if available():
        return ""
    return _state["why"] or "disabled by set_enabled(False)"


def set_enabled(enabled: bool) -> None:
    """Turn the kernel off (or back on) for programs traced from now on: to compare with
    XLA's dot, or to rule the kernel out when a result looks wrong."""
    _state["enabled"] = bool(enabled)


def _check_weight(name, w):
    if w.ndim != 2 or w.dtype != jnp.float32:
        raise ValueError(f"{name}: needs a float32 rank-2 weight, got {w.dtype}{tuple(w.shape)}")


def pack_weight_NxD(w_NxD: jax.Array) -> jax.Array:
    """A weight stored ``[N, D]`` (output rows first, like an embedding used as the
    output projection) as the kernel's panels ``[ceil(N/6), D, 6]``, zero rows past N."""
    _check_weight("pack_weight_NxD", w_NxD)
    n, d = w_NxD.shape
    p = -(-n // PANEL)
    return jnp.pad(w_NxD, ((0, p * PANEL - n), (0, 0))).reshape(p, PANEL, d).transpose(0, 2, 1)


def pack_weight_DxN(w_DxN: jax.Array) -> jax.Array:
    """A weight stored ``[D, N]`` (inputs first: ``y = x @ w``) as the kernel's panels
    ``[ceil(N/6), D, 6]``, zero rows past N."""
    _check_weight("pack_weight_DxN", w_DxN)
    d, n = w_DxN.shape
    p = -(-n // PANEL)
    return jnp.pad(w_DxN, ((0, 0), (0, p * PANEL - n))).reshape(d, p, PANEL).transpose(1, 0, 2)


def _check_call(wp, n, h_RxD):
    if not available():
        raise RuntimeError(f"rljax.kernels.cpu_matmul is unavailable: {unavailable_reason()}")
    if wp.ndim != 3 or wp.shape[2] != PANEL or wp.shape[0] != -(-n // PANEL):
        raise ValueError(f"packed weight {tuple(wp.shape)} is not [ceil({n}/{PANEL}), D, "
                         f"{PANEL}]")
    if h_RxD.ndim != 2 or h_RxD.shape[1] != wp.shape[1]:
        raise ValueError(f"activations {tuple(h_RxD.shape)} are not [R, {wp.shape[1]}]")
    return h_RxD.astype(jnp.float32)


def matmul_RxN(h_RxD: jax.Array, wp: jax.Array, n: int) -> jax.Array:
    """``y_RxN = h_RxD @ W^T`` (float32) with ``wp`` the packed ``W`` (N output rows).
    A CPU custom call: raises RuntimeError unless :func:`available`."""
    h = _check_call(wp, n, h_RxD)
    out = jax.ShapeDtypeStruct((h.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call("rljax_packed_matmul_RxN", out)(wp, h)


def matmul_NxR(h_RxD: jax.Array, wp: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """``(y_NxR, max_R)``: ``y = W . h^T`` laid out output-major, and its max over N per
    row (NaN if any entry is NaN). Raises RuntimeError unless :func:`available`."""
    y, m, _ = softmax_block_sums(h_RxD, wp, n, 0)
    return y, m


def softmax_block_sums(h_RxD: jax.Array, wp: jax.Array, n: int, block: int,
                       temperature: float = 1.0):
    """:func:`matmul_NxR` plus the sums of ``exp((y - max) / temperature)`` over blocks of
    ``block`` consecutive outputs (the last may be shorter): ``(y_NxR, max_R, sums)``,
    sums ``[ceil(n / block), R]`` (``[0, R]`` for ``block=0``). Each block's sum is taken
    relative to the max of the rows in cache at the time, then rescaled: equal to the
    sums of the exps to float32 rounding (``exp`` itself is within 2 ulp of XLA's)."""
    if not isinstance(block, int) or block < 0:
        raise ValueError(f"block must be an int >= 0, got {block!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    h = _check_call(wp, n, h_RxD)
    r = h.shape[0]
    nb = -(-n // block) if block else 0
    out = (jax.ShapeDtypeStruct((n, r), jnp.float32), jax.ShapeDtypeStruct((r,), jnp.float32),
           jax.ShapeDtypeStruct((nb, r), jnp.float32))
    call = jax.ffi.ffi_call("rljax_packed_matmul_NxR", out)
    return call(wp, h, block=np.int64(block), inv_temperature=np.float32(1.0 / temperature))
