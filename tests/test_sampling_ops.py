"""Statistical and exactness tests of rljax.sampling.ops.

Goodness of fit: Pearson's chi-square against the exact target distribution (computed
independently in numpy float64), rejected at significance ALPHA = 1e-3 with fixed seeds.
Each test draws N_DRAWS tokens from a V=50 vocabulary in one jitted call; 50 tokens span
7 blocks of 8 (the last one padded), so both levels of the inverse CDF are exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.sampling import ops

ALPHA = 1e-3
N_DRAWS = 200_000
V = 50


def _chi2_pvalue(counts, probs):
    """Upper-tail p-value of Pearson's statistic; bins with expected count < 5 pooled."""
    counts = np.asarray(counts, np.float64)
    expected = np.asarray(probs, np.float64) * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(np.sum((obs - exp) ** 2 / exp))
    dof = len(exp) - 1
    return float(jax.scipy.special.gammaincc(dof / 2.0, stat / 2.0)), stat, dof


def _logits(seed=0, scale=2.0):
    return np.random.default_rng(seed).normal(0, scale, V).astype(np.float32)


def _softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    e[~np.isfinite(x)] = 0.0
    return e / e.sum()


def _log(p):
    with np.errstate(divide="ignore"):
        return np.log(p)


def _draw(logits_V, params, seed=1, n=N_DRAWS):
    fn = jax.jit(lambda k, x: ops.sample_tokens(k, x, params))
    x = jnp.broadcast_to(jnp.asarray(logits_V), (n, V))
    tok, logp, slogp = fn(jax.random.key(seed), x)
    return np.asarray(tok), np.asarray(logp), np.asarray(slogp)


def _expected_topk(x, k):
    kth = np.sort(x)[::-1][k - 1]
    return _softmax64(np.where(x >= kth, x, -np.inf))


def _expected_topp(x, p):
    """Nucleus by the definition in SamplingParams, in float64, by a plain loop."""
    probs = _softmax64(x)
    order = np.argsort(-probs, kind="stable")
    mass = 0.0
    for idx in order:
        if mass >= p:
            break
        mass += probs[idx]
        thresh = probs[idx]
    return _softmax64(np.where(probs >= thresh, x, -np.inf))


def _check_fit(tokens, probs):
    counts = np.bincount(tokens, minlength=V)
    assert counts.shape == (V,), "token id out of range"
    assert counts[probs == 0].sum() == 0, "drew a token with zero probability"
    pval, stat, dof = _chi2_pvalue(counts, probs)
    assert pval > ALPHA, f"chi2={stat:.1f} dof={dof} p={pval:.2e}"


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_matches_softmax_with_temperature(temperature):
    x = _logits()
    tok, logp, slogp = _draw(x, ops.SamplingParams(temperature=temperature))
    target = _softmax64(x / temperature)
    _check_fit(tok, target)
    np.testing.assert_allclose(logp, np.log(_softmax64(x))[tok], atol=1e-5)
    np.testing.assert_allclose(slogp, _log(target)[tok], atol=1e-5)


def test_matches_top_k():
    x = _logits(seed=2)
    tok, _, slogp = _draw(x, ops.SamplingParams(top_k=7), seed=3)
    target = _expected_topk(x, 7)
    assert (target > 0).sum() == 7
    _check_fit(tok, target)
    np.testing.assert_allclose(slogp, _log(target)[tok], atol=1e-5)


@pytest.mark.parametrize("top_p", [0.4, 0.8])
def test_matches_top_p(top_p):
    x = _logits(seed=4)
    tok, logp, slogp = _draw(x, ops.SamplingParams(top_p=top_p), seed=5)
    target = _expected_topp(x, top_p)
    assert 1 < (target > 0).sum() < V
    _check_fit(tok, target)
    np.testing.assert_allclose(logp, np.log(_softmax64(x))[tok], atol=1e-5)
    np.testing.assert_allclose(slogp, _log(target)[tok], atol=1e-5)


def test_matches_temperature_top_k_top_p():
    x = _logits(seed=6)
    params = ops.SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    tok, _, slogp = _draw(x, params, seed=7)
    xt = x / np.float32(0.7)
    target = _expected_topp(_log(_expected_topk(xt, 20)), 0.9)
    assert 1 < (target > 0).sum() < 20
    _check_fit(tok, target)
    np.testing.assert_allclose(slogp, _log(target)[tok], atol=1e-5)


def test_chi_square_check_rejects_a_wrong_distribution():
    """The check has power: samples at T=1 are rejected against the T=1.15 target."""
    x = _logits()
    tok, _, _ = _draw(x, ops.SamplingParams())
    counts = np.bincount(tok, minlength=V)
    assert _chi2_pvalue(counts, _softmax64(x / 1.15))[0] < ALPHA


def test_masked_tokens_and_empty_blocks_are_never_drawn():
    """-inf logits (whole leading/trailing blocks and scattered ids) get no samples."""
    x = _logits(seed=8)
    x[:16] = -np.inf  # the first two blocks of 8
    x[42:] = -np.inf  # the last (padded) block and part of the one before
    x[[20, 27, 33]] = -np.inf
    tok, _, _ = _draw(x, ops.SamplingParams(), seed=9)
    _check_fit(tok, _softmax64(x))


def test_single_allowed_token_is_always_drawn():
    x = np.full(V, -np.inf, np.float32)
    x[V - 1] = 0.0
    tok, logp, _ = _draw(x, ops.SamplingParams(), n=1000)
    assert (tok == V - 1).all() and np.allclose(logp, 0.0)


def test_greedy_is_argmax_lowest_id_on_ties_and_logprob_is_policy():
    rng = np.random.default_rng(10)
    x = rng.normal(size=(6, 32000)).astype(np.float32)
    x[2, [5, 900]] = 50.0  # tie: the lowest id wins, as np.argmax
    tok, logp, slogp = jax.jit(
        lambda x: ops.sample_tokens(jax.random.key(0), x, ops.SamplingParams(0.0))
    )(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(x, axis=-1))
    ref = x[np.arange(6), np.argmax(x, -1)] - np.log(np.exp(x.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(logp), ref, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(slogp), 0.0)


def test_large_vocab_draws_in_range_and_rows_are_independent():
    """V=32000 (benchmark size): ids in range; identical rows get different tokens."""
    x = jnp.zeros((64, 32000))
    tok = np.asarray(ops.inverse_cdf_sample(jax.random.key(11), x))
    assert tok.min() >= 0 and tok.max() < 32000
    assert len(set(tok.tolist())) > 50


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.SamplingParams(**kwargs)


def _np_topk_mask(x, k):
    kth = -np.sort(-x, axis=-1)[:, k - 1 : k]
    return x >= kth


def _np_topp_mask(x, p):
    out = np.zeros(x.shape, bool)
    for r in range(x.shape[0]):
        out[r] = _expected_topp(x[r], p) > 0
    return out


@pytest.mark.parametrize("k", [1, 3, 37, 999])
def test_top_k_mask_matches_sort_with_ties_and_inf(k):
    rng = np.random.default_rng(12)
    x = rng.integers(-20, 20, size=(16, 1000)).astype(np.float32) / 4  # many ties
    x[:, :100] = -np.inf
    x[3] = -np.inf
    x[3, 500] = 1.0
    got = np.asarray(ops._top_k_mask(jnp.asarray(x), k))
    np.testing.assert_array_equal(got, _np_topk_mask(x, k))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_mask_matches_sorted_cumsum_definition(p):
    rng = np.random.default_rng(13)
    x = rng.normal(0, 3, size=(8, 1000)).astype(np.float32)
    got = np.asarray(ops._top_p_mask(jnp.asarray(x), jnp.ones(x.shape, bool), p))
    np.testing.assert_array_equal(got, _np_topp_mask(x, p))
    full = np.asarray(ops._top_p_mask(jnp.asarray(x), jnp.ones(x.shape, bool), 1.0))
    assert full.all()


@pytest.mark.parametrize("v", [50, 1000, 32000, 151936, 128256])
def test_block_size_is_near_sqrt_v(v):
    bs = ops.vocab_block_size(v)
    assert np.sqrt(v) / 2 <= bs <= 2 * np.sqrt(v) or v < 64


@pytest.mark.parametrize(
    "params",
    [ops.SamplingParams(), ops.SamplingParams(0.6), ops.SamplingParams(0.0),
     ops.SamplingParams(1.3, top_k=40, top_p=0.9)],
    ids=["T1", "T.6", "greedy", "filters"],
)
def test_vocab_major_layout_draws_the_same_tokens(params):
    """sample_tokens_VxR on logits.T equals sample_tokens on logits (same uniforms)."""
    x = jax.random.normal(jax.random.key(14), (48, 32000)) * 3
    key = jax.random.key(15)
    a = ops.sample_tokens(key, x, params)
    b = jax.jit(lambda k, xt: ops.sample_tokens_VxR(k, xt, params))(key, x.T)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    for u, v in zip(a[1:], b[1:]):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=1e-5)


def test_vocab_major_layout_matches_softmax():
    x = _logits(seed=16)
    fn = jax.jit(lambda k, xt: ops.sample_tokens_VxR(k, xt, ops.SamplingParams()))
    tok, _, _ = fn(jax.random.key(17), jnp.broadcast_to(jnp.asarray(x)[:, None], (V, N_DRAWS)))
    _check_fit(np.asarray(tok), _softmax64(x))


def test_sampling_config_makes_the_samplers_arguments():
    """`SamplingConfig.sampler_args`: the one place a run's sampling config becomes the
    sampler's arguments (rollouts, the one-program step, the evaluators, `rljax sample`)."""
    from rljax.train.config import SamplingConfig

    plain = SamplingConfig(max_new_tokens=7, temperature=0.7)
    assert plain.sampler_args() == dict(max_new_tokens=7, temperature=0.7, top_k=None,
                                        top_p=None)
    filt = SamplingConfig(max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9)
    assert filt.sampler_args() == dict(max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9)
    # Greedy drops the filters: both always keep the most likely token.
    assert filt.sampler_args(greedy=True) == plain.sampler_args(greedy=True) == dict(
        max_new_tokens=7, temperature=0.0, top_k=None, top_p=None)
    ops.SamplingParams(**{k: v for k, v in filt.sampler_args().items() if k != "max_new_tokens"})
