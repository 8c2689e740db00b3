import jax


def test_eight_emulated_devices(mesh8):
    assert jax.device_count() == 8
    assert mesh8.shape == {"data": 2, "fsdp": 2, "tensor": 2}


def test_persistent_cache_enabled():
    assert jax.config.jax_compilation_cache_dir
