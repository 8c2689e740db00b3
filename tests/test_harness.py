import jax


def test_eight_emulated_devices(mesh8):
    assert jax.device_count() == 8
    assert mesh8.shape == {"data": 2, "fsdp": 2, "tensor": 2}


def test_persistent_cache_disabled():
    # Multi-device CPU programs restored from the cache lose their collective order and
    # deadlock (see conftest.py); the suite must compile them fresh.
    assert not jax.config.jax_enable_compilation_cache
