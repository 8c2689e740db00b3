"""Builds, loads and registers rljax's C++ CPU kernels (``cpu_*.cc`` next to this file).

The sources are compiled on first use with the system's ``g++`` against the FFI headers
that ship with jaxlib, into ``$RLJAX_KERNEL_CACHE`` (default ``~/.cache/rljax/kernels``)
under a name that hashes the sources, jaxlib's version and the flags (compiled to a
temporary file, then renamed: a reader never sees half a library), and registered as XLA
FFI targets for the CPU platform. Where that is not possible (not x86-64 Linux with AVX2
and FMA, no ``g++``, a failed build), or with ``RLJAX_CPU_KERNELS=0`` or
:func:`set_enabled` ``(False)``, :func:`available` is False and
:func:`unavailable_reason` says why; callers then keep XLA's own ops.
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

__all__ = ["available", "set_enabled", "unavailable_reason"]

_DIR = pathlib.Path(__file__).parent
_SOURCES = ("cpu_matmul.cc",)
_HEADERS = ("cpu_common.h",)
# FFI target name -> exported handler symbol
_TARGETS = {"rljax_packed_matmul_RxN": "RljaxPackedMatmulRxN",
            "rljax_packed_matmul_NxR": "RljaxPackedMatmulNxR"}
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
    for name in _SOURCES + _HEADERS:
        h.update((_DIR / name).read_bytes())
    for part in (jaxlib.__version__, " ".join(_FLAGS)):
        h.update(part.encode())
    root = os.environ.get("RLJAX_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "rljax", "kernels"
    )
    return pathlib.Path(root) / f"rljax_cpu-{h.hexdigest()[:16]}.so"


def _build(out: pathlib.Path) -> None:
    """Compile to a temporary file in ``out``'s folder, then rename: a reader never sees a
    half-written library, and concurrent builders each rename a whole one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = ["g++", *_FLAGS, "-I", jax.ffi.include_dir(), "-I", str(_DIR),
               *(str(_DIR / name) for name in _SOURCES), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _built_library() -> pathlib.Path:
    """The library's path, built first if missing; in the temp folder when the cache
    folder cannot be written."""
    path = _library_path()
    if path.exists():
        return path
    try:
        _build(path)
        return path
    except OSError:
        path = pathlib.Path(tempfile.gettempdir()) / f"rljax-{os.getuid()}" / path.name
        if not path.exists():
            _build(path)
        return path


def _load() -> None:  # under _lock
    why = _precheck()
    if why is None:
        try:
            lib = ctypes.CDLL(str(_built_library()))
            for target, symbol in _TARGETS.items():
                jax.ffi.register_ffi_target(
                    target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _state.update(ok=True, why="", lib=lib)
            return
        except Exception as e:  # noqa: BLE001 - any failure means "use XLA's ops"
            why = f"build or load failed: {type(e).__name__}: {e}"
    _state.update(ok=False, why=why)


def available() -> bool:
    """True when the kernels are built, registered and enabled (builds them on first call).

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
    """Turn the kernels off (or back on) for programs traced from now on: to compare with
    XLA's own ops, or to rule the kernels out when a result looks wrong."""
    _state["enabled"] = bool(enabled)
