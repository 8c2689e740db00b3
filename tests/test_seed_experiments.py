"""Golden tests of the seed's toy numbers and of the two seed experiments.

Seed (rl-post.txt): four answers with pi = (0.4, 0.3, 0.2, 0.1), answer 3 correct. Exact
gradient 0.2 (e3 - pi) = (-0.08, -0.06, 0.16, -0.02); the single-sample variance of the
correct logit's gradient falls from 0.102 to 0.057 with baseline 0.2 (exactly 0.1024 ->
0.0576); 60 GRPO steps with groups of 8 end at p(correct) 0.99 without KL and 0.94 with
it; groups of 8 have mixed rewards with probability 0 / 0.99 / 0.34 at success rates
0 / 0.5 / 0.95 (exactly 0 / 0.992 / 0.337).

Statistical tolerance (stated once): a Monte-Carlo estimate must lie within Z = 5 of its
own computed standard errors of the exact value (two-sided normal tail 5.7e-7 per check);
the seeds are fixed, so the outcome is deterministic.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _experiments import load_experiment

Z = 5.0  # statistical tolerance in standard errors (see module docstring)


@pytest.fixture(scope="module")
def toy():
    return load_experiment("toy_bandit")


@pytest.fixture(scope="module")
def signal():
    return load_experiment("signal_fraction")


def _result_line(captured: str) -> dict[str, float]:
    """Parse the last stdout line, which must be `RESULT key=value ...`."""
    last = captured.rstrip("\n").splitlines()[-1]
    assert re.fullmatch(r"RESULT( [a-z0-9_]+=\S+)+", last), last
    return {k: float(v) for k, v in (kv.split("=") for kv in last.split()[1:])}


# ----------------------------------------------------------------------------- toy, exact


def test_initial_policy_is_the_seeds(toy):
    np.testing.assert_allclose(jax.nn.softmax(toy.initial_logits()), [0.4, 0.3, 0.2, 0.1], atol=1e-7)
    assert toy.CORRECT == 2  # the seed's "answer 3", 1-based


def test_exact_gradient_is_seeds_vector(toy):
    grad = toy.exact_gradient(toy.initial_logits())
    np.testing.assert_allclose(grad, [-0.08, -0.06, 0.16, -0.02], atol=1e-6)
    p = jnp.asarray([0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(grad, 0.2 * (jnp.eye(4)[2] - p), atol=1e-6)


def test_exact_variances_0_1024_to_0_0576(toy):
    z = toy.initial_logits()
    np.testing.assert_allclose(toy.exact_variance(z, 0.0), 0.1024, atol=1e-6)
    np.testing.assert_allclose(toy.exact_variance(z, 0.2), 0.0576, atol=1e-6)
    # A constant baseline leaves the expected gradient unchanged (exact enumeration).
    answers = jnp.arange(4)
    pi = jax.nn.softmax(z)
    for b in (0.0, 0.2, 0.7):
        mean = pi @ toy.score_gradients(z, answers, b)
        np.testing.assert_allclose(mean, [-0.08, -0.06, 0.16, -0.02], atol=1e-6)


# ----------------------------------------------------------------------------- toy, sampled


@pytest.fixture(scope="module")
def mc(toy):
    return toy.monte_carlo(jax.random.key(0), 20_000)


def test_monte_carlo_gradient_within_5_standard_errors(toy, mc):
    z = toy.initial_logits()
    exact = np.asarray(toy.exact_gradient(z))
    for name in ("no_baseline", "baseline"):
        m = mc[name]
        # The standard errors are honest: they match sqrt(Var_exact / n) per component.
        exact_var = np.array([toy.exact_variance(z, toy.BASELINE if name == "baseline" else 0.0, i)
                              for i in range(4)])
        np.testing.assert_allclose(m["mean_se"], np.sqrt(exact_var / 20_000), rtol=0.05)
        assert np.all(np.abs(m["mean"] - exact) <= Z * m["mean_se"]), (name, m["mean"], m["mean_se"])


def test_monte_carlo_variances_within_5_standard_errors(toy, mc):
    z = toy.initial_logits()
    pi = np.asarray(jax.nn.softmax(z), np.float64)
    for name, b, exact in (("no_baseline", 0.0, 0.1024), ("baseline", 0.2, 0.0576)):
        m = mc[name]
        # The SE of a sample variance is sqrt((mu4 - sigma^4) / n); mu4 by enumeration.
        g = np.asarray(toy.score_gradients(z, jnp.arange(4), b), np.float64)[:, toy.CORRECT]
        mu4 = pi @ (g - pi @ g) ** 4
        np.testing.assert_allclose(m["var_se"], np.sqrt((mu4 - exact**2) / 20_000), rtol=0.05)
        assert abs(m["var"] - exact) <= Z * m["var_se"], (name, m["var"], m["var_se"])
    assert mc["baseline"]["var"] < mc["no_baseline"]["var"]


# ----------------------------------------------------------------------------- signal fraction


def test_signal_fraction_analytic_matches_seed(signal):
    got = signal.analytic_signal_fraction([0.0, 0.5, 0.95])
    np.testing.assert_allclose(got, [0.0, 0.992, 0.337], atol=1e-3)
    np.testing.assert_allclose(got, [0.0, 1 - 2 / 256, 1 - 0.95**8 - 0.05**8], rtol=1e-12)


def test_signal_fraction_simulated_within_0_01(signal):
    rates = jnp.asarray([0.0, 0.5, 0.95, 1.0], jnp.float32)
    sim = signal.simulate_rates(jax.random.key(1), rates, n_seeds=4, n_groups=5_000)
    assert sim.shape == (4, 4)
    np.testing.assert_allclose(sim.mean(1), signal.analytic_signal_fraction(np.asarray(rates)), atol=0.01)
    assert np.all(sim[[0, 3]] == 0.0)  # never / always solved: no group has signal


# ----------------------------------------------------------------------------- experiments


def test_toy_bandit_default_run_meets_acceptance(toy, tmp_path, capsys):
    returned = toy.main(["--out", str(tmp_path)])
    result = _result_line(capsys.readouterr().out)
    assert result == pytest.approx(returned, rel=1e-5)
    assert result["seeds"] >= 20
    assert result["p_correct_no_kl"] >= 0.98, result
    assert 0.90 <= result["p_correct_kl"] <= 0.97, result
    assert result["kl_kl"] < result["kl_no_kl"], result
    assert result["var_no_baseline_exact"] == pytest.approx(0.1024, abs=1e-6)
    assert result["var_baseline_exact"] == pytest.approx(0.0576, abs=1e-6)
    assert result["grad_max_err_se"] <= Z, result
    assert (tmp_path / "toy_bandit.png").stat().st_size > 1000


def test_toy_bandit_is_deterministic_and_sgd_also_reproduces(toy, tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--seeds", "20", "--mc-samples", "2000"]
    a = toy.main(argv + ["--optimizer", "sgd", "--lr", "1"])
    b = toy.main(argv + ["--optimizer", "sgd", "--lr", "1"])
    capsys.readouterr()
    assert a == b
    assert a["p_correct_no_kl"] >= 0.98 and 0.90 <= a["p_correct_kl"] <= 0.97, a


def test_signal_fraction_default_run_meets_acceptance(signal, tmp_path, capsys):
    returned = signal.main(["--out", str(tmp_path)])
    result = _result_line(capsys.readouterr().out)
    assert result == pytest.approx(returned, rel=1e-5)
    assert result["signal_p0"] == 0.0
    assert result["signal_p05"] == pytest.approx(0.992, abs=0.01)
    assert result["signal_p095"] == pytest.approx(0.337, abs=0.01)
    assert result["max_abs_err"] <= 0.01, result
    assert (tmp_path / "signal_fraction.png").stat().st_size > 1000


@pytest.mark.parametrize("name,argv", [
    ("toy_bandit", ["--seeds", "0"]),
    ("toy_bandit", ["--optimizer", "rmsprop"]),
    ("signal_fraction", ["--groups", "0"]),
])
def test_bad_arguments_are_rejected(name, argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        load_experiment(name).main(argv + ["--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err
