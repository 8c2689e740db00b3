"""Test harness: 8 emulated CPU devices, quick XLA compiles, no persistent compilation cache.

XLA_FLAGS must be set before anything imports jax, so it is set at the top of the
first module pytest loads.

JAX's persistent compilation cache stays off: on jaxlib 0.10.2, an XLA:CPU program with
collectives that is loaded back from the cache lets its devices enter different
collectives (most likely its collectives lose their program order: XLA's thunk
deserialisation gave each restored collective its own communicator resource, the one
thing the executor chains them by). Every pool thread then blocks in a rendezvous, and
XLA aborts the process after 40 s ("Termination timeout for `collective permute ...`").
Measured here: the 8-device PPO test aborted 6 of 6 times when its programs came from
the cache and passed 6 of 6 times compiled fresh; the suite takes about as long without
the cache.

The suite is mostly compiling small programs, so XLA's CPU backend compiles them cheaply
(TEST_XLA_FLAGS, also given to the tests' subprocesses): the same HLO programs, every
tolerance unchanged. Benchmarks and experiments run with XLA's defaults.

| flag | what it saves (2 cores) |
|---|---|
| `--xla_llvm_disable_expensive_passes=true` | an RL run's compiles 29.6 s -> 15.8 s |
| `--xla_cpu_use_fusion_emitters=false` (the older loop emitters) | a tiny GRPO run's compiles 12.8 s -> 9.7 s |
| `--xla_backend_optimization_level=0` (LLVM -O0; default 3) | -O3 -> -O1: test_train_rl.py's compiles 31.4 s -> 24.5 s; -O1 -> -O0: test_fused_step.py + test_train_step.py 66.5 s -> 44.5 s wall (92 -> 46 CPU-s), the whole suite 978 s -> 681 s wall |
"""

import os

TEST_XLA_FLAGS = "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS, "--xla_force_host_platform_device_count=8"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(scope="session")
def mesh8():
    """A (data=2, fsdp=2, tensor=2) Auto mesh over the 8 emulated devices."""
    from jax.sharding import AxisType

    assert jax.device_count() == 8, "conftest must set XLA_FLAGS before jax is imported"
    return jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3
    )
