"""Surrogates, value loss, aggregation and logits helpers: goldens and closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.objectives import (
    aggregate,
    clip_indicators,
    clipped_value_loss,
    gspo_token_ratio,
    policy_gradient_objective,
    ppo_clip_objective,
    token_entropy,
    token_logprobs,
    truncated_is_weights,
)


def test_seed_ppo_clipping_examples():
    # rl-post.txt, "PPO: a value model and a clipped step", eps = 0.2 (arXiv:1707.06347 Eq. 7).
    obj = ppo_clip_objective(jnp.array([1.5, 0.5, 1.5]), jnp.array([1.0, -1.0, -1.0]))
    np.testing.assert_allclose(obj, [1.2, -0.8, -1.5], rtol=1e-6)


def test_clipped_tokens_get_no_gradient():
    adv = jnp.array([1.0, -1.0, -1.0, 1.0])
    g = jax.grad(lambda r: ppo_clip_objective(r, adv).sum())(jnp.array([1.5, 0.5, 1.5, 0.9]))
    np.testing.assert_array_equal(g, [0.0, 0.0, -1.0, 1.0])


def test_clip_higher_is_asymmetric():
    # DAPO (arXiv:2503.14476 §3.1): eps_low 0.2, eps_high 0.28.
    r = jnp.array([1.25, 1.5, 0.7, 0.5])
    adv = jnp.array([1.0, 1.0, -1.0, -1.0])
    np.testing.assert_allclose(ppo_clip_objective(r, adv, eps_low=0.2), [1.2, 1.2, -0.8, -0.8], rtol=1e-6)
    np.testing.assert_allclose(ppo_clip_objective(r, adv, eps_low=0.2, eps_high=0.28), [1.25, 1.28, -0.8, -0.8], rtol=1e-6)
    low, high, _ = clip_indicators(r, adv, eps_low=0.2, eps_high=0.28)
    np.testing.assert_array_equal(low, [0, 0, 1, 1])
    np.testing.assert_array_equal(high, [0, 1, 0, 0])


def test_dual_clip_bounds_negative_advantages_below():
    # Ye et al. 2020 (arXiv:1912.09729): for A < 0, max(min(rA, clip(r)A), cA).
    r = jnp.array([5.0, 2.0, 5.0, 0.5])
    adv = jnp.array([-1.0, -1.0, 1.0, -2.0])
    np.testing.assert_allclose(ppo_clip_objective(r, adv), [-5.0, -2.0, 1.2, -1.6], rtol=1e-6)
    out = ppo_clip_objective(r, adv, dual_clip=3.0)
    np.testing.assert_allclose(out, [-3.0, -2.0, 1.2, -1.6], rtol=1e-6)
    g = jax.grad(lambda r: ppo_clip_objective(r, adv, dual_clip=3.0).sum())(r)
    np.testing.assert_array_equal(g, [0.0, -1.0, 0.0, 0.0])
    np.testing.assert_allclose(ppo_clip_objective(r, adv, dual_clip=jnp.inf), ppo_clip_objective(r, adv))
    _, _, dual = clip_indicators(r, adv, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    np.testing.assert_array_equal(dual, [1, 0, 0, 0])


def test_policy_gradient_objective_gradient_is_advantage():
    adv = jnp.array([[2.0, -1.0]])
    g = jax.grad(lambda lp: policy_gradient_objective(lp, adv).sum())(jnp.array([[-1.0, -2.0]]))
    np.testing.assert_array_equal(g, adv)


def _gspo_direct(logp, old, mask, adv_B, eps):
    """GSPO as written in arXiv:2507.18071: one ratio per sequence, differentiated directly."""
    len_B = mask.sum(1)
    s_B = jnp.exp((jnp.where(mask > 0, logp - old, 0.0)).sum(1) / len_B)
    return jnp.minimum(s_B * adv_B, jnp.clip(s_B, 1 - eps, 1 + eps) * adv_B).mean()


def test_gspo_token_form_matches_sequence_form_in_value_and_gradient():
    rng = np.random.default_rng(0)
    mask = jnp.asarray((np.arange(6)[None] < np.array([6, 3, 1, 4])[:, None]).astype(np.float32))
    logp = jnp.asarray(rng.normal(-1, 0.5, (4, 6)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.3, (4, 6)), jnp.float32)
    adv_B = jnp.array([1.0, -1.0, 0.5, -2.0])

    def token_form(logp):
        r = gspo_token_ratio(logp, old, mask)
        obj = ppo_clip_objective(r, adv_B[:, None] * jnp.ones_like(r), eps_low=0.1)
        s, n = aggregate(obj, mask, "seq-mean-token-mean")
        return s / n

    r = gspo_token_ratio(logp, old, mask)
    s_B = np.exp(np.asarray((jnp.where(mask > 0, logp - old, 0)).sum(1) / mask.sum(1)))
    np.testing.assert_allclose(np.asarray(r)[np.asarray(mask) > 0], np.repeat(s_B, [6, 3, 1, 4]), rtol=1e-6)
    assert float(token_form(logp)) == pytest.approx(float(_gspo_direct(logp, old, mask, adv_B, 0.1)), rel=1e-6)
    g_tok = jax.grad(token_form)(logp)
    g_seq = jax.grad(lambda lp: _gspo_direct(lp, old, mask, adv_B, 0.1))(logp)
    np.testing.assert_allclose(g_tok, g_seq, rtol=1e-5, atol=1e-7)
    assert np.any(np.asarray(g_tok) != 0)


def test_truncated_is_weights():
    old = jnp.array([-1.0, -1.0, -3.0])
    sampler = jnp.array([-1.5, -0.5, -0.1])
    w = truncated_is_weights(old, sampler, 1.5)
    np.testing.assert_allclose(w, [1.5, np.exp(-0.5), np.exp(-2.9)], rtol=1e-6)
    np.testing.assert_allclose(truncated_is_weights(old, sampler, jnp.inf)[0], np.exp(0.5), rtol=1e-6)
    g = jax.grad(lambda o: truncated_is_weights(o, sampler, 1.5).sum())(old)
    np.testing.assert_array_equal(g, 0.0)


def test_clipped_value_loss_ppo2():
    v = jnp.array([1.0, 0.1, -1.0])
    v_old = jnp.array([0.0, 0.0, 0.0])
    ret = jnp.array([2.0, 1.0, -0.1])
    loss, clipped = clipped_value_loss(v, v_old, ret, 0.2)
    # (1) clipped V = 0.2: 0.5 * max(1, 3.24); (2) inside the range: 0.5 * 0.81;
    # (3) clipped V = -0.2: 0.5 * max(0.81, 0.01) (the max keeps the unclipped error).
    np.testing.assert_allclose(loss, [1.62, 0.405, 0.405], rtol=1e-6)
    np.testing.assert_array_equal(clipped, [1, 0, 0])
    g = jax.grad(lambda v: clipped_value_loss(v, v_old, ret, 0.2)[0].sum())(v)
    np.testing.assert_allclose(g, [0.0, -0.9, -0.9], rtol=1e-6)


def test_aggregation_modes_match_numpy():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 5)).astype(np.float32)
    mask = (np.arange(5)[None] < np.array([5, 2, 0, 3])[:, None]).astype(np.float32)
    junk = np.where(mask > 0, x, np.nan).astype(np.float32)
    L = mask.sum(1)
    rows = [b for b in range(4) if L[b] > 0]
    expect = {
        "token-mean": ((x * mask).sum(), L.sum()),
        "seq-mean-token-mean": (sum((x[b] * mask[b]).sum() / L[b] for b in rows), 3.0),
        "seq-mean-token-sum": ((x * mask).sum(), 3.0),
        "seq-mean-token-sum-norm": ((x * mask).sum(), 3.0 * 8.0),
    }
    for mode, (s_ref, n_ref) in expect.items():
        s, n = aggregate(jnp.asarray(junk), jnp.asarray(mask), mode, norm_const=8.0)
        assert float(s) == pytest.approx(s_ref, rel=1e-6) and float(n) == n_ref, mode


def test_token_logprobs_and_entropy():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, size=(2, 3))
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ref = np.take_along_axis(logp_all, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(token_logprobs(jnp.asarray(logits), jnp.asarray(tokens)), ref, rtol=1e-5)
    np.testing.assert_allclose(token_entropy(jnp.asarray(logits)), -(np.exp(logp_all) * logp_all).sum(-1), rtol=1e-5)
    bf16 = token_logprobs(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(tokens))
    assert bf16.dtype == jnp.float32


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: aggregate(jnp.ones((2, 3)), jnp.ones((2, 3)), "mean"), "mode.*'token-mean'.*'seq-mean-token-sum-norm'"),
        (lambda: aggregate(jnp.ones((2, 3)), jnp.ones((2, 3)), "seq-mean-token-sum-norm"), "norm_const"),
        (lambda: aggregate(jnp.ones((2, 3)), jnp.ones((2, 4)), "token-mean"), "mask_BxT"),
        (lambda: aggregate(jnp.ones(3), jnp.ones(3), "token-mean"), "values_BxT"),
        (lambda: ppo_clip_objective(jnp.ones(3), jnp.ones(4)), "advantages"),
        (lambda: token_logprobs(jnp.ones((2, 3, 4)), jnp.ones((2, 4), jnp.int32)), "tokens_BxT"),
        (lambda: clipped_value_loss(jnp.ones(3), jnp.ones(2), jnp.ones(3), 0.2), "old_values"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
