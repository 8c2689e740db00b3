"""Sampler invariances: cache vs full forward, greedy vs a no-cache loop, padding,
log-probs vs a fresh forward, groups, stop ids, early stop, bucketing, 8 devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, ModelConfig, grow_kv_cache
from rljax.sampling import (
    SamplingParams,
    compiled_count,
    filter_logits,
    generate,
    pack_prompts,
)
from rljax.sampling import sampler as sampler_mod
from rljax.sharding import state_shardings

TOL = 1e-5  # float32: same math, cached vs uncached / batched vs alone

CFG = ModelConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=500.0, qkv_bias=True, architecture="qwen2",
    max_position_embeddings=128,
)
PROMPTS = [[5, 9, 2, 33, 7], [11], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 12], [3, 3]]


@pytest.fixture(scope="module")
def model():
    m = Decoder(CFG, rngs=nnx.Rngs(0))
    for layer in m.layers:  # zero-initialised biases would not test anything
        for name in ("q_bias", "k_bias", "v_bias"):
            p = getattr(layer.attn, name)
            p[...] = 0.1 * jax.random.normal(jax.random.key(7), p[...].shape)
    return m


@nnx.jit
def _full_logits(model, ids, mask, pos):
    return model(ids, pos, mask)


def _fresh_logits(model, res):
    """Full-forward logits predicting each completion token: ``[R, N, V]``."""
    ids, mask, pos = res.sequences()
    logits = _full_logits(model, ids, mask, pos)
    p = res.prompt_tokens.shape[1]
    return np.asarray(logits[:, p - 1 : -1])


def _log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))


def test_cached_decode_logits_equal_full_forward(model):
    """The sampler's call pattern (left-padded prefill at slot 0, then one token per slot
    P + t - 1 at position len + t - 1) gives the full forward's logits."""
    n = 5
    batch = pack_prompts(PROMPTS, vocab_size=CFG.vocab_size, length_multiple=16,
                          max_prompt_len=64)
    b, p = batch.tokens_BxP.shape
    cont = np.random.default_rng(0).integers(0, CFG.vocab_size, (b, n)).astype(np.int32)

    @nnx.jit
    def cached(model, tok, mask, pos, cont):
        cache = model.init_cache(b, p + n - 1)
        h, cache = model.forward_cached(tok, pos, mask, cache, 0)
        out = [model.logits_from_hidden(h[:, -1])]
        plen = jnp.sum(mask, axis=1)
        for t in range(n - 1):
            h, cache = model.forward_cached(cont[:, t : t + 1], (plen + t)[:, None],
                                            jnp.ones((b, 1), bool), cache, p + t)
            out.append(model.logits_from_hidden(h[:, 0]))
        return jnp.stack(out, axis=1)

    got = cached(model, batch.tokens_BxP, batch.mask_BxP, batch.positions_BxP, cont)
    ids = np.concatenate([batch.tokens_BxP, cont], axis=1)
    mask = np.concatenate([batch.mask_BxP, np.ones((b, n), bool)], axis=1)
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ref = _full_logits(model, ids, mask, pos)[:, p - 1 : -1]
    assert np.abs(np.asarray(got - ref)).max() <= TOL


def test_greedy_equals_plain_argmax_loop(model):
    n = 8
    res = generate(model, PROMPTS, key=jax.random.key(0), max_new_tokens=n, temperature=0.0)
    width = max(map(len, PROMPTS)) + n
    for i, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for _ in range(n):  # no cache: a full forward over the right-padded sequence
            ids = np.zeros((1, width), np.int32)
            ids[0, : len(seq)] = seq
            mask = np.arange(width)[None] < len(seq)
            logits = _full_logits(model, ids, mask, np.maximum(np.cumsum(mask, 1) - 1, 0))
            seq.append(int(np.argmax(np.asarray(logits[0, len(seq) - 1]))))
        np.testing.assert_array_equal(np.asarray(res.tokens[i]), seq[len(prompt):])
    assert np.asarray(res.completion_mask).all() and np.asarray(res.truncated).all()
    np.testing.assert_array_equal(np.asarray(res.sampling_logprobs), 0.0)


def test_greedy_alone_equals_inside_padded_batch(model):
    kw = dict(key=jax.random.key(1), max_new_tokens=6, temperature=0.0)
    batch = generate(model, PROMPTS + [list(range(1, 21))], **kw)  # 20 tokens: bucket 32
    assert batch.prompt_tokens.shape[1] == 32
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], **kw)
        assert alone.prompt_tokens.shape[1] == 16
        np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(batch.tokens[i]))
        np.testing.assert_allclose(np.asarray(alone.logprobs[0]), np.asarray(batch.logprobs[i]),
                                   atol=TOL)


@pytest.mark.parametrize(
    "settings", [dict(), dict(temperature=0.7, top_k=10, top_p=0.9)], ids=["T1", "T.7k10p.9"]
)
def test_sampled_logprobs_equal_fresh_forward(model, settings):
    res = generate(model, PROMPTS, key=jax.random.key(2), max_new_tokens=7, num_samples=2,
                   **settings)
    logits = _fresh_logits(model, res)
    tok = np.asarray(res.tokens)
    pick = lambda lp: np.take_along_axis(lp, tok[..., None], axis=-1)[..., 0]  # noqa: E731
    np.testing.assert_allclose(np.asarray(res.logprobs), pick(_log_softmax(logits)), atol=TOL)
    filt = filter_logits(jnp.asarray(logits.reshape(-1, CFG.vocab_size)),
                         SamplingParams(**settings))
    ref = pick(_log_softmax(np.asarray(filt).reshape(logits.shape)))
    assert np.isfinite(ref).all(), "a sampled token lies outside the filtered support"
    np.testing.assert_allclose(np.asarray(res.sampling_logprobs), ref, atol=TOL)


def test_decode_phases_change_cost_not_results(model):
    """Three phases (caches of 34, 52, then 70 slots) draw what one 70-slot loop draws,
    and the log-probs still equal a fresh forward's."""
    assert sampler_mod.plan_phases(16, 55, 70, 3) == ((19, 34), (37, 52), (55, 70))
    assert sampler_mod.plan_phases(16, 20, 35, 4) == ((20, 35),)  # < 2 x 16 steps: one loop
    kw = dict(key=jax.random.key(3), max_new_tokens=55, num_samples=2, temperature=0.9)
    one = generate(model, PROMPTS, decode_phases=1, **kw)
    three = generate(model, PROMPTS, decode_phases=3, **kw)
    for name in ("tokens", "completion_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(one, name), getattr(three, name), err_msg=name)
    for name in ("logprobs", "sampling_logprobs"):
        np.testing.assert_allclose(getattr(one, name), getattr(three, name), atol=TOL)
    cache = model.init_cache(2, 8)
    grown = grow_kv_cache(cache, 11)
    assert grown.max_len == 11 and not bool(grown.valid_BxS[:, 8:].any())
    for bad in (7, 9.0, "11"):
        with pytest.raises(ValueError, match="grow_kv_cache"):
            grow_kv_cache(cache, bad)
    pick = np.take_along_axis(_log_softmax(_fresh_logits(model, three)),
                              np.asarray(three.tokens)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(three.logprobs), pick, atol=TOL)


def test_groups_share_the_prompt_and_differ_when_sampling(model):
    g = 4
    res = generate(model, PROMPTS, key=jax.random.key(3), max_new_tokens=6, num_samples=g)
    r = len(PROMPTS) * g
    assert res.tokens.shape == (r, 6)
    np.testing.assert_array_equal(np.asarray(res.prompt_index), np.repeat(np.arange(4), g))
    pt = np.asarray(res.prompt_tokens).reshape(4, g, -1)
    assert (pt == pt[:, :1]).all()
    toks = np.asarray(res.tokens).reshape(4, g, 6)
    assert all(len({tuple(t) for t in toks[b]}) > 1 for b in range(4))
    greedy = generate(model, PROMPTS, key=jax.random.key(3), max_new_tokens=6, num_samples=g,
                      temperature=0.0)
    gt = np.asarray(greedy.tokens).reshape(4, g, 6)
    assert (gt == gt[:, :1]).all()


def test_stop_ids_mask_and_lengths(model):
    kw = dict(key=jax.random.key(4), max_new_tokens=8, num_samples=2)
    free = np.asarray(generate(model, PROMPTS, **kw).tokens)
    stops = (int(free[0, 2]), int(free[3, 4]))
    res = generate(model, PROMPTS, stop_ids=stops, pad_id=60, **kw)
    tok, mask = np.asarray(res.tokens), np.asarray(res.completion_mask)
    for r in range(free.shape[0]):
        hits = [j for j in range(8) if free[r, j] in stops]
        length = hits[0] + 1 if hits else 8
        np.testing.assert_array_equal(tok[r, :length], free[r, :length])
        assert (tok[r, length:] == 60).all()
        assert mask[r].sum() == length and mask[r, :length].all()
        assert int(res.lengths[r]) == length and bool(res.truncated[r]) == (not hits)
        assert (np.asarray(res.logprobs)[r, length:] == 0).all()
    assert int(res.lengths[0]) <= 3


def test_decode_loop_stops_early_once_every_row_stopped(model):
    """Every id a stop id: each row stops after its first token; the loop runs no step."""
    batch = pack_prompts(PROMPTS, vocab_size=CFG.vocab_size, length_multiple=16,
                          max_prompt_len=64)
    n = 50
    phases = sampler_mod.plan_phases(16, n, 16 + n - 1, 4)
    assert len(phases) == 3  # the early stop holds across decode phases too
    spec = sampler_mod.DecodeSpec(SamplingParams(), tuple(range(CFG.vocab_size)), 1, n,
                                  phases, 0)
    graphdef, state = nnx.split(model)
    s, cache, _ = sampler_mod._prefill(graphdef, spec, None, state, None, batch.tokens_BxP,
                                       batch.mask_BxP, batch.positions_BxP, jax.random.key(5))
    s = sampler_mod._decode(graphdef, spec, None, state, None, s, cache)
    assert int(s.step) == 1 and np.asarray(s.lengths_R).tolist() == [1] * 4
    spec_half = dataclasses.replace(spec, stop_ids=(int(s.tokens_RxN[0, 0]),))
    s2, cache2, _ = sampler_mod._prefill(graphdef, spec_half, None, state, None,
                                         batch.tokens_BxP, batch.mask_BxP,
                                         batch.positions_BxP, jax.random.key(5))
    s2 = sampler_mod._decode(graphdef, spec_half, None, state, None, s2, cache2)
    lengths = np.asarray(s2.lengths_R)
    assert lengths[0] == 1 and lengths.max() > 1
    assert int(s2.step) == lengths.max()  # ran exactly until the last row stopped (or N)


def test_no_recompilation_within_a_bucket(model):
    kw = dict(max_new_tokens=5, num_samples=2, top_p=0.95)
    generate(model, [[1, 2, 3], [4, 5]], key=jax.random.key(0), **kw)
    before = compiled_count()
    for i, prompts in enumerate([[[7] * 16, [1]], [[9, 8, 7, 6], [5] * 10], [[2], [3]]]):
        res = generate(model, prompts, key=jax.random.key(i + 1), **kw)
        assert res.prompt_tokens.shape == (4, 16)
    assert compiled_count() == before
    generate(model, [[1] * 17, [2]], key=jax.random.key(9), **kw)  # next bucket: compiles
    assert compiled_count() == before + 2


def test_state_pair_and_eight_devices_equal_one_device(model, mesh8):
    # 34 new tokens: two decode phases, so the grown cache is resharded too.
    kw = dict(key=jax.random.key(6), max_new_tokens=34, num_samples=2, top_k=20)
    ref = generate(model, PROMPTS, **kw)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh8):
        state8 = jax.device_put(state, state_shardings(state, mesh8))
        res = generate((graphdef, state8), PROMPTS, **kw)
    spec = res.tokens.sharding.spec
    assert spec[0] == ("data", "fsdp"), spec
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
    for name in ("logprobs", "sampling_logprobs"):
        np.testing.assert_allclose(np.asarray(getattr(res, name)),
                                   np.asarray(getattr(ref, name)), atol=TOL)
    np.testing.assert_array_equal(np.asarray(res.completion_mask),
                                  np.asarray(ref.completion_mask))


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "prompts is empty"),
        ([[1, 2], []], {}, r"prompts\[1\] is empty"),
        ([[1, 2, 61]], {}, r"prompts\[0\].*outside"),
        ([list(range(1, 40))], dict(max_len=40), "longest prompt has 39"),
        ([list(range(1, 60)) * 3], {}, "longest prompt"),
        ([[1]], dict(max_new_tokens=0), "max_new_tokens"),
        ([[1]], dict(max_new_tokens=-3), "max_new_tokens"),
        ([[1]], dict(top_p=0.0), "top_p"),
        ([[1]], dict(top_p=1.01), "top_p"),
        ([[1]], dict(temperature=-1.0), "temperature"),
        ([[1]], dict(top_k=0), "top_k"),
        ([[1]], dict(num_samples=0), "num_samples"),
        ([[1]], dict(decode_phases=0), "decode_phases"),
        ([[1]], dict(stop_ids=(99,)), "stop_ids"),
        ("hello", {}, "prompts must be"),
        ([[1.5, 2]], {}, r"prompts\[0\]"),
    ],
)
def test_bad_input_raises(model, prompts, kwargs, match):
    kw = dict(key=jax.random.key(0), max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, **kw)


def test_padded_array_prompts_with_mask(model):
    ids = np.array([[0, 0, 5, 9], [7, 8, 0, 0]], np.int32)
    mask = ids != 0
    a = generate(model, ids, prompt_mask=mask, key=jax.random.key(8), max_new_tokens=3,
                 temperature=0.0)
    b = generate(model, [[5, 9], [7, 8]], key=jax.random.key(8), max_new_tokens=3,
                 temperature=0.0)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    with pytest.raises(ValueError, match="prompt_mask"):
        generate(model, ids, prompt_mask=mask[:, :3], key=jax.random.key(8), max_new_tokens=3)
