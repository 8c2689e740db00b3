"""Complete objectives against direct transcriptions of their papers' formulas."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rljax.objectives as ro
from rljax.testing import default_batch

BATCH = default_batch(7, B=8, T=6)
M = np.asarray(BATCH.mask_BxT) > 0
L = M.sum(1)


def _np(name):
    return np.where(M, np.asarray(getattr(BATCH, name), np.float64), 0.0)


def _ppo_clip_np(ratio, adv, lo, hi):
    return np.minimum(ratio * adv, np.clip(ratio, 1 - lo, 1 + hi) * adv)


def _k3_np(logp, ref):
    d = ref - logp
    return np.exp(d) - 1 - d


def _loss(fn, coef=ro.Coef(), batch=BATCH):
    s, n, metrics = jax.jit(fn)(batch, coef)
    return float(s) / float(n), {k: float(a) / float(b) for k, (a, b) in metrics.items()}


def test_grpo_is_deepseekmath_eq3():
    # -1/G sum_i 1/|o_i| sum_t [min(r A, clip(r) A) * w_tis - beta * k3], entropy bonus off.
    coef = ro.Coef(kl=0.04, clip_low=0.2, clip_high=0.2)
    logp, old, ref, adv = _np("logp_BxT"), _np("old_logp_BxT"), _np("ref_logp_BxT"), _np("adv_BxT")
    w = np.exp(old - _np("sampler_logp_BxT"))
    per_tok = -_ppo_clip_np(np.exp(logp - old), adv, 0.2, 0.2) * w + 0.04 * _k3_np(logp, ref)
    expect = np.mean([(per_tok[b] * M[b]).sum() / L[b] for b in range(len(L))])
    loss, metrics = _loss(ro.grpo, coef)
    assert loss == pytest.approx(expect, rel=1e-5)
    ratio = np.exp(logp - old)
    assert metrics["clip_frac_high"] == pytest.approx(((adv > 0) & (ratio > 1.2))[M].mean(), rel=1e-6)
    assert metrics["clip_frac_low"] == pytest.approx(((adv < 0) & (ratio < 0.8))[M].mean(), rel=1e-6)
    assert metrics["kl_ref"] == pytest.approx(_k3_np(logp, ref)[M].mean(), rel=1e-5)
    assert metrics["approx_kl_old"] == pytest.approx(_k3_np(old, logp)[M].mean(), rel=1e-5)
    assert metrics["clip_frac_high"] > 0 and metrics["clip_frac_low"] > 0  # the batch exercises both


def test_dr_grpo_and_dapo_aggregations():
    logp, old, adv = _np("logp_BxT"), _np("old_logp_BxT"), _np("adv_BxT")
    w = np.exp(old - _np("sampler_logp_BxT"))
    per_tok = -_ppo_clip_np(np.exp(logp - old), adv, 0.2, 0.28) * w
    coef = ro.Coef(kl=0.0, clip_high=0.28)
    dapo = functools.partial(ro.grpo, aggregation="token-mean", kl_kind=None)
    dr = functools.partial(ro.grpo, aggregation="seq-mean-token-sum-norm", norm_const=6.0, kl_kind=None)
    assert _loss(dapo, coef)[0] == pytest.approx(per_tok[M].sum() / M.sum(), rel=1e-5)
    assert _loss(dr, coef)[0] == pytest.approx(per_tok[M].sum() / (6.0 * len(L)), rel=1e-5)


def test_reinforce_gradient_is_minus_advantage_over_count():
    batch = default_batch(3, B=8, T=6, sampler=False, ref=False, entropy=False, values=False)
    g = jax.grad(lambda lp: ro.reinforce(dataclasses.replace(batch, logp_BxT=lp), ro.Coef())[0])(batch.logp_BxT)
    mask = np.asarray(batch.mask_BxT)
    np.testing.assert_allclose(g, -np.asarray(batch.adv_BxT) * mask, rtol=1e-6)


def test_gspo_library_matches_sequence_ratio():
    logp, old, adv = _np("logp_BxT"), _np("old_logp_BxT"), _np("adv_BxT")
    coef = ro.Coef(clip_low=0.05, clip_high=0.05)
    s_B = np.exp((logp - old).sum(1) / L)
    w = np.exp(old - _np("sampler_logp_BxT"))
    per_tok = -_ppo_clip_np(s_B[:, None], adv, 0.05, 0.05) * w
    expect = np.mean([(per_tok[b] * M[b]).sum() / L[b] for b in range(len(L))])
    assert _loss(ro.gspo, coef)[0] == pytest.approx(expect, rel=1e-5)


def test_ppo_policy_value_entropy_and_explained_variance():
    coef = ro.Coef(value=0.5, value_clip=0.2, entropy=0.01)
    logp, old, adv = _np("logp_BxT"), _np("old_logp_BxT"), _np("adv_BxT")
    v, v_old, ret, ent = _np("values_BxT"), _np("old_values_BxT"), _np("returns_BxT"), _np("entropy_BxT")
    w = np.exp(old - _np("sampler_logp_BxT"))
    v_clip = v_old + np.clip(v - v_old, -0.2, 0.2)
    vloss = 0.5 * np.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    per_tok = -_ppo_clip_np(np.exp(logp - old), adv, 0.2, 0.2) * w + 0.5 * vloss - 0.01 * ent
    s, n, metrics = jax.jit(ro.ppo)(BATCH, coef)
    assert float(s) / float(n) == pytest.approx(per_tok[M].mean(), rel=1e-5)
    assert float(metrics["value_loss"][0] / metrics["value_loss"][1]) == pytest.approx(vloss[M].mean(), rel=1e-5)
    ev = ro.explained_variance_from_sums(metrics)
    assert float(ev) == pytest.approx(1 - np.var((ret - v)[M]) / np.var(ret[M]), rel=1e-4)


def test_value_gradient_flows_only_through_values():
    coef = ro.Coef()
    g = jax.grad(lambda v: ro.ppo(dataclasses.replace(BATCH, values_BxT=v), coef)[0])(BATCH.values_BxT)
    assert np.any(np.asarray(g)[M] != 0) and np.all(np.asarray(g)[~M] == 0)


def test_zero_advantage_sequences_metric():
    adv = jnp.where(jnp.arange(8)[:, None] < 3, 0.0, BATCH.adv_BxT)
    b = dataclasses.replace(BATCH, adv_BxT=adv)
    _, _, metrics = ro.grpo(b, ro.Coef())
    assert float(metrics["zero_adv_seq_frac"][0]) == 3 and float(metrics["zero_adv_seq_frac"][1]) == 8


def test_explained_variance_matches_numpy_on_real_tokens():
    rng = np.random.default_rng(0)
    ret = rng.normal(2.0, 1.5, (4, 7)).astype(np.float32)
    v = (0.7 * ret + rng.normal(0.0, 0.5, ret.shape)).astype(np.float32)
    mask = rng.random(ret.shape) < 0.6
    # Padding holds garbage: it must not enter either variance.
    ret_pad, v_pad = np.where(mask, ret, 1e6), np.where(mask, v, -1e6)
    got = float(jax.jit(ro.explained_variance)(v_pad, ret_pad, mask.astype(np.float32)))
    r, res = ret[mask].astype(np.float64), (ret - v)[mask].astype(np.float64)
    assert got == pytest.approx(1 - np.var(res) / np.var(r), rel=1e-5)
    assert float(ro.explained_variance(ret, ret, np.ones_like(ret))) == pytest.approx(1.0)
    const = np.full_like(ret, 3.0)
    assert np.isnan(float(ro.explained_variance(v, const, np.ones_like(ret))))
