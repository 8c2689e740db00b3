"""KL estimators: closed forms, k3 >= 0, unbiasedness, and which divergence each gradient follows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.objectives import kl_estimate, kl_penalized_rewards


def test_closed_forms():
    logp = jnp.array([-1.0, -2.0, -0.3, -4.0])
    ref = jnp.array([-1.5, -1.0, -0.3, -0.1])
    d = np.asarray(ref - logp, np.float64)  # log(ref / pi)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), -d, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), 0.5 * d**2, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), np.exp(d) - 1 - d, rtol=1e-6)
    assert float(kl_estimate(logp, ref, "k3")[2]) == 0.0


def test_k3_nonnegative_and_unclamped_by_default():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(scale=5, size=1000), jnp.float32)
    ref = jnp.asarray(rng.normal(scale=5, size=1000), jnp.float32)
    k3 = np.asarray(kl_estimate(logp, ref, "k3"))
    assert np.all(k3 >= 0)
    assert k3.max() > 10  # unclamped: large log-ratios give large values
    clamped = np.asarray(kl_estimate(logp, ref, "k3", clamp=10.0))
    assert clamped.max() == 10.0 and np.all(clamped[k3 < 10] == k3[k3 < 10])
    assert np.asarray(kl_estimate(logp, ref, "k1", clamp=1.0)).min() == -1.0


def _pi_ref():
    pi = jax.nn.softmax(jnp.array([0.3, -1.0, 1.2, 0.1, -0.4]))
    ref = jax.nn.softmax(jnp.array([-0.2, 0.5, 0.0, 0.8, -1.0]))
    return pi, ref


def test_values_estimate_kl_pi_ref_exactly_in_expectation():
    pi, ref = _pi_ref()
    kl = float(jnp.sum(pi * (jnp.log(pi) - jnp.log(ref))))
    for kind in ("k1", "k3"):  # unbiased
        est = float(jnp.sum(pi * kl_estimate(jnp.log(pi), jnp.log(ref), kind)))
        assert est == pytest.approx(kl, rel=1e-5)


def _expected_grad(kind, z, log_ref):
    """E_{x~pi}[d/dz k(log pi_z(x), log ref(x))], pi's probabilities held fixed as weights."""
    weights = jax.lax.stop_gradient(jax.nn.softmax(z))

    def expected(z):
        logp = jax.nn.log_softmax(z)
        return jnp.sum(weights * kl_estimate(logp, log_ref, kind))

    return jax.grad(expected)(z)


def test_loss_term_gradients_follow_documented_divergences():
    # Enumerate the whole vocabulary: exact expectations, no sampling noise.
    z = jnp.array([0.3, -1.0, 1.2, 0.1, -0.4])
    log_ref = jax.nn.log_softmax(jnp.array([-0.2, 0.5, 0.0, 0.8, -1.0]))

    def kl_pi_ref(z):
        logp = jax.nn.log_softmax(z)
        return jnp.sum(jnp.exp(logp) * (logp - log_ref))

    def kl_ref_pi(z):
        return jnp.sum(jnp.exp(log_ref) * (log_ref - jax.nn.log_softmax(z)))

    g1, g2, g3 = (_expected_grad(k, z, log_ref) for k in ("k1", "k2", "k3"))
    np.testing.assert_allclose(g1, 0.0, atol=1e-7)
    np.testing.assert_allclose(g2, jax.grad(kl_pi_ref)(z), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g3, jax.grad(kl_ref_pi)(z), rtol=1e-5, atol=1e-7)
    # The two divergences' gradients really differ here, so the test can tell them apart.
    assert float(jnp.abs(jax.grad(kl_pi_ref)(z) - jax.grad(kl_ref_pi)(z)).max()) > 0.05


def test_kl_penalized_rewards():
    rewards = jnp.array([[0.0, 0.0, 1.0, 5.0]])
    logp = jnp.array([[-1.0, -2.0, -0.5, 9.0]])
    ref = jnp.array([[-1.5, -1.0, -0.5, 9.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    out = kl_penalized_rewards(rewards, logp, ref, mask, coef=0.1)
    np.testing.assert_allclose(out, [[-0.05, 0.1, 1.0, 0.0]], rtol=1e-6)
    g = jax.grad(lambda lp: kl_penalized_rewards(rewards, lp, ref, mask, coef=0.1).sum())(logp)
    assert np.all(np.asarray(g) == 0)  # a reward penalty carries no gradient


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: kl_estimate(jnp.ones(3), jnp.ones(3), "k4"), "kind.*'k1', 'k2', 'k3'"),
        (lambda: kl_estimate(jnp.ones(3), jnp.ones(4), "k1"), "ref_logp"),
        (lambda: kl_estimate(jnp.ones(3), jnp.ones(3), "k3", clamp=0.0), "clamp"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
