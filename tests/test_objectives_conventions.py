"""Each convention where rljax's objectives differ from TRL's or verl's, pinned by a small
exact case, and each option that switches it (the table in docs/objectives.md); the
KL-Cov / Clip-Cov fixes to the authors' code, the ratio-weighted k3 of DeepSeek-V3.2,
truncation's lower bound, and the refusal of REINFORCE / RLOO off-policy.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import objectives as ro
from rljax.run.overrides import apply_overrides
from rljax.train.config import AlgorithmConfig
from rljax.train.learn.algorithms import cov_tokens, make_coef, make_objective, sequence_advantages

TOL = 1e-6


def _batch(logp, old, adv, mask=None, **extra):
    logp = jnp.asarray(logp, jnp.float32)
    mask = jnp.ones_like(logp) if mask is None else jnp.asarray(mask, jnp.float32)
    extra = {k: jnp.asarray(v, jnp.float32) for k, v in extra.items()}
    return ro.ObjectiveBatch(logp_BxT=logp, old_logp_BxT=jnp.asarray(old, jnp.float32),
                             mask_BxT=mask, adv_BxT=jnp.asarray(adv, jnp.float32), **extra)


# --- advantages: std ddof and eps ----------------------------------------------------------

REWARDS = np.array([1.0, 0.0, 0.0, 0.5, 0.2, 0.9, 0.4, 0.4, 1.0, 1.0, 1.0, 1.0], np.float32)


def test_group_std_is_population_with_eps_1e6_by_default():
    r = REWARDS.reshape(3, 4).astype(np.float64)
    want = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
    want[2] = 0.0  # an all-equal group carries no signal: exactly 0
    got = sequence_advantages(AlgorithmConfig(name="grpo", group_size=4), jnp.asarray(REWARDS))
    np.testing.assert_allclose(np.asarray(got), want.reshape(-1), rtol=TOL, atol=TOL)
    assert float(got[8]) == 0.0


def test_adv_std_sample_with_adv_eps_1e4_is_trls_formula():
    """TRL GRPOTrainer (scale_rewards="group"): A = (r - mean_G) / (std_G + 1e-4) with
    torch.std's ddof 1, in float32, written out here as TRL's code computes it."""
    cfg = AlgorithmConfig(name="grpo", group_size=4, adv_std="sample", adv_eps=1e-4)
    got = np.asarray(sequence_advantages(cfg, jnp.asarray(REWARDS)))
    r = REWARDS.reshape(-1, 4)
    mean = np.repeat(r.mean(axis=1), 4)
    std = np.repeat(r.std(axis=1, ddof=1), 4)
    want = (REWARDS - mean) / (std + np.float32(1e-4))
    assert want.dtype == np.float32 and float(want[8]) == 0.0
    np.testing.assert_allclose(got, want, rtol=TOL, atol=1e-7)
    # The default differs from it by the ddof and the eps (visibly, at this tolerance).
    default = np.asarray(sequence_advantages(AlgorithmConfig(name="grpo", group_size=4), jnp.asarray(REWARDS)))
    assert np.abs(default - want).max() > 0.1


# --- aggregation: entropy bonus, empty rows, Dr.GRPO's normaliser -------------------------

MASK3 = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)  # an empty row
ENT3 = np.array([[1.0, 1.0, 1.0, 1.0], [3.0, 0, 0, 0], [9.0, 9, 9, 9]], np.float32)


def _no_pg(mask, **extra):  # zero advantages: only the entropy / KL terms are left
    z = np.zeros(mask.shape, np.float32)
    return _batch(z - 1.0, z - 1.0, z, mask, **extra)


def test_entropy_bonus_takes_the_objectives_own_aggregation():
    """rljax: -c H per token, reduced with the loss (here the per-sequence token mean:
    (1 + 3) / 2 = 2); TRL: always the token mean ((4 + 3) / 5 = 1.4); no option."""
    b = _no_pg(MASK3, entropy_BxT=ENT3)
    s, c, m = ro.grpo(b, ro.Coef(entropy=0.5), aggregation="seq-mean-token-mean", kl_kind=None)
    assert float(s / c) == pytest.approx(-0.5 * 2.0, abs=TOL)
    s, c, _ = ro.grpo(b, ro.Coef(entropy=0.5), aggregation="token-mean", kl_kind=None)
    assert float(s / c) == pytest.approx(-0.5 * 1.4, abs=TOL)
    assert float(m["entropy"][0] / m["entropy"][1]) == pytest.approx(1.4, abs=TOL)  # metric


def test_empty_rows_do_not_count_and_dr_grpo_keeps_one_over_sequences():
    """Sequence modes divide by S, the non-empty rows (2 here), not B = 3 (TRL's); Dr.GRPO's
    count is norm_const x S (the paper's and TRL's 1 / (G L_max)), where verl's
    seq-mean-token-sum-norm divides by the constant alone."""
    x = np.where(MASK3 > 0, ENT3, 0.0)
    for mode, want in [("seq-mean-token-mean", (1.0 + 3.0, 2.0)),
                       ("seq-mean-token-sum", (7.0, 2.0)), ("token-mean", (7.0, 5.0))]:
        s, c = ro.aggregate(jnp.asarray(x), jnp.asarray(MASK3), mode)
        assert (float(s), float(c)) == want, mode
    s, c = ro.aggregate(jnp.asarray(x), jnp.asarray(MASK3), "seq-mean-token-sum-norm", norm_const=8.0)
    assert (float(s), float(c)) == (7.0, 16.0)
    f = make_objective(AlgorithmConfig(name="dr_grpo"), 8)
    assert f.keywords["aggregation"] == "seq-mean-token-sum-norm" and f.keywords["norm_const"] == 8.0


def test_gae_whitening_uses_the_population_variance():
    """rljax whiten: (x - mean) / sqrt(var_ddof0 + 1e-8); TRL's and verl's masked_whiten
    use the unbiased variance (ddof 1): a factor sqrt(n / (n - 1)) apart; no option."""
    x = jnp.asarray([1.0, 2.0, 3.0, 4.0, 7.0])
    mask = jnp.asarray([1.0, 1.0, 1.0, 1.0, 0.0])
    want = (np.array([1.0, 2.0, 3.0, 4.0]) - 2.5) / np.sqrt(1.25 + 1e-8)
    np.testing.assert_allclose(np.asarray(ro.whiten(x, mask))[:4], want, rtol=TOL)


# --- KL: clamp default, kinds, the ratio-weighted k3 ---------------------------------------


def test_k3_is_unclamped_by_default_and_kl_clamp_selects_verls_10():
    d = 3.0  # log ref - log pi: k3 = e^3 - 1 - 3 = 16.09 > 10
    b = dataclasses.replace(_no_pg(np.ones((1, 1), np.float32)),
                            ref_logp_BxT=jnp.asarray([[-1.0 + d]]))
    coef = make_coef(AlgorithmConfig(name="grpo"))
    s, c, _ = make_objective(AlgorithmConfig(name="grpo"), 8)(b, coef)
    assert float(s / c) == pytest.approx(0.04 * (math.exp(d) - 1 - d), rel=TOL)
    clamped = AlgorithmConfig(name="grpo", kl_clamp=10.0)
    s, c, _ = make_objective(clamped, 8)(b, make_coef(clamped))
    assert float(s / c) == pytest.approx(0.04 * 10.0, rel=TOL)


def _enum():
    z = jnp.array([0.3, -1.0, 1.2, 0.1, -0.4])
    z_old = jnp.array([0.1, -0.6, 1.0, 0.5, -0.2])
    log_ref = jax.nn.log_softmax(jnp.array([-0.2, 0.5, 0.0, 0.8, -1.0]))
    return z, z_old, log_ref


def test_k3_ratio_expected_gradient_is_the_true_kl_pi_ref_gradient():
    """DeepSeek-V3.2 §3.1 / TRL use_bias_correction_kl: E_{x~pi_old}[grad (pi/pi_old) k3]
    = grad KL(pi || ref), by enumerating a vocabulary of 5, off-policy (pi_old != pi) and
    on-policy (pi_old = sg(pi)); plain k3's gradient follows KL(ref || pi) instead."""
    z, z_old, log_ref = _enum()

    def kl_pi_ref(z):
        logp = jax.nn.log_softmax(z)
        return jnp.sum(jnp.exp(logp) * (logp - log_ref))

    def expected(kind, z, old_z):
        w = jax.nn.softmax(old_z)  # the sampling distribution, enumerated
        logp, old = jax.nn.log_softmax(z), jax.nn.log_softmax(old_z)
        return jnp.sum(w * ro.kl_estimate(logp, log_ref, kind, old_logp=old))

    want = jax.grad(kl_pi_ref)(z)
    off = jax.grad(lambda z: expected("k3_ratio", z, z_old))(z)
    on = jax.grad(lambda z: expected("k3_ratio", z, jax.lax.stop_gradient(z)))(z)
    np.testing.assert_allclose(off, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(on, want, rtol=1e-5, atol=1e-7)
    # Its value is KL(pi || ref) in expectation too; plain k3's gradient is another one.
    assert float(expected("k3_ratio", z, z_old)) == pytest.approx(float(kl_pi_ref(z)), rel=1e-5)
    k3 = jax.grad(lambda z: expected("k3", z, jax.lax.stop_gradient(z)))(z)
    assert float(jnp.abs(k3 - want).max()) > 0.05
    with pytest.raises(ValueError, match="k3_ratio.*needs old_logp"):
        ro.kl_estimate(jnp.zeros(2), jnp.zeros(2), "k3_ratio")


def test_kl_kind_selects_the_loss_term_k3_ratio_weighted_by_the_ratio():
    logp, old, ref = np.log([[0.5, 0.2]]), np.log([[0.4, 0.25]]), np.log([[0.3, 0.3]])
    b = _batch(logp, old, np.zeros((1, 2)), ref_logp_BxT=ref)
    d = ref - logp
    k3 = np.exp(d) - 1 - d
    for kind, per_token in [("k1", -d), ("k2", d**2 / 2), ("k3", k3),
                            ("k3_ratio", np.exp(logp - old) * k3)]:
        cfg = AlgorithmConfig(name="grpo", kl_kind=kind)
        s, c, _ = make_objective(cfg, 8)(b, make_coef(cfg))
        assert float(s / c) == pytest.approx(0.04 * per_token.mean(), rel=1e-5), kind
        assert make_objective(cfg, 8).keywords["kl_kind"] == kind
    with pytest.raises(ValueError, match="k3_ratio.*allowed: 'k1', 'k2' or 'k3'"):
        ro.kl_penalized_rewards(b.adv_BxT, b.logp_BxT, b.ref_logp_BxT, b.mask_BxT, coef=0.1,
                                kind="k3_ratio")


def test_k3_ratio_under_gspo_weights_by_the_tokens_own_ratio():
    """GSPO's surrogate takes the sequence ratio; its k3_ratio KL term still weights each
    token's k3 by that token's pi/pi_old. TRL (importance_sampling_level="sequence")
    weights it by the sequence's ratio, exp(mean log r): another value off-policy."""
    logp, old, ref = np.log([[0.5, 0.2]]), np.log([[0.4, 0.25]]), np.log([[0.3, 0.3]])
    b = _batch(logp, old, np.zeros((1, 2)), ref_logp_BxT=ref)  # A = 0: the KL term alone
    cfg = AlgorithmConfig(name="gspo", kl_in="loss", kl_coef=0.1, kl_kind="k3_ratio")
    s, c, _ = jax.jit(make_objective(cfg, 8))(b, make_coef(cfg))
    d = ref - logp
    k3 = np.exp(d) - 1 - d
    by_token, by_sequence = np.exp(logp - old) * k3, np.exp(np.mean(logp - old)) * k3
    assert float(s / c) == pytest.approx(0.1 * by_token.mean(), rel=1e-5)
    assert abs(by_token.mean() - by_sequence.mean()) > 1e-3


# --- clipping: dual clip, truncation's lower bound -----------------------------------------


def test_dual_clip_is_off_by_default_and_dual_clip_3_is_verls():
    """A = -1 at r = 5: PPO's min(r A, clip(r) A) = -5; verl's clip_ratio_c = 3 bounds it at -3."""
    b = _batch([[math.log(5.0)]], [[0.0]], [[-1.0]])
    assert AlgorithmConfig().dual_clip == math.inf
    for cfg, want in [(AlgorithmConfig(name="dapo"), 5.0),
                      (AlgorithmConfig(name="dapo", dual_clip=3.0), 3.0)]:
        s, c, _ = make_objective(cfg, 8)(b, make_coef(cfg))
        assert float(s / c) == pytest.approx(want, rel=TOL)


def test_truncate_mode_raises_ratios_below_is_low_to_it():
    """TRL's truncate modes clamp the sampler ratio to [clip_min, clip_max]; is_low is that
    floor (0 by default), accepted in truncate mode and passed to the objective."""
    shift = np.array([[math.log(0.2), math.log(0.8), math.log(4.0)]])
    old = np.full((1, 3), -1.0)
    cfg = AlgorithmConfig(name="grpo", kl_coef=0.0, is_low=0.5, tis_cap=2.0)
    assert cfg.is_mode == "truncate" and float(make_coef(cfg).is_low) == 0.5
    w, m = ro.sampler_correction(jnp.asarray(old), jnp.asarray(old - shift), jnp.ones((1, 3)),
                                 low=0.5, high=2.0)
    np.testing.assert_allclose(np.asarray(w), [[0.5, 0.8, 2.0]], rtol=TOL)
    assert float(m["is_truncated_frac"][0]) == 2.0
    b = _batch(old, old, np.ones((1, 3)), sampler_logp_BxT=old - shift)
    s, c, _ = make_objective(cfg, 8)(b, make_coef(cfg))
    assert float(s / c) == pytest.approx(-(0.5 + 0.8 + 2.0) / 3, rel=TOL)
    w0, _ = ro.sampler_correction(jnp.asarray(old), jnp.asarray(old - shift), jnp.ones((1, 3)),
                                  high=2.0)  # default low = 0: no floor
    np.testing.assert_allclose(np.asarray(w0), [[0.2, 0.8, 2.0]], rtol=TOL)


# --- REINFORCE / RLOO take one update per batch -------------------------------------------


@pytest.mark.parametrize("name", ["reinforce", "rloo"])
def test_reinforce_and_rloo_refuse_several_updates_per_batch(name):
    for field in ("num_epochs", "num_minibatches"):
        with pytest.raises(ValueError, match=rf"AlgorithmConfig.{field}=2 is invalid for "
                           rf"name='{name}': its loss .* no importance ratio.*Allowed: "
                           rf"num_epochs=1 and num_minibatches=1.*name='grpo'.*name='ppo'"):
            AlgorithmConfig(name=name, **{field: 2})
    AlgorithmConfig(name=name, num_minibatches=2, objective="mypkg.mod:my_loss")  # yours: yours
    # What the message offers: RLOO's baseline under GRPO's clipped ratio.
    cfg = AlgorithmConfig(name="grpo", group_size=4, kl_coef=0.0, num_minibatches=2,
                          advantages="rljax.objectives:rloo_advantages")
    np.testing.assert_allclose(np.asarray(sequence_advantages(cfg, jnp.asarray(REWARDS))),
                               np.asarray(ro.rloo_advantages(jnp.asarray(REWARDS), 4)), rtol=TOL)


# --- KL-Cov and Clip-Cov as the authors' code ---------------------------------------------


def test_kl_cov_penalty_has_zero_gradient_on_policy():
    """At r = 1 (old = sg(logp): the first update of a batch) the selected tokens' penalty
    |log r| has gradient 0, so KL-Cov's gradient is the plain -r A's; off policy it is
    beta sign(log r) per selected token (torch's abs, as in verl's compute_policy_loss_kl_cov)."""
    logp = jnp.log(jnp.asarray([[0.5, 0.4, 0.3, 0.6]]))
    adv, sel = jnp.asarray([[1.0, -0.5, 0.8, 0.3]]), jnp.asarray([[1.0, 1.0, 0.0, 1.0]])

    def loss(lp, old, beta):
        b = _batch(lp, old, adv, cov_select_BxT=sel)
        return ro.kl_cov(b, ro.Coef(kl_cov=beta))[0]

    for old in (jax.lax.stop_gradient, lambda lp: logp):  # traced and concrete r = 1
        g = jax.grad(lambda lp: loss(lp, old(lp), 1.0))(logp)
        g0 = jax.grad(lambda lp: loss(lp, old(lp), 0.0))(logp)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))
    old = logp + jnp.asarray([[0.1, -0.2, 0.3, 0.0]])  # log r = -0.1, +0.2, -0.3, 0
    g = jax.grad(lambda lp: loss(lp, old, 1.0))(logp) - jax.grad(lambda lp: loss(lp, old, 0.0))(logp)
    np.testing.assert_allclose(np.asarray(g), [[-1.0, 1.0, 0.0, 0.0]], atol=1e-7)  # loss sum


# Covariances exactly [1, 5, 3, -1]: centred log-probs [1, -1, 1, -1] x advantages [1, -5, 3, 1].
COV_LOGP = np.array([[-1.0, -3.0, -1.0, -3.0]], np.float32)
COV_ADV = np.array([[1.0, -5.0, 3.0, 1.0]], np.float32)


def test_clip_cov_band_is_open_and_skips_clipped_tokens():
    """verl compute_policy_loss_clip_cov: candidates lb < cov < ub, minus clip_by_origin."""
    lp, adv, mask = jnp.asarray(COV_LOGP), jnp.asarray(COV_ADV), jnp.ones((1, 4))
    np.testing.assert_array_equal(np.asarray(ro.token_covariance(lp, adv, mask)), [[1, 5, 3, -1]])
    pick = functools.partial(ro.cov_selection, lp, adv, mask, rule="clip-cov", ratio=1.0,
                             low=1.0, high=5.0, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(pick()), [[0, 0, 1, 0]])  # 1 and 5 are out
    # Token 2 (A = 3 > 0) at r = e^0.5 > 1 + 0.2: PPO's clip zeroes it, so it is not drawn.
    old = COV_LOGP - np.array([[0.0, 0.0, 0.5, 0.0]], np.float32)
    clipped = ro.ppo_clipped_tokens(lp, jnp.asarray(old), adv, eps_low=0.2, eps_high=0.2)
    np.testing.assert_array_equal(np.asarray(clipped), [[0, 0, 1, 0]])
    np.testing.assert_array_equal(np.asarray(pick(exclude_BxT=clipped)), [[0, 0, 0, 0]])
    # The trainer's path: the config's band and clip, the minibatch's old log-probs.
    cfg = AlgorithmConfig(name="clip_cov", clip_cov_ratio=1.0)
    mb = {"adv_BxT": adv, "completion_mask_BxT": mask}
    key = jax.random.key(1)
    np.testing.assert_array_equal(np.asarray(cov_tokens(cfg, lp, mb, key)), [[0, 0, 1, 0]])
    mb["old_logp_BxT"] = jnp.asarray(old)
    np.testing.assert_array_equal(np.asarray(cov_tokens(cfg, lp, mb, key)), [[0, 0, 0, 0]])
    wide = dataclasses.replace(cfg, clip_high=1.0)  # the clip no longer binds: drawn again
    np.testing.assert_array_equal(np.asarray(cov_tokens(wide, lp, mb, key)), [[0, 0, 1, 0]])


def test_kl_cov_penalty_acts_after_the_first_minibatch_of_the_presets_schedule():
    """The preset's 8 minibatches per batch (verl recipe/entropy/7b_kl_cov.sh: 256 prompts,
    mini-batches of 32), on a tabular softmax policy: the first update is on-policy and
    the penalty is 0 in value and gradient; from the second, pi has moved and it acts."""
    cfg = AlgorithmConfig(name="kl_cov", group_size=2, kl_cov_ratio=0.25)
    assert cfg.resolve().num_minibatches == 8 and not cfg.single_update
    assert AlgorithmConfig(name="clip_cov").resolve().num_minibatches == 8
    objective, coef = make_objective(cfg, 4), make_coef(cfg)
    rng = np.random.default_rng(0)
    b, t, v = 16, 4, 5
    tokens = jnp.asarray(rng.integers(0, v, (b, t)))
    adv = jnp.asarray(np.repeat(rng.normal(size=(b, 1)), t, 1), jnp.float32)
    mask = jnp.ones((b, t))

    def logp_of(theta, rows):  # one softmax per position, shared by every row
        logp_TxV = jax.nn.log_softmax(theta)
        return logp_TxV[jnp.arange(t)[None, :], tokens[rows]]

    @jax.jit
    def update(theta, old_BxT, rows):
        mb = {"adv_BxT": adv[rows], "completion_mask_BxT": mask[rows], "old_logp_BxT": old_BxT[rows]}
        sel = cov_tokens(cfg, logp_of(theta, rows), mb, jax.random.key(0))

        def loss(theta, c):
            batch = ro.ObjectiveBatch(logp_BxT=logp_of(theta, rows), old_logp_BxT=old_BxT[rows],
                                      mask_BxT=mask[rows], adv_BxT=adv[rows], cov_select_BxT=sel)
            s, n, m = objective(batch, c)
            return s / n, m

        (_, m), g = jax.value_and_grad(loss, has_aux=True)(theta, coef)
        g_free = jax.grad(lambda th: loss(th, dataclasses.replace(coef, kl_cov=0.0))[0])(theta)
        return theta - 0.5 * g, m["kl_cov_penalty"][0], optax.tree.norm(g - g_free)

    theta = jnp.asarray(rng.normal(size=(t, v)), jnp.float32)
    old = jax.jit(logp_of)(theta, jnp.arange(b))
    penalties, pushes = [], []
    for rows in np.arange(b).reshape(8, 2):  # one group of 2 per minibatch
        theta, pen, push = update(theta, old, jnp.asarray(rows))
        penalties.append(float(pen))
        pushes.append(float(push))
    assert penalties[0] == 0.0 and pushes[0] == 0.0
    assert min(penalties[1:]) > 1e-3 and min(pushes[1:]) > 1e-3


def test_updates_per_batch_of_each_preset():
    """docs/objectives.md's table: the presets' num_epochs x num_minibatches. DAPO's paper
    takes 16 (512 prompts x 16, mini-batches of 512 completions): num_minibatches=16."""
    want = {"grpo": 1, "dr_grpo": 1, "dapo": 1, "gspo": 1, "rloo": 1, "reinforce": 1, "ppo": 4,
            "cispo": 1, "sapo": 1, "gmpo": 1, "clip_cov": 8, "kl_cov": 8, "distill": 1}
    for name, n in want.items():
        r = AlgorithmConfig(name=name).resolve()
        assert r.num_epochs * r.num_minibatches == n, name
    assert not AlgorithmConfig(name="dapo", num_minibatches=16).single_update


def test_new_fields_take_set_overrides():
    cfg = apply_overrides(AlgorithmConfig(), ["adv_std=sample", "adv_eps=1e-4", "kl_clamp=10",
                                              "kl_kind=k3_ratio", "is_low=0.5", "tis_cap=2"])
    assert (cfg.adv_eps, cfg.kl_clamp, cfg.kl_kind, cfg.is_low) == (1e-4, 10.0, "k3_ratio", 0.5)
    assert apply_overrides(cfg, ["kl_clamp=none"]).kl_clamp is None
