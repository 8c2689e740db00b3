"""Each algorithm, as the trainer configures it (objective + coefficients + advantages),
gives its paper's loss on a hand-made batch; configs validate; PPO/DAPO pieces."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from rljax.objectives import ObjectiveBatch
from rljax.train.config import (AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig,
                                SFTConfig, algorithm_preset)
from rljax.train.learn.algorithms import (make_coef, make_objective, overlong_shaping,
                                          resolve_overlong_buffer, sequence_advantages)
from rljax.train.learn.ppo import AdaptiveKLController, ppo_advantages

G, T, L_MAX = 4, 3, 8
REWARDS = np.array([1.0, 0.0, 0.0, 1.0], np.float32)  # the seed's first table row
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], np.float32)
LOGP = np.log(np.array([[0.5, 0.4, 0.3], [0.2, 0.6, 0.9], [0.7, 0.9, 0.9], [0.1, 0.3, 0.8]]))
OLD = np.log(np.array([[0.4, 0.4, 0.35], [0.25, 0.5, 0.9], [0.7, 0.9, 0.9], [0.15, 0.2, 0.7]]))
REF = np.log(np.array([[0.45, 0.5, 0.3], [0.3, 0.5, 0.9], [0.6, 0.9, 0.9], [0.1, 0.25, 0.9]]))


def _loss(cfg, adv_BxT, **extra):
    fn = make_objective(cfg, L_MAX)
    batch = ObjectiveBatch(logp_BxT=jnp.asarray(LOGP, jnp.float32),
                           old_logp_BxT=jnp.asarray(OLD, jnp.float32), mask_BxT=jnp.asarray(MASK),
                           adv_BxT=jnp.asarray(adv_BxT, jnp.float32),
                           ref_logp_BxT=jnp.asarray(REF, jnp.float32), **extra)
    s, c, _ = fn(batch, make_coef(cfg))
    return float(s) / float(c)


def _clip_obj(ratio, adv, lo, hi):
    return np.minimum(ratio * adv, np.clip(ratio, 1 - lo, 1 + hi) * adv)


def test_grpo_matches_deepseekmath_eq3():
    """DeepSeekMath (arXiv:2402.03300) §4.1 Eq. 3 with the k3 KL of Eq. 4, beta 0.04."""
    cfg = algorithm_preset("grpo", group_size=G)
    adv = sequence_advantages(cfg, REWARDS)
    np.testing.assert_allclose(adv, [1, -1, -1, 1], atol=1e-5)  # the seed's table
    ratio = np.exp(LOGP - OLD)
    kl = np.exp(REF - LOGP) - (REF - LOGP) - 1
    per = _clip_obj(ratio, adv[:, None], 0.2, 0.2) - 0.04 * kl
    want = -np.mean([(per[i] * MASK[i]).sum() / MASK[i].sum() for i in range(G)])
    got = _loss(cfg, adv[:, None] * MASK)
    assert got == pytest.approx(want, rel=1e-5)


def test_dapo_matches_eq8_token_level_clip_higher():
    """DAPO (arXiv:2503.14476) Eq. 8: token-level mean, clip 0.2 / 0.28, no KL."""
    cfg = algorithm_preset("dapo", group_size=G)
    adv = sequence_advantages(cfg, REWARDS)
    per = _clip_obj(np.exp(LOGP - OLD), adv[:, None], 0.2, 0.28)
    want = -(per * MASK).sum() / MASK.sum()
    assert _loss(cfg, adv[:, None] * MASK) == pytest.approx(want, rel=1e-5)


def test_dr_grpo_matches_constant_normaliser_and_no_std():
    """Dr. GRPO (arXiv:2503.20783) §3.1: A = r - mean(r); 1/G sum_i 1/L_max sum_t."""
    cfg = algorithm_preset("dr_grpo", group_size=G)
    adv = sequence_advantages(cfg, REWARDS)
    np.testing.assert_allclose(adv, REWARDS - REWARDS.mean(), atol=1e-6)
    per = _clip_obj(np.exp(LOGP - OLD), adv[:, None], 0.2, 0.2)
    want = -np.mean([(per[i] * MASK[i]).sum() / L_MAX for i in range(G)])
    assert _loss(cfg, adv[:, None] * MASK) == pytest.approx(want, rel=1e-5)


def test_gspo_matches_sequence_ratio_objective():
    """GSPO (arXiv:2507.18071) Eq. 5-7: s_i = exp(mean_t log r_it), clip 3e-4 / 4e-4."""
    cfg = algorithm_preset("gspo", group_size=G)
    adv = sequence_advantages(cfg, REWARDS)
    s = np.exp([((LOGP[i] - OLD[i]) * MASK[i]).sum() / MASK[i].sum() for i in range(G)])
    want = -np.mean(_clip_obj(s, adv, 3e-4, 4e-4))
    # The loss (~3e-4) is a difference of O(1) float32 terms: compare to float32 resolution.
    assert _loss(cfg, adv[:, None] * MASK) == pytest.approx(want, abs=1e-6)


def test_rloo_matches_leave_one_out_reinforce():
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740 §3; Kool et al. 2019):
    A_i = r_i - 1/(G-1) sum_{j != i} r_j, loss = -1/G sum_i A_i log pi(y_i)."""
    cfg = algorithm_preset("rloo", group_size=G)
    adv = sequence_advantages(cfg, REWARDS)
    want_adv = np.array([REWARDS[i] - (REWARDS.sum() - REWARDS[i]) / (G - 1) for i in range(G)])
    np.testing.assert_allclose(adv, want_adv, atol=1e-6)
    want = -np.mean([adv[i] * (LOGP[i] * MASK[i]).sum() for i in range(G)])
    assert _loss(cfg, adv[:, None] * MASK) == pytest.approx(want, rel=1e-5)


def test_reinforce_with_group_mean_baseline():
    """REINFORCE (Williams 1992) with baseline b = mean reward of the group."""
    cfg = algorithm_preset("reinforce", group_size=G)
    adv = sequence_advantages(cfg, REWARDS)
    np.testing.assert_allclose(adv, REWARDS - 0.5, atol=1e-6)
    want = -np.mean([adv[i] * (LOGP[i] * MASK[i]).sum() for i in range(G)])
    assert _loss(cfg, adv[:, None] * MASK) == pytest.approx(want, rel=1e-5)


def test_ppo_matches_clipped_surrogate_plus_clipped_value_loss():
    """PPO (arXiv:1707.06347 Eq. 9): -min(rA, clip(r)A) + c_v * 0.5 max((V-R)^2,
    (V_old + clip(V - V_old, +-eps_v) - R)^2), token mean; KL only in the reward."""
    cfg = algorithm_preset("ppo")
    rng = np.random.default_rng(0)
    adv = rng.normal(size=(G, T)) * MASK
    v, v_old, ret = (rng.normal(size=(G, T)) for _ in range(3))
    vc = v_old + np.clip(v - v_old, -0.2, 0.2)
    per = -_clip_obj(np.exp(LOGP - OLD), adv, 0.2, 0.2) + 0.5 * 0.5 * np.maximum(
        (v - ret) ** 2, (vc - ret) ** 2)
    want = (per * MASK).sum() / MASK.sum()
    f = lambda x: jnp.asarray(x, jnp.float32)
    got = _loss(cfg, adv, values_BxT=f(v), old_values_BxT=f(v_old), returns_BxT=f(ret))
    assert got == pytest.approx(want, rel=1e-5)


def test_ppo_advantages_are_gae_on_kl_penalised_rewards():
    """Ziegler et al. 2019 / InstructGPT: r_t = -beta (log pi - log ref) + R [t = last];
    GAE (Schulman et al. 2016 Eq. 16) with gamma, lambda."""
    rng = np.random.default_rng(1)
    values = rng.normal(size=(G, T)).astype(np.float32)
    beta, gamma, lam = 0.1, 0.9, 0.8
    adv, ret, r = ppo_advantages(REWARDS, LOGP, REF, values, MASK, kl_coef=beta, kl_kind="k1",
                                 gamma=gamma, lam=lam, whiten_adv=False)
    for i in range(G):
        n = int(MASK[i].sum())
        rew = -beta * (LOGP[i, :n] - REF[i, :n])
        rew[-1] += REWARDS[i]
        a, want = 0.0, np.zeros(n)
        for t in reversed(range(n)):
            v_next = values[i, t + 1] if t + 1 < n else 0.0
            a = rew[t] + gamma * v_next - values[i, t] + gamma * lam * a
            want[t] = a
        np.testing.assert_allclose(np.asarray(adv)[i, :n], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ret)[i, :n], want + values[i, :n], rtol=1e-5,
                                   atol=1e-6)


def test_adaptive_kl_controller_follows_ziegler_2019():
    ctl = AdaptiveKLController(target=6.0, horizon=10000)
    # e = clip(12/6 - 1, -0.2, 0.2) = 0.2 -> beta * (1 + 0.2 * 256 / 10000)
    assert ctl.update(0.1, 12.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    assert ctl.update(0.1, 5.4, 256) == pytest.approx(0.1 * (1 - 0.1 * 256 / 10000))
    assert AdaptiveKLController(None, 10).update(0.1, 100.0, 256) == 0.1


def test_dapo_overlong_shaping_eq13():
    # L_max 20, buffer 5: no penalty up to 15, linear to -1 at 20.
    got = overlong_shaping(np.array([10, 15, 16, 18, 20]), 20, 5, 1.0)
    np.testing.assert_allclose(got, [0, 0, -0.2, -0.6, -1.0], atol=1e-6)
    assert resolve_overlong_buffer(algorithm_preset("dapo"), 20480) == 4096
    with pytest.raises(ValueError, match="overlong_buffer=64 must be <"):
        resolve_overlong_buffer(algorithm_preset("dapo", overlong_buffer=64), 32)


def test_presets_carry_each_papers_defaults():
    g = algorithm_preset("grpo").resolve()
    assert (g.kl_coef, g.kl_kind, g.kl_in, g.clip_low) == (0.04, "k3", "loss", 0.2)
    d = algorithm_preset("dapo").resolve()
    assert (d.clip_low, d.clip_high, d.aggregation, d.dynamic_sampling) == (0.2, 0.28,
                                                                            "token-mean", True)
    p = algorithm_preset("ppo").resolve()
    assert (p.kl_in, p.kl_kind) == ("reward", "k1")


def test_user_objective_by_import_path():
    cfg = AlgorithmConfig(objective="rljax.objectives:reinforce")
    from rljax.objectives import reinforce
    assert make_objective(cfg, 8) is reinforce
    with pytest.raises(ValueError, match="AlgorithmConfig.objective='rljax.objectives:nope'"):
        make_objective(AlgorithmConfig(objective="rljax.objectives:nope"), 8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="ppo2"), r"AlgorithmConfig.name='ppo2' is invalid; allowed: one of 'grpo'"),
    (dict(aggregation="mean"), r"AlgorithmConfig.aggregation='mean'"),
    (dict(kl_kind="k4"), r"AlgorithmConfig.kl_kind='k4'"),
    (dict(group_size=1), r"AlgorithmConfig.group_size=1 .*>= 2 for grpo"),
    (dict(old_logp="cached"), r"AlgorithmConfig.old_logp='cached'"),
    (dict(kl_in="reward"), r"AlgorithmConfig.kl_in='reward'.*unless name='ppo'"),
    (dict(objective="no_colon"), r"AlgorithmConfig.objective='no_colon'"),
    (dict(num_epochs=0), r"AlgorithmConfig.num_epochs=0"),
])
def test_bad_algorithm_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AlgorithmConfig(**kwargs)


def test_bad_other_configs_are_named():
    with pytest.raises(ValueError, match="OptimConfig.schedule='step'"):
        OptimConfig(schedule="step")
    with pytest.raises(ValueError, match="OptimConfig.lr=0"):
        OptimConfig(lr=0)
    with pytest.raises(ValueError, match="SamplingConfig.temperature=0"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="RLConfig.prompts_per_step=0"):
        RLConfig(prompts_per_step=0)
    with pytest.raises(ValueError, match="SFTConfig.optim"):
        SFTConfig(optim=0.1)
    with pytest.raises(ValueError, match="unknown option.*'klcoef'"):
        algorithm_preset("grpo", klcoef=0.1)
    with pytest.raises(ValueError, match="algorithm_preset.name='trpo'"):
        algorithm_preset("trpo")
    assert math.isinf(AlgorithmConfig().dual_clip)


def test_rewards_must_divide_into_groups():
    with pytest.raises(ValueError, match="6 rewards do not divide into groups of group_size=4"):
        sequence_advantages(algorithm_preset("grpo", group_size=4), np.zeros(6, np.float32))
