"""Test harness: 8 emulated CPU devices and JAX's persistent compilation cache.

XLA_FLAGS must be set before anything imports jax, so it is set at the top of the
first module pytest loads.
"""

import os
import pathlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE = pathlib.Path(
    os.environ.get("RLJAX_JAX_CACHE", pathlib.Path.home() / ".cache" / "rljax-jax")
)
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def mesh8():
    """A (data=2, fsdp=2, tensor=2) Auto mesh over the 8 emulated devices."""
    from jax.sharding import AxisType

    assert jax.device_count() == 8, "conftest must set XLA_FLAGS before jax is imported"
    return jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3
    )
