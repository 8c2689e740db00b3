"""JAX's persistent compilation cache for the one-shot commands (`rljax eval`, `sample`).

A small model's `rljax eval` spends most of its time compiling its sampling programs; a
second call with the same model and shapes reads them from this cache instead.

| setting | effect |
|---|---|
| nothing set | `$XDG_CACHE_HOME/rljax/jax` (default `~/.cache/rljax/jax`) |
| `RLJAX_COMPILE_CACHE=DIR` | that folder |
| `RLJAX_COMPILE_CACHE=0` (or `off`) | no cache |
| `JAX_COMPILATION_CACHE_DIR` set | JAX's own setting is kept |

Every program is cached, however short its compilation (a small model's are all short).
It stays off on a CPU backend with several devices (XLA_FLAGS'
`--xla_force_host_platform_device_count`): restored multi-device CPU programs deadlocked
here.
"""

from __future__ import annotations

import os
import pathlib

import jax

__all__ = ["default_cache_dir", "use_compile_cache"]

_OFF = ("0", "off", "false", "no")


def default_cache_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/rljax/jax`` (``~/.cache/rljax/jax`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "rljax" / "jax"


def use_compile_cache() -> str | None:
    """Turn JAX's persistent compilation cache on as the module docstring's table says
    (before the command compiles anything); returns its folder, or None when it stays
    off."""
    chosen = os.environ.get("RLJAX_COMPILE_CACHE", "").strip()
    if chosen.lower() in _OFF:
        return None
    if jax.default_backend() == "cpu" and jax.device_count() > 1:
        return None
    path = jax.config.jax_compilation_cache_dir or chosen or str(default_cache_dir())
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
