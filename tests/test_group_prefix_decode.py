"""The sampler's shared prompt cache: G rows read one copy of their prompt's keys/values.

`attend_group_prefix` equals `attend` over each row's prompt + own keys;
`Decoder.forward_cached(..., prefix=)` equals decoding against a cache with the prompt
copied into every row (loop and scanned layers); on 8 devices each chip keeps the
prompt copy its rows read. The sampler's results are checked in
tests/test_sampling_generate.py (cache vs full forward, 8 devices vs one).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, KVCache, ModelConfig
from rljax.models.attention import attend, attend_group_prefix
from rljax.sampling.generate import prepare
from rljax.sampling import generate, sampler as sampler_mod
from rljax.sharding import state_shardings

CFG = ModelConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=500.0, qkv_bias=True, architecture="qwen2",
    max_position_embeddings=128,
)


@pytest.mark.parametrize("c, t", [(2, 1), (4, 1), (2, 3), (8, 1)])
def test_attend_group_prefix_equals_attend_over_prompt_plus_own(c, t):
    b, n, k, h, p, s = 8, 4, 2, 8, 5, 6
    ks = jax.random.split(jax.random.key(c * 10 + t), 7)
    q = jax.random.normal(ks[0], (b, t, n, h))
    pk, pv = jax.random.normal(ks[1], (c, k, h, p)), jax.random.normal(ks[2], (c, k, p, h))
    ok, ov = jax.random.normal(ks[3], (b, k, h, s)), jax.random.normal(ks[4], (b, k, s, h))
    pvalid = jax.random.bernoulli(ks[5], 0.7, (c, p)).at[:, -1].set(True)
    own = jax.random.bernoulli(ks[6], 0.6, (b, t, s)).at[:, :, 0].set(True)
    out = attend_group_prefix(q, pk, pv, pvalid, ok, ov, own)
    rep = lambda x: jnp.repeat(x, b // c, axis=0)
    keys = jnp.concatenate([rep(pk), ok], axis=3)
    values = jnp.concatenate([rep(pv), ov], axis=2)
    allowed = jnp.concatenate([jnp.broadcast_to(rep(pvalid)[:, None], (b, t, p)), own], axis=2)
    np.testing.assert_allclose(out, attend(q, keys, values, allowed), atol=1e-5, rtol=1e-5)


def _decode_both_ways(model, g: int, steps: int):
    """Hidden states of `steps` decode tokens per row: against a shared prefix + own
    cache, and against one cache per row holding a copy of the prompt."""
    n, p = 2, 6
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, CFG.vocab_size, (n, p)), jnp.int32)
    mask = jnp.asarray([[False, False, True, True, True, True], [True] * p])
    pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    _, prefix = model.forward_cached(ids, pos, mask, model.init_cache(n, p), 0)
    full = _with_prompt(model.init_cache(n * g, p + steps), prefix, g)
    own = model.init_cache(n * g, steps)
    toks = jnp.asarray(rng.integers(1, CFG.vocab_size, (n * g, steps)), jnp.int32)
    plen = jnp.repeat(jnp.sum(mask, axis=1), g)
    ones = jnp.ones((n * g, 1), bool)
    shared, copied = [], []
    # One compiled decode step per layout (the slot a traced scalar), as the sampler runs it.
    step = nnx.jit(lambda m, *a, **kw: m.forward_cached(*a, **kw))
    for i in range(steps):
        x, xp = toks[:, i:i + 1], (plen + i)[:, None]
        h, own = step(model, x, xp, ones, own, jnp.int32(i), prefix=prefix)
        hf, full = step(model, x, xp, ones, full, jnp.int32(p + i))
        shared.append(h)
        copied.append(hf)
    return jnp.concatenate(shared, 1), jnp.concatenate(copied, 1)


def _with_prompt(full: KVCache, prefix: KVCache, g: int) -> KVCache:
    """`full` with the prompt's keys / values (each prompt's row `g` times) in its first slots."""
    p = prefix.max_len

    def put(dst, src, axis):
        src = jnp.repeat(src, g, axis=src.ndim - 4)
        return jax.lax.dynamic_update_slice_in_dim(dst, src.astype(dst.dtype), 0, axis)

    return KVCache(keys=jax.tree.map(lambda d, s: put(d, s, d.ndim - 1), full.keys, prefix.keys),
                   values=jax.tree.map(lambda d, s: put(d, s, d.ndim - 2), full.values,
                                       prefix.values),
                   valid_BxS=full.valid_BxS.at[:, :p].set(jnp.repeat(prefix.valid_BxS, g, 0)))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decode_against_shared_prompt_equals_copied_prompt(scan_layers):
    model = Decoder(dataclasses.replace(CFG, scan_layers=scan_layers), rngs=nnx.Rngs(1))
    shared, copied = _decode_both_ways(model, g=3, steps=4)
    np.testing.assert_allclose(shared, copied, atol=1e-5, rtol=1e-5)


def test_prefix_must_divide_the_rows():
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    ones = jnp.ones((6, 1), bool)
    args = (jnp.ones((6, 1), jnp.int32), jnp.zeros((6, 1), jnp.int32), ones,
            model.init_cache(6, 4), 0)
    with pytest.raises(ValueError, match="prefix of 4 rows does not divide the 6 rows"):
        model.forward_cached(*args, prefix=model.init_cache(4, 3))
    with pytest.raises(TypeError, match="prefix must be a KVCache"):
        model.forward_cached(*args, prefix=(1, 2))


def test_each_chip_keeps_the_prompt_copy_its_rows_read(mesh8):
    # 2 prompts x G = 4 on 4 batch shards (data 2 x fsdp 2): each prompt's cache twice,
    # one copy a shard; the draws equal the one-device sampler's.
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    prompts, kw = [[5, 9, 2], [11]], dict(max_new_tokens=20, num_samples=4, top_k=20)
    batch, spec = prepare(CFG, prompts, **kw)
    ref = generate(model, prompts, key=jax.random.key(2), **kw)
    with jax.set_mesh(mesh8):
        state8 = jax.device_put(state, state_shardings(state, mesh8))
        arrays = [jax.device_put(x, sampler_mod.logical_sharding(("batch", None), x.shape, mesh8))
                  for x in (batch.tokens_BxP, batch.mask_BxP, batch.positions_BxP)]
        _, prefix, _ = sampler_mod._prefill(graphdef, spec, mesh8, state8, None, *arrays,
                                            jax.random.key(0))
        res = generate((graphdef, state8), prompts, key=jax.random.key(2), **kw)
    keys = prefix.keys[0]
    assert keys.shape[0] == 4, keys.shape  # 2 prompts x 2 copies
    assert keys.sharding.shard_shape(keys.shape)[0] == 1
    np.testing.assert_array_equal(np.asarray(keys[0::2]), np.asarray(keys[1::2]))
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(res.logprobs), np.asarray(ref.logprobs), atol=1e-5)
