"""Advantages: the seed's GRPO table, RLOO, whitening, GAE against a plain loop."""

import numpy as np
import jax.numpy as jnp
import pytest

from rljax.objectives import (
    broadcast_to_tokens,
    final_token_rewards,
    gae,
    group_advantages,
    rloo_advantages,
    whiten,
    zero_variance_fraction,
)


def test_seed_grpo_table_population_std():
    # The seed's table (rl-post.txt, "GRPO: the group is the baseline"), population std.
    adv = np.asarray(group_advantages(jnp.array([1.0, 0, 0, 1, 1, 0, 0, 0]), 4))
    np.testing.assert_allclose(adv[:4], [1, -1, -1, 1], atol=1e-5)
    np.testing.assert_allclose(adv[4:], [np.sqrt(3), -1 / np.sqrt(3)] + [-1 / np.sqrt(3)] * 2, atol=1e-5)
    assert np.round(adv[4], 2) == 1.73 and np.round(adv[5], 2) == -0.58


@pytest.mark.parametrize("std", ["population", "sample", "none"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 1 / 3, 7.3])
def test_all_equal_groups_give_exactly_zero(std, value):
    # 0.1 and 1/3 are values whose float32 mean need not round back to them.
    r = jnp.array([value] * 5 + [0.0, 1.0, 0.0, 0.0, 1.0], jnp.float32)
    adv = np.asarray(group_advantages(r, 5, std=std))
    assert np.all(adv[:5] == 0.0)
    assert np.any(adv[5:] != 0.0)
    assert np.all(np.asarray(rloo_advantages(r, 5))[:5] == 0.0)


def test_std_modes_match_numpy():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(6, 8)).astype(np.float32)
    c = r - r.mean(1, keepdims=True)
    for std, ref in [
        ("population", c / (r.std(1, keepdims=True) + 1e-6)),
        ("sample", c / (r.std(1, ddof=1, keepdims=True) + 1e-6)),
        ("none", c),
    ]:
        np.testing.assert_allclose(group_advantages(jnp.asarray(r.ravel()), 8, std=std), ref.ravel(), rtol=1e-5, atol=1e-6)


def test_rloo_is_leave_one_out():
    r = np.array([1.0, 0.0, 0.0, 2.0, 5.0, 1.0], np.float32)
    ref = [r[i] - (r[(i // 3) * 3:(i // 3) * 3 + 3].sum() - r[i]) / 2 for i in range(6)]
    np.testing.assert_allclose(rloo_advantages(jnp.asarray(r), 3), ref, rtol=1e-6)


def test_zero_variance_fraction():
    r = jnp.array([1.0, 1, 1, 0, 0, 0, 1, 0, 1])
    assert float(zero_variance_fraction(r, 3)) == pytest.approx(2 / 3)


def test_whiten_masked():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, size=(4, 6)).astype(np.float32)
    mask = (np.arange(6)[None] < np.array([6, 3, 1, 4])[:, None]).astype(np.float32)
    x_junk = np.where(mask > 0, x, 1e6).astype(np.float32)
    out = np.asarray(whiten(jnp.asarray(x_junk), jnp.asarray(mask)))
    sel = x[mask > 0]
    np.testing.assert_allclose(out[mask > 0], (sel - sel.mean()) / np.sqrt(sel.var() + 1e-8), rtol=1e-4, atol=1e-5)
    assert np.all(out[mask == 0] == 0)
    kept = np.asarray(whiten(jnp.asarray(x_junk), jnp.asarray(mask), shift_mean=False))
    np.testing.assert_allclose(kept[mask > 0].mean(), sel.mean(), rtol=1e-4)


def _gae_loop(rewards, values, lengths, gamma, lam):
    """Plain-Python GAE per sequence (arXiv:1506.02438 Eq. 16), reading only real tokens."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            v_next = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * v_next - values[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
    ret = adv + np.where(adv != 0, values, 0)
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_loop_with_junk_in_masked_positions(gamma, lam):
    rng = np.random.default_rng(2)
    B, T = 5, 7
    lengths = [7, 4, 1, 0, 5]
    mask = (np.arange(T)[None] < np.array(lengths)[:, None]).astype(np.float32)
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    values = rng.normal(size=(B, T)).astype(np.float32)
    junk_values = np.where(mask > 0, values, np.nan).astype(np.float32)
    junk_rewards = np.where(mask > 0, rewards, 1e9).astype(np.float32)
    adv, ret = gae(jnp.asarray(junk_rewards), jnp.asarray(junk_values), jnp.asarray(mask), gamma=gamma, lam=lam)
    ref_adv, _ = _gae_loop(rewards, values, lengths, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv * mask, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), (ref_adv + values) * mask, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(adv)[mask == 0] == 0) and np.all(np.isfinite(np.asarray(ret)))


def test_final_token_rewards_and_broadcast():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], jnp.float32)
    out = np.asarray(final_token_rewards(jnp.array([2.0, 3.0, 4.0]), mask))
    np.testing.assert_array_equal(out, [[0, 0, 2, 0], [3, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(broadcast_to_tokens(jnp.array([2.0, 3.0, 4.0]), mask), np.asarray(mask) * [[2], [3], [4]])


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: group_advantages(jnp.ones((2, 4)), 4), "rewards"),
        (lambda: group_advantages(jnp.ones(6), 4), "group_size"),
        (lambda: group_advantages(jnp.ones(6), 0), "group_size"),
        (lambda: group_advantages(jnp.ones(6), 3, std="pop"), "std.*'population', 'sample', 'none'"),
        (lambda: group_advantages(jnp.ones(6), 1, std="sample"), "group_size"),
        (lambda: rloo_advantages(jnp.ones(6), 1), "group_size"),
        (lambda: gae(jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((2, 3)), gamma=1.0, lam=1.0), "values"),
        (lambda: gae(jnp.ones(3), jnp.ones(3), jnp.ones(3), gamma=1.0, lam=1.0), "rewards"),
        (lambda: whiten(jnp.ones((2, 3)), jnp.ones((3, 2))), "mask"),
        (lambda: final_token_rewards(jnp.ones(3), jnp.ones((2, 4))), "rewards_B"),
    ],
)
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
