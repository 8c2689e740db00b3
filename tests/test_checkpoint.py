"""Checkpointer: sharded round trip, keep-last-K, interval, atomicity, Ctrl-C."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax.train.checkpoint import Checkpointer, abstract_like, key_from_json, key_to_json


def _state(mesh, scale=1.0):
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8) * scale, NamedSharding(mesh, P("fsdp", "tensor")))
    b = jax.device_put(jnp.ones(8) * scale, NamedSharding(mesh, P()))
    return {"params": {"w": w, "b": b}, "opt": (jnp.zeros(3), jnp.int32(7)),
            "key": jax.random.key(int(scale))}


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_sharded_keep_and_interval(tmp_path, mesh8):
    with Checkpointer(tmp_path / "ck", save_every=2, keep=2) as ck:
        for step in range(7):
            started = ck.save(step, _state(mesh8, step + 1), {"data_pos": step * 10})
            assert started == (step % 2 == 0)
        ck.wait_until_finished()
        assert ck.all_steps() == [4, 6]  # 0 and 2 rotated out, odd steps skipped
        assert ck.save(6, _state(mesh8), {}) is False  # already saved
        assert ck.save(7, _state(mesh8, 8), {"data_pos": 70}, force=True)
    with Checkpointer(tmp_path / "ck", save_every=2, keep=2) as ck:
        assert ck.latest_step() == 7
        target = abstract_like(_state(mesh8))
        state, meta = ck.restore(target)
        assert meta == {"data_pos": 70, "step": 7}
        _assert_same(state, _state(mesh8, 8))
        assert state["params"]["w"].sharding == NamedSharding(mesh8, P("fsdp", "tensor"))
        # An older step, restored into a different (replicated) layout.
        rep = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh8, P())),
            target,
        )
        state6, meta6 = ck.restore(rep, step=6)
        assert meta6["data_pos"] == 60 and ck.read_meta(6)["data_pos"] == 60
        _assert_same(state6, _state(mesh8, 7))
        assert state6["params"]["w"].sharding.spec == P()


def test_unfinished_saves_are_ignored(tmp_path, mesh8):
    with Checkpointer(tmp_path, keep=5) as ck:
        ck.save(1, _state(mesh8, 2.0), {"data_pos": 1})
    # What a kill mid-save leaves: orbax's tmp directory, or a step dir never finalised.
    os.makedirs(tmp_path / "5.orbax-checkpoint-tmp-1234" / "state")
    os.makedirs(tmp_path / "9" / "state")
    with Checkpointer(tmp_path, keep=5) as ck:
        assert ck.all_steps() == [1]
        state, meta = ck.restore(abstract_like(_state(mesh8)))
        assert meta["step"] == 1
        _assert_same(state, _state(mesh8, 2.0))
        with pytest.raises(FileNotFoundError, match="step 9"):
            ck.restore(abstract_like(_state(mesh8)), step=9)


def test_keyboard_interrupt_waits_for_pending_save(tmp_path):
    big = {"w": jnp.arange(2_000_000, dtype=jnp.float32), "step": jnp.int32(3)}
    with pytest.raises(KeyboardInterrupt):
        with Checkpointer(tmp_path, keep=2) as ck:
            ck.save(3, big, {"data_pos": 3})
            raise KeyboardInterrupt  # Ctrl-C while the async write is in flight
    with Checkpointer(tmp_path) as ck:
        state, meta = ck.restore(abstract_like(big))
        assert meta["step"] == 3
        _assert_same(state, big)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path, save_every=0)
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ck.restore({"x": jnp.zeros(2)})
        with pytest.raises(TypeError, match="JSON"):
            ck.save(0, {"x": jnp.zeros(2)}, {"bad": object()})
        with pytest.raises(ValueError, match="step"):
            ck.save(-1, {"x": jnp.zeros(2)})


def test_prng_key_json_round_trip():
    key = jax.random.split(jax.random.key(42), 3)
    back = key_from_json(key_to_json(key))
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(key))
    with pytest.raises(TypeError, match="typed PRNG key"):
        key_to_json(jnp.zeros(2, jnp.uint32))
    with pytest.raises(ValueError, match="PRNG"):
        key_from_json({"data": [1]})


def test_restore_raw_gives_pure_nnx_dicts(tmp_path):
    from flax import nnx

    from rljax.train.checkpoint import pure_params

    src = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    with Checkpointer(tmp_path) as ck:
        ck.save(2, {"params": {"policy": nnx.state(src)}, "step": jnp.int32(2)}, {"x": 1})
    with Checkpointer(tmp_path) as ck:
        raw, meta = ck.restore_raw()
        assert meta == {"x": 1, "step": 2}
        with pytest.raises(FileNotFoundError, match="step 5"):
            ck.restore_raw(5)
    dst = nnx.Linear(3, 4, rngs=nnx.Rngs(1))
    state = nnx.state(dst)
    nnx.replace_by_pure_dict(state, pure_params(raw["params"]["policy"]))
    nnx.update(dst, state)
    np.testing.assert_array_equal(np.asarray(dst.kernel[...]), np.asarray(src.kernel[...]))
