"""Decoder invariances: KV cache vs full forward, padding, GQA ratios, sharded vs single."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, Llama3RopeScaling, ModelConfig, kv_cache_shardings
from rljax.models.layers import MATMUL_WEIGHTS, cast_matmul_weights
from rljax.sharding import MeshConfig, batch_sharding, make_mesh, state_shardings

TOL = 1e-5  # float32 invariances (same math, different batching / caching)

BASE = ModelConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=500.0,
)
QWEN3 = dataclasses.replace(BASE, head_dim=16, qk_norm=True, architecture="qwen3",
                            num_kv_heads=1, tie_word_embeddings=True)
QWEN2 = dataclasses.replace(BASE, qkv_bias=True, architecture="qwen2", num_kv_heads=4)


def _model(cfg, seed=0):
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    if cfg.qkv_bias:  # zero-initialised biases would not test anything
        for layer in model.layers:
            for name in ("q_bias", "k_bias", "v_bias"):
                p = getattr(layer.attn, name)
                p[...] = 0.1 * jax.random.normal(jax.random.key(seed + 7), p[...].shape)
    return model


@nnx.jit
def _full(model, ids, pos, mask):
    return model(ids, pos, mask)


@nnx.jit
def _default(model, ids, mask=None):
    return model(ids, mask_BxT=mask)


@nnx.jit(static_argnums=(4, 5))
def _cached_run(model, ids, pos, mask, prompt_len, max_len):
    """Prefill the first `prompt_len` tokens, then decode the rest one at a time."""
    cache = model.init_cache(ids.shape[0], max_len)
    h, cache = model.forward_cached(ids[:, :prompt_len], pos[:, :prompt_len],
                                    mask[:, :prompt_len], cache, 0)
    outs = [model.logits_from_hidden(h)]
    for t in range(prompt_len, ids.shape[1]):
        h, cache = model.forward_cached(ids[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1],
                                        cache, t)
        outs.append(model.logits_from_hidden(h))
    return jnp.concatenate(outs, axis=1)


def _left_padded(rng, lens, t, vocab):
    ids = np.zeros((len(lens), t), np.int32)
    mask = np.zeros((len(lens), t), bool)
    for b, n in enumerate(lens):
        ids[b, t - n:] = rng.integers(1, vocab, n)
        mask[b, t - n:] = True
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.parametrize("cfg", [BASE, QWEN3, QWEN2], ids=["llama", "qwen3", "qwen2"])
def test_cached_prefill_decode_equals_full_forward(cfg):
    model = _model(cfg)
    rng = np.random.default_rng(0)
    ids, mask = _left_padded(rng, [9, 6, 3], 9, cfg.vocab_size)
    pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    full = _full(model, ids, pos, mask)
    # prompt of 5 padded slots, 4 decode steps, cache longer than needed (stale slots)
    cached = _cached_run(model, ids, pos, mask, 5, 12)
    m = np.asarray(mask)
    np.testing.assert_array_less(np.abs(np.asarray(full - cached))[m], TOL)


@pytest.mark.parametrize("cfg", [BASE, QWEN3], ids=["llama", "qwen3"])
def test_left_padded_batch_equals_rows_alone(cfg):
    model = _model(cfg, seed=1)
    rng = np.random.default_rng(1)
    ids, mask = _left_padded(rng, [7, 4, 1], 7, cfg.vocab_size)
    batch = _default(model, ids, mask)  # default positions from the mask
    for b, n in enumerate([7, 4, 1]):
        alone = _default(model, ids[b:b + 1, 7 - n:])
        diff = np.abs(np.asarray(batch[b, 7 - n:] - alone[0]))
        assert diff.max() <= TOL, (b, diff.max())


def test_right_padding_and_positions_shift():
    model = _model(BASE, seed=2)
    ids = jnp.asarray([[5, 6, 7, 0, 0]], jnp.int32)
    mask = jnp.asarray([[1, 1, 1, 0, 0]], bool)
    right = _default(model, ids, mask)[0, :3]
    alone = model(ids[:, :3])[0]  # eager call on a plain int32 array works too
    assert np.abs(np.asarray(right - alone)).max() <= TOL
    # RoPE makes attention depend only on relative positions: shifting all positions by a
    # constant leaves the logits unchanged (up to float32 rounding of the angles).
    pos = jnp.arange(3)[None] + 11
    shifted = _full(model, ids[:, :3], pos, jnp.ones((1, 3), bool))[0]
    assert np.abs(np.asarray(shifted - alone)).max() <= 1e-4
    # ... while the tokens' order matters (the test can fail).
    assert np.abs(np.asarray(_default(model, ids[:, 2::-1])[0, -1] - alone[-1])).max() > 1e-3


def test_tied_and_hidden_states_projection():
    model = _model(QWEN3)
    ids = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    h = nnx.jit(lambda m, i: m.hidden_states(i))(model, ids)
    assert h.shape == (1, 4, QWEN3.hidden_size) and h.dtype == jnp.float32
    logits = model.logits_from_hidden(h)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(_default(model, ids)), atol=TOL)
    np.testing.assert_allclose(
        np.asarray(logits), np.asarray(h @ model.embed[...].T), atol=1e-5
    )
    assert not hasattr(model, "lm_head")


def test_bfloat16_compute_keeps_float32_params_and_logits():
    cfg = dataclasses.replace(BASE, compute_dtype="bfloat16")
    m16, m32 = _model(cfg), _model(BASE)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(m16, nnx.Param)))
    ids = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    l16, l32 = _default(m16, ids), _default(m32, ids)
    assert l16.dtype == jnp.float32
    assert m16.init_cache(1, 4).keys[0].dtype == jnp.bfloat16
    assert 0 < np.abs(np.asarray(l16 - l32)).max() < 5e-2


@pytest.mark.parametrize("cfg", [QWEN2, QWEN3], ids=["qwen2-untied", "qwen3-tied"])
def test_matmul_weights_cast_to_compute_dtype_compute_the_same(cfg):
    # The sampler's inference copy: q/k/v/o, gate/up/down and lm_head in bfloat16, the
    # rest float32; the forward and the cached decode are bitwise those of the original.
    cfg = dataclasses.replace(cfg, compute_dtype="bfloat16")
    graphdef, state = nnx.split(_model(cfg))
    # Norm scales off 1 (they must stay float32: the residual stream is float32).
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: x * (1 + 0.1 * jax.random.normal(jax.random.key(len(p)), x.shape))
        if "scale" in str(p) else x, state)
    cast = cast_matmul_weights(state, jnp.bfloat16)
    dtypes = {"/".join(str(k) for k in path): v.get_value().dtype
              for path, v in nnx.to_flat_state(cast)}
    for path, dtype in dtypes.items():
        name = path.split("/")[-1]
        want = jnp.bfloat16 if name in MATMUL_WEIGHTS else jnp.float32
        assert dtype == want, (path, dtype)
    assert any(d == jnp.bfloat16 for d in dtypes.values())
    assert cast_matmul_weights(state, jnp.float32) is state
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)
    a, b = nnx.merge(graphdef, state), nnx.merge(graphdef, cast)
    np.testing.assert_array_equal(_default(a, ids), _default(b, ids))
    pos, mask = jnp.arange(6)[None], jnp.ones((1, 6), bool)
    ha, _ = a.forward_cached(ids, pos, mask, a.init_cache(1, 8), 0)
    hb, _ = b.forward_cached(ids, pos, mask, b.init_cache(1, 8), 0)
    np.testing.assert_array_equal(ha, hb)


def test_llama3_rope_scaling_changes_long_range_only():
    sc = Llama3RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=16)
    from rljax.models import rope_inv_freq
    plain = rope_inv_freq(BASE)
    scaled = rope_inv_freq(dataclasses.replace(BASE, rope_scaling=sc))
    wavelen = 2 * np.pi / plain
    np.testing.assert_array_equal(scaled[wavelen < 4], plain[wavelen < 4])
    np.testing.assert_allclose(scaled[wavelen > 16], plain[wavelen > 16] / 4, rtol=1e-6)
    assert np.any(scaled != plain)


def test_sharded_model_matches_single_device(mesh8):
    cfg = QWEN2
    single = _model(cfg, seed=3)
    rng = np.random.default_rng(3)
    ids, mask = _left_padded(rng, [6, 2, 5, 6], 6, cfg.vocab_size)
    pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    ref = _full(single, ids, pos, mask)
    graphdef, state = nnx.split(single)
    with jax.set_mesh(mesh8):
        shardings = state_shardings(state, mesh8)
        state8 = jax.device_put(state, shardings)
        q = state8["layers"][0]["attn"]["q"][...]
        assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
        bs = batch_sharding(mesh8, 2)
        fwd = jax.jit(lambda s, i, p, m: nnx.merge(graphdef, s)(i, p, m),
                      in_shardings=(shardings, bs, bs, bs))
        out = fwd(state8, ids, pos, mask)
        cache = single.init_cache(4, 8)
        cs = kv_cache_shardings(cache, mesh8)
        assert cs.keys[0].spec == jax.sharding.PartitionSpec(("data", "fsdp"), "tensor", None,
                                                              None)
    assert np.abs(np.asarray(out - ref))[np.asarray(mask)].max() <= TOL


def test_build_under_mesh_and_bad_input(mesh8):
    with jax.set_mesh(mesh8):
        model = Decoder(BASE, rngs=nnx.Rngs(0))
    assert model.embed[...].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp") or \
        model.embed[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    with pytest.raises(ValueError, match="input_ids_BxT"):
        model(jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="mask_BxT"):
        model(jnp.zeros((1, 3), jnp.int32), mask_BxT=jnp.ones((1, 4), bool))
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(BASE, num_kv_heads=3)
    with pytest.raises(ValueError, match="compute_dtype"):
        dataclasses.replace(BASE, compute_dtype="float16")
    with pytest.raises(ValueError, match="architecture"):
        dataclasses.replace(BASE, architecture="gpt2")
    with pytest.raises(ValueError, match="MeshConfig"):
        make_mesh(MeshConfig(data=3, fsdp=-1))
    with pytest.raises(ValueError, match="more than one"):
        MeshConfig(data=-1, fsdp=-1)
    assert make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2)).shape == {
        "data": 2, "fsdp": 2, "tensor": 2}


def _swiglu(x_BxTxD, w, matmul):
    g, u = matmul(x_BxTxD, w["gate"]), matmul(x_BxTxD, w["up"])
    return matmul(jax.nn.silu(g) * u, w["down"])


def test_dense_equals_the_einsum_and_its_backward_copies_no_activation_gradient():
    """`rljax.models.layers.dense` (the decoder's projections) equals the `[B, T, D]`
    einsum in value and gradient; compiled, the MLP's backward writes no transposed
    `[F, tokens]` copy of an activation gradient, which the einsum's does (the control)."""
    from rljax.models.layers import dense

    b, t, d, f = 4, 6, 8, 32
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (b, t, d))
    w = {"gate": jax.random.normal(ks[1], (d, f)), "up": jax.random.normal(ks[2], (d, f)),
         "down": jax.random.normal(ks[3], (f, d))}
    einsum = lambda a, m: jnp.einsum("btk,kn->btn", a, m)  # noqa: E731
    grads = {}
    for name, mm in (("dense", dense), ("einsum", einsum)):
        fn = jax.jit(jax.value_and_grad(lambda w, x: jnp.sum(_swiglu(x, w, mm) ** 2)))
        grads[name] = fn(w, x)
        hlo = fn.lower(w, x).compile().as_text()
        transposed = [s for s in (f"f32[{f},{b * t}]", f"f32[{f},{b},{t}]") if s in hlo]
        assert bool(transposed) == (name == "einsum"), (name, transposed)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5),
                 grads["dense"], grads["einsum"])
    o_BxTxNxH = jax.random.normal(ks[0], (b, t, 2, 4))
    np.testing.assert_allclose(dense(o_BxTxNxH, w["gate"].reshape(2, 4, f), contract=2),
                               jnp.einsum("btnh,nhf->btf", o_BxTxNxH, w["gate"].reshape(2, 4, f)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"dense: x\(4, 6, 8\)'s last 1 axes do not match"):
        dense(x, w["down"])
