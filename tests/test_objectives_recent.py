"""The 2025 objectives (CISPO, SAPO, GMPO, Clip-Cov, KL-Cov), the sampler-gap correction
and truncation masking, each against a numpy transcription of its paper's equation.

Hand batch: 4 completions of lengths 4, 3, 2, 1 with GRPO-style advantages (one per
completion) and junk at masked positions. Hand gradients are central finite differences
(float64) of the numpy transcription; library and hand agree to 1e-6 in loss and
gradient (no token sits within 1e-3 of a clip boundary or a kink of |log r|).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import objectives as ro
from rljax.testing import check_objective, default_batch
from rljax.train.config import AlgorithmConfig
from rljax.train.learn.algorithms import cov_rule, make_coef, make_objective

TOL = 1e-6
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], np.float64)
P = np.array([[0.5, 0.4, 0.3, 0.6], [0.2, 0.6, 0.9, 0.5], [0.7, 0.35, 0.9, 0.9],
              [0.1, 0.3, 0.8, 0.4]])
Q = np.array([[0.4, 0.45, 0.35, 0.3], [0.25, 0.5, 0.6, 0.5], [0.5, 0.3, 0.9, 0.9],
              [0.15, 0.2, 0.7, 0.4]])
LOGP, OLD = np.log(P), np.log(Q)
ADV_B = np.array([1.0, -0.5, 0.8, -1.2])
ADV = ADV_B[:, None] * MASK
SEL = np.array([[0, 1, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], np.float64)
JUNK = 5.0  # at masked positions of every field


def _batch(logp=LOGP, **extra) -> ro.ObjectiveBatch:
    f = lambda x: jnp.asarray(np.where(MASK > 0, x, JUNK), jnp.float32)  # noqa: E731
    extra = {k: f(v) for k, v in extra.items()}
    return ro.ObjectiveBatch(logp_BxT=f(logp), old_logp_BxT=f(OLD), mask_BxT=jnp.asarray(MASK),
                             adv_BxT=f(ADV), **extra)


def _library(fn, coef, logp=LOGP, **extra):
    """(loss, d loss / d logp, metrics) of the library objective, loss = sum / count."""
    @jax.jit
    def loss(batch):
        def f(lp):
            s, c, m = fn(dataclasses.replace(batch, logp_BxT=lp), coef)
            return s / c, m

        return jax.value_and_grad(f, has_aux=True)(batch.logp_BxT)

    (value, metrics), grad = loss(_batch(logp, **extra))
    return float(value), np.asarray(grad, np.float64), metrics


def _hand_grad(f, logp=LOGP, h=1e-6):
    """Central finite differences of the numpy loss f(logp) on the real tokens."""
    g = np.zeros_like(logp)
    for i, j in zip(*np.nonzero(MASK)):
        e = np.zeros_like(logp)
        e[i, j] = h
        g[i, j] = (f(logp + e) - f(logp - e)) / (2 * h)
    return g


def _token_mean(x):
    return (x * MASK).sum() / MASK.sum()


def _seq_mean_token_mean(x):
    return np.mean((x * MASK).sum(1) / MASK.sum(1))


def _assert_matches(fn, coef, hand_loss, **extra):
    got, grad, metrics = _library(fn, coef, **extra)
    assert abs(got - hand_loss(LOGP)) <= TOL, (got, hand_loss(LOGP))
    np.testing.assert_allclose(grad, _hand_grad(hand_loss), rtol=0, atol=TOL)
    assert np.all(grad[MASK == 0] == 0.0)
    return metrics


def test_cispo_matches_minimax_m1_eq4():
    """J = 1/sum|o| sum sg(clip(r, 1-eps_lo, 1+eps_hi)) A log pi (the weight is data)."""
    coef = ro.Coef(clip_low=0.1, clip_high=0.28)
    w = np.clip(np.exp(LOGP - OLD), 0.9, 1.28)  # fixed at the current point (stop-gradient)
    metrics = _assert_matches(ro.cispo, coef, lambda lp: -_token_mean(w * ADV * lp))
    clipped = ((np.exp(LOGP - OLD) < 0.9) | (np.exp(LOGP - OLD) > 1.28)) * MASK
    assert float(metrics["is_weight_clip_frac"][0]) == clipped.sum() == 7


def test_sapo_matches_soft_gate_objective():
    """J = 1/G sum_i 1/|y_i| sum_t (4/tau) sigmoid(tau (r - 1)) A, tau 1.0 / 1.05 by sign."""
    tau = np.where(ADV > 0, 1.0, 1.05)

    def hand(lp):
        r = np.exp(lp - OLD)
        return -_seq_mean_token_mean(4.0 / tau / (1.0 + np.exp(-tau * (r - 1.0))) * ADV)

    _assert_matches(ro.sapo, ro.Coef(), hand)


def test_gmpo_matches_geometric_mean_objective():
    """J = 1/G sum_i sgn(A_i) prod_t |min(r A_i, clip(r, e^-eps, e^eps) A_i)|^(1/|o_i|),
    written as the paper's product (not rljax's log-space form)."""
    eps = 0.2

    def hand(lp):
        r = np.exp(lp - OLD)
        per = np.minimum(r * ADV_B[:, None], np.clip(r, np.exp(-eps), np.exp(eps)) * ADV_B[:, None])
        geo = [np.prod(np.abs(per[i, :n])) ** (1.0 / n) for i, n in enumerate([4, 3, 2, 1])]
        return -np.mean(np.sign(ADV_B) * np.array(geo))

    metrics = _assert_matches(ro.gmpo, ro.Coef(clip_low=eps, clip_high=eps), hand)
    # Clipped in log space: row 0 tokens 0 and 3, row 1 token 0, row 2 token 0, row 3 all.
    assert float(metrics["clip_frac"][0]) == 5


def test_clip_cov_detaches_the_selected_tokens():
    """PPO's clipped surrogate; selected tokens contribute 0, still counted (token-mean)."""
    lo, hi = 0.15, 0.3

    def hand(lp):
        r = np.exp(lp - OLD)
        obj = np.minimum(r * ADV, np.clip(r, 1 - lo, 1 + hi) * ADV)
        return -_token_mean((1 - SEL) * obj)

    _assert_matches(ro.clip_cov, ro.Coef(clip_low=lo, clip_high=hi), hand, cov_select_BxT=SEL)


def test_kl_cov_penalises_the_selected_tokens():
    """-r A + beta |log r| on the selected tokens, no clip, beta = coef.kl_cov."""
    def hand(lp):
        r = np.exp(lp - OLD)
        return -_token_mean(r * ADV - 0.7 * SEL * np.abs(lp - OLD))

    _assert_matches(ro.kl_cov, ro.Coef(kl_cov=0.7), hand, cov_select_BxT=SEL)
    with pytest.raises(ValueError, match=r"kl_cov needs ObjectiveBatch field\(s\) \['cov_select_BxT'\]"):
        ro.kl_cov(_batch(), ro.Coef())


# Sampler log-probs: per-sequence sums of log rho = 0.1, 1.2 (outside [0.5, 2]), -0.3, -0.5.
SHIFT = np.array([[0.1, -0.05, 0.02, 0.03], [0.5, 0.4, 0.3, 0.0], [-0.1, -0.2, 0.0, 0.0],
                  [-0.5, 0.0, 0.0, 0.0]])
SAMPLER = OLD - SHIFT  # log rho = old - sampler = SHIFT


def test_sequence_mis_zeroes_a_sequence_outside_the_band_and_reports_hand_metrics():
    """Sequence-level masked IS on GRPO: the sequence whose prod rho = e^1.2 > 2 gives
    exactly zero loss and gradient; the others are weighted by their rho_i."""
    fn = functools.partial(ro.grpo, kl_kind=None, is_level="sequence", is_mode="mask")
    coef = ro.Coef(clip_low=0.2, clip_high=0.2, is_low=0.5, tis_cap=2.0)
    seq_log_rho = (SHIFT * MASK).sum(1)
    w_B = np.where((seq_log_rho >= np.log(0.5)) & (seq_log_rho <= np.log(2.0)), np.exp(seq_log_rho), 0)
    assert w_B[1] == 0 and np.all(w_B[[0, 2, 3]] > 0)

    def hand(lp):
        r = np.exp(lp - OLD)
        return -_seq_mean_token_mean(w_B[:, None] * np.minimum(r * ADV, np.clip(r, 0.8, 1.2) * ADV))

    metrics = _assert_matches(fn, coef, hand, sampler_logp_BxT=SAMPLER)
    _, grad, _ = _library(fn, coef, sampler_logp_BxT=SAMPLER)
    assert np.all(grad[1] == 0.0)
    # Row 1 changed to anything else: same loss (it contributes exactly nothing).
    other = LOGP.copy()
    other[1] += 0.3
    assert _library(fn, coef, sampler_logp_BxT=SAMPLER, logp=other)[0] == _library(
        fn, coef, sampler_logp_BxT=SAMPLER)[0]
    n = MASK.sum()
    rho = np.exp(SHIFT)
    want = {"is_masked_frac": (1.0, 4.0), "is_ratio": ((rho * MASK).sum(), n),
            "is_seq_log_ratio": (seq_log_rho.sum(), 4.0),
            "is_kl": (((rho - 1 - SHIFT) * MASK).sum(), n)}
    for k, (s, c) in want.items():
        np.testing.assert_allclose([float(metrics[k][0]), float(metrics[k][1])], [s, c],
                                   rtol=TOL, atol=TOL, err_msg=k)


@pytest.mark.parametrize("level, mode", [("token", "truncate"), ("token", "mask"),
                                         ("sequence", "truncate")])
def test_sampler_correction_weights_match_hand_values(level, mode):
    w, m = ro.sampler_correction(jnp.asarray(OLD), jnp.asarray(SAMPLER), jnp.asarray(MASK),
                                 level=level, mode=mode, low=0.9, high=1.2)
    log_rho = SHIFT if level == "token" else np.broadcast_to((SHIFT * MASK).sum(1)[:, None], MASK.shape)
    rho = np.exp(log_rho)
    if mode == "truncate":  # raised to low, lowered to high (TRL's truncate modes)
        want, changed = np.clip(rho, 0.9, 1.2), (rho > 1.2) | (rho < 0.9)
    else:
        inside = (rho >= 0.9) & (rho <= 1.2)
        want, changed = np.where(inside, rho, 0.0), ~inside
    np.testing.assert_allclose(np.asarray(w), want * MASK, rtol=TOL, atol=TOL)
    name = "is_truncated_frac" if mode == "truncate" else "is_masked_frac"
    frac = (changed * MASK).sum() if level == "token" else changed[:, 0].sum()
    assert float(m[name][0]) == frac and float(m[name][1]) == (MASK.sum() if level == "token" else 4)


@pytest.mark.parametrize("aggregation", ro.AGGREGATIONS)
def test_truncated_completions_contribute_nothing_exactly_under_micro_batching(aggregation):
    """mask_truncated_completions: the full batch equals the sum of its two micro-batches
    (loss sum, count, gradient), truncated rows get zero gradient, and changing their
    values changes nothing: in every aggregation mode."""
    b = default_batch(3, B=8, T=6, values=False, ref=False, sampler=False, entropy=False)
    truncated_B = jnp.asarray([0, 1, 0, 0, 1, 0, 0, 1], jnp.float32)
    b = dataclasses.replace(b, mask_BxT=ro.mask_truncated_completions(b.mask_BxT, truncated_B))
    fn = functools.partial(ro.grpo, aggregation=aggregation, kl_kind=None, norm_const=6.0)

    def pieces(batch):
        def f(logp, rows):
            s, c, _ = fn(jax.tree.map(lambda x: x[rows], dataclasses.replace(batch, logp_BxT=logp)),
                         ro.Coef())
            return s, c

        grad = jax.grad(lambda lp, r: f(lp, r)[0])
        full, half = np.arange(8), (np.arange(4), np.arange(4, 8))
        return (f(batch.logp_BxT, full), grad(batch.logp_BxT, full),
                [f(batch.logp_BxT, h) for h in half], [grad(batch.logp_BxT, h) for h in half])

    run = jax.jit(pieces)
    (s, c), g, halves, half_grads = run(b)
    np.testing.assert_allclose(sum(h[0] for h in halves), s, rtol=TOL)
    assert float(sum(h[1] for h in halves)) == float(c)
    np.testing.assert_allclose(sum(half_grads), g, rtol=TOL, atol=TOL * np.abs(g).max())
    rows = np.asarray(truncated_B) > 0
    assert np.all(np.asarray(g)[rows] == 0.0)
    kept_len = np.asarray(b.mask_BxT).sum(1)[~rows]
    want_count = {"token-mean": kept_len.sum(), "seq-mean-token-sum-norm": 6.0 * len(kept_len)}
    assert float(c) == want_count.get(aggregation, len(kept_len))
    junk = dataclasses.replace(b, logp_BxT=jnp.where(rows[:, None], 0.7, b.logp_BxT),
                               adv_BxT=jnp.where(rows[:, None], -3.0, b.adv_BxT))
    (s2, c2), *_ = run(junk)
    assert float(s2) == float(s) and float(c2) == float(c)


def _hand_cov(logp, adv, mask):
    real = mask > 0
    return np.where(real, (logp - logp[real].mean()) * (adv - adv[real].mean()), 0.0)


def test_cov_selection_picks_the_papers_tokens_on_a_hand_batch():
    """KL-Cov: the top floor(k N) tokens by covariance; Clip-Cov: floor(r N) tokens drawn
    among those with covariance in [low, high] (all of them when r N covers the band)."""
    lp, adv, mask = jnp.asarray(LOGP), jnp.asarray(ADV * 3.0), jnp.asarray(MASK)
    cov = _hand_cov(LOGP, ADV * 3.0, MASK)
    np.testing.assert_allclose(np.asarray(ro.token_covariance(lp, adv, mask)), cov, atol=TOL)
    n = int(MASK.sum())  # 10 real tokens
    top3 = np.argsort(-np.where(MASK > 0, cov, -np.inf), axis=None)[:3]
    want = np.zeros(MASK.size)
    want[top3] = 1
    got = ro.cov_selection(lp, adv, mask, rule="kl-cov", ratio=0.3)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), want)
    band = (MASK > 0) & (cov >= 0.2) & (cov <= 1.5)
    assert 2 < band.sum() < n
    key = jax.random.key(0)
    every = ro.cov_selection(lp, adv, mask, rule="clip-cov", ratio=1.0, low=0.2, high=1.5, key=key)
    np.testing.assert_array_equal(np.asarray(every), band.astype(np.float32))
    draws = {tuple(np.asarray(ro.cov_selection(lp, adv, mask, rule="clip-cov", ratio=0.2, low=0.2,
                                               high=1.5, key=jax.random.key(s))).reshape(-1))
             for s in range(8)}
    for d in draws:  # floor(0.2 * 10) = 2 tokens, always inside the band
        assert sum(d) == 2 and np.all(np.asarray(d).reshape(MASK.shape)[~band] == 0)
    assert len(draws) > 1  # random among the band's tokens
    assert float(ro.cov_selection(lp, adv, mask, rule="kl-cov", ratio=1e-4).sum()) == 1  # >= 1


# One conformance check for all of them (one compiled program, shared): every objective
# in token-mean, each with the sampler-gap correction on, summed; metrics by name.
# On-policy distillation (tests/test_distillation.py) rides along, discounted reward-to-go.
_ALL = {"cispo": (ro.cispo, {}), "sapo": (ro.sapo, {}), "gmpo": (ro.gmpo, {}),
        "clip_cov": (ro.clip_cov, {}), "kl_cov": (ro.kl_cov, {}),
        "grpo_seq_mis": (ro.grpo, dict(is_level="sequence", is_mode="mask")),
        "distill": (ro.distill, dict(discount=0.5))}


def _all_objectives(batch, coef):
    total, count, metrics = 0.0, None, {}
    for name, (fn, kw) in _ALL.items():
        s, count, m = fn(batch, coef, aggregation="token-mean", **kw)
        total = total + s
        metrics.update({f"{name}/{k}": v for k, v in m.items()})
    return total, count, metrics


def test_check_objective_passes_for_every_new_objective():
    # The reference / entropy terms are the library's frame, checked in test_check_objective.
    b = default_batch(0, values=False, ref=False, entropy=False)
    # Cov selections are sparse in use (2e-4 .. 2e-3 of the tokens); 10% here.
    sel = (np.random.default_rng(0).random(b.mask_BxT.shape) < 0.1).astype(np.float32)
    # Advantages of mean 0.5 (still both signs): with zero-mean ones a loss like KL-Cov's
    # sum(-r A) cancels to ~1/300 of its terms.
    rng = np.random.default_rng(1)
    teacher = np.where(b.mask_BxT > 0, np.asarray(b.old_logp_BxT) + rng.normal(0, 0.5, sel.shape),
                       rng.normal(0, 3.0, sel.shape))  # junk where masked, as default_batch
    b = dataclasses.replace(b, cov_select_BxT=jnp.asarray(sel), adv_BxT=b.adv_BxT + 0.5,
                            teacher_logp_BxT=jnp.asarray(teacher, jnp.float32))
    coef = ro.Coef(clip_low=0.5, clip_high=0.28, is_low=0.5, tis_cap=2.0)
    out = check_objective(_all_objectives, coef, batch=b,
                          requires=("cov_select_BxT", "teacher_logp_BxT"))
    assert np.isfinite(out["loss"])


@pytest.mark.parametrize("name, fn", [("cispo", ro.cispo), ("sapo", ro.sapo), ("gmpo", ro.gmpo),
                                      ("clip_cov", ro.clip_cov), ("kl_cov", ro.kl_cov)])
def test_names_select_their_objective_coefficients_and_selection(name, fn):
    cfg = AlgorithmConfig(name=name, is_level="sequence", is_mode="mask", is_low=0.5,
                          tis_cap=3.0, sapo_tau_neg=1.2, kl_cov_coef=0.5)
    f = make_objective(cfg, 8)
    assert f.func is fn and f.keywords["is_level"] == "sequence" and f.keywords["is_mode"] == "mask"
    assert f.keywords["aggregation"] == cfg.resolve().aggregation
    coef = make_coef(cfg)
    assert (float(coef.is_low), float(coef.tis_cap), float(coef.sapo_tau_neg),
            float(coef.kl_cov)) == (0.5, 3.0, np.float32(1.2), 0.5)
    want = {"clip_cov": ("clip-cov", 2e-4, 1.0, 5.0), "kl_cov": ("kl-cov", 2e-3, 0.0, 0.0)}
    assert cov_rule(cfg) == want.get(name)


def _spy(real, seen: list):
    """``real`` (an objective) recording, per call, log r, the gradient of KL-Cov's
    penalty with respect to the log-probs, and the selected real tokens."""
    def spy(b, coef):
        def penalty(lp):
            at = dataclasses.replace(b, logp_BxT=lp)
            return real(at, coef)[0] - real(at, dataclasses.replace(coef, kl_cov=0.0))[0]

        jax.debug.callback(lambda *x: seen.append([np.asarray(v) for v in x]),
                           b.logp_BxT - b.old_logp_BxT, jax.grad(penalty)(b.logp_BxT),
                           b.cov_select_BxT * b.mask_BxT, ordered=True)
        return real(b, coef)

    return spy


@pytest.mark.slow
def test_learning_program_wires_kl_cov_truncation_masking_and_sequence_is(monkeypatch):
    """The trainer's learning program with name="kl_cov", mask_truncated and sequence-level
    IS: the Cov selection and the correction reach the
    objective (their metrics), and the truncated rows' tokens change no parameter. The
    preset's 8 minibatches per batch with pi_old from a forward before them (here one ulp
    off the policy's, as a differently compiled forward may round): the scan's first
    update runs on the parameters pi_old came from, and there every token has log r == 0
    bitwise (pi_old = sg(logp) of the same forward) and the penalty's gradient is 0;
    updates after the first see r != 1, so the penalty acts."""
    from _train_common import CharTok, random_seqs, tiny_model
    from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
    from rljax.train import learn
    from rljax.train.learn import algorithms
    from rljax.train.programs.step import learn_fn
    from rljax.train.rl import RLTrainer
    from rljax.train.batch import Rollout

    gd, st = tiny_model(num_layers=1)  # the wiring, not the depth
    cfg = algorithm_preset("kl_cov", group_size=2, mask_truncated=True, is_level="sequence", tis_cap=2.0,
                           kl_cov_ratio=0.1)
    tr = RLTrainer(gd, CharTok(), lambda c, m: np.zeros(len(c), np.float32), algorithm=cfg,
                   optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=4),
                   rl=RLConfig(steps=2, prompts_per_step=4, logp_chunk=2), prompt_len=8)
    assert tr.old_mode == "recompute"
    seen: list = []
    monkeypatch.setattr(algorithms, "make_objective",
                        lambda a, n, real=algorithms.make_objective(cfg, 4): _spy(real, seen))
    prepare = learn._prepare

    def nudged(*args):  # a separate forward's rounding, made certain: one ulp on every token
        batch, extra = prepare(*args)
        return dict(batch, old_logp_BxT=jnp.nextafter(batch["old_logp_BxT"], 0.0)), extra

    monkeypatch.setattr(learn, "_prepare", nudged)
    rng = np.random.default_rng(0)
    s = random_seqs(rng, 8, 6, 4)
    trunc_B = np.array([0, 1, 0, 0, 0, 0, 1, 0], np.float32)
    sampler = (np.log(1 / 19) + 0.05 * rng.standard_normal((8, 4))).astype(np.float32)
    other = s["completion_BxT"].copy()
    other[trunc_B > 0] = (other[trunc_B > 0] + 3) % 17 + 2
    learn = jax.jit(learn_fn(tr.base_spec))
    outs = []
    for comp in (s["completion_BxT"], other):
        ro_ = Rollout(s["prompt_BxP"], s["prompt_mask_BxP"], comp, s["completion_mask_BxT"],
                      sampler, trunc_B, np.array([1, 0, 0, 1, 1, 0, 1, 0], np.float32),
                      np.zeros(8, np.float32), np.ones(8, np.float32), group_size=2)
        state = tr.init_state(jax.tree.map(jnp.copy, st))
        counters = (state.updates, state.nonfinite_run, state.skipped)
        outs.append(learn(state.params, state.opt_state, counters, None, ro_, state.kl_coef,
                          jax.random.key(0)))
    calls = len(seen) // 16  # per update and run (the one-pass head calls it per chunk too)
    assert len(seen) == 16 * calls > 0
    for log_r, push, sel in seen[:calls]:  # the first update
        assert sel.sum() >= 1
        np.testing.assert_array_equal(log_r, 0.0)  # bitwise, every token
        np.testing.assert_array_equal(push, 0.0)
    later = seen[calls:8 * calls]
    assert max(np.abs(x[1]).max() for x in later) > 0
    assert all(np.abs(x[0][x[2] > 0]).min() > 0 for x in later if x[2].sum() > 0)
    m = outs[0][4]
    for k in ("cov_selected_frac", "kl_cov_penalty", "is_truncated_frac", "is_kl", "loss"):
        assert np.isfinite(float(m[k])), k
    assert float(m["cov_selected_frac"]) > 0
    assert cfg.resolve().num_minibatches == 8 and float(m["kl_cov_penalty"]) > 1e-6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0), outs[0][0],
                 outs[1][0])
