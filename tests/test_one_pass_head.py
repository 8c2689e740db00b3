"""The update's one-pass output head (rljax.train.learn.onepass) gives the two-pass path's
log-probs, entropies, loss and gradients: on the head alone (tied / untied, uneven
chunks, temperatures, entropy differentiated or not) and through ``rl_loss`` for every
token-separable algorithm (importance weights, entropy bonus, PPO's value model, the
ratio's denominator recomputed or the policy itself); and only separable objectives
are routed to it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from _train_common import random_seqs, tiny_model
from rljax import objectives as obj
from rljax.models import ValueModel
from rljax.train.config import algorithm_preset
from rljax.train.learn.algorithms import make_coef, make_objective
from rljax.train.learn.logprobs import linear_logprobs
from rljax.train.learn.onepass import one_pass_head, padded_width
from rljax.train.rl import rl_loss

sg = jax.lax.stop_gradient


def _loss_terms(logp, ent, adv, with_ent):
    """A separable loss: a clipped-ratio-like term, a k3 KL term, an entropy bonus."""
    r = jnp.exp(logp - sg(logp) + 0.1)
    kl = jnp.exp(-0.5 - logp) + logp
    out = -jnp.minimum(r * adv, jnp.clip(r, 0.8, 1.2) * adv) + 0.04 * kl
    return jnp.sum(out - (0.01 * ent if with_ent else 0.0))


@pytest.mark.parametrize("vocab_major", [True, False])
def test_one_pass_head_equals_two_pass(vocab_major):
    rng = np.random.default_rng(0)
    b, t, d, v = 3, 7, 16, 50
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(0.5 * rng.normal(size=(v, d) if vocab_major else (d, v)), jnp.float32)
    tgt = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    adv = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=(2, 3, 4))
    def both(w, h, chunk, temperature, with_ent):
        opts = dict(vocab_major=vocab_major, chunk=chunk, temperature=temperature)
        width = padded_width(t, chunk)
        adv_wide = jnp.pad(adv, ((0, 0), (0, width - t)))

        def token_grads(adv_wide, lp_c, ent_c, start):
            c = lp_c.shape[1]
            a_c = jax.lax.dynamic_slice(adv_wide, (0, start), (b, c))
            return jax.grad(_loss_terms, (0, 1))(lp_c, ent_c, a_c, with_ent)

        def two(w, h):
            lp, ent = linear_logprobs(w, h, tgt, **opts)
            return _loss_terms(lp, ent, adv, with_ent), (lp, ent)

        def one(w, h):
            s, lp, ent = one_pass_head(w, h, tgt, token_grads, adv_wide,
                                       with_entropy=with_ent, **opts)
            return _loss_terms(lp, ent, adv, with_ent) + s, (lp, ent)

        return [jax.value_and_grad(f, (0, 1), has_aux=True)(w, h) for f in (two, one)]

    for chunk, temperature, with_ent in [(3, 0.7, False), (7, 1.0, True), (64, 0.7, True),
                                         (2, 1.3, True)]:
        ((l0, (lp0, e0)), g0), ((l1, (lp1, e1)), g1) = both(w, h, chunk, temperature, with_ent)
        np.testing.assert_allclose(lp1, lp0, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(e1, e0, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(l1, l0, rtol=1e-6)
        for x, y in zip(g1, g0):  # dW, dh
            assert x.shape == y.shape and x.dtype == y.dtype
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_one_pass_frozen_head_forms_no_weight_gradient():
    """A head weight that is not differentiated (LoRA's frozen base) gets no dW: the
    program has one matmul fewer than the trained head's (the control), dh unchanged."""
    rng = np.random.default_rng(5)
    h = jnp.asarray(rng.normal(size=(2, 6, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 40)), jnp.float32)
    tgt = jnp.asarray(rng.integers(0, 40, (2, 6)), jnp.int32)
    adv = jnp.asarray(rng.normal(size=(2, 6)), jnp.float32)

    def token_grads(adv, lp_c, ent_c, start):
        return jax.lax.dynamic_slice(adv, (0, start), (2, lp_c.shape[1])), 0.0 * ent_c

    def loss(w, h):
        return one_pass_head(w, h, tgt, token_grads, adv, vocab_major=False, chunk=2)[0]

    frozen, trained = jax.grad(lambda h: loss(w, h)), jax.grad(loss, (0, 1))
    np.testing.assert_array_equal(frozen(h), trained(w, h)[1])
    dots = [jax.jit(f).lower(*x).as_text().count("dot_general")
            for f, x in ((frozen, (h,)), (trained, (w, h)))]
    assert dots == [2, 3]  # the chunks' logits and dh; dW only when trained


def _batch(rng, b=8, p=4, t=6):
    seqs = random_seqs(rng, b, p, t)
    m = seqs["completion_mask_BxT"]
    seqs.update(
        adv_BxT=(rng.normal(size=(b, 1)) * m).astype(np.float32),
        old_logp_BxT=(-2.9 + 0.2 * rng.normal(size=(b, t))).astype(np.float32),
        ref_logp_BxT=(-2.9 + 0.3 * rng.normal(size=(b, t))).astype(np.float32),
        sampler_logp_BxT=(-2.9 + 0.2 * rng.normal(size=(b, t))).astype(np.float32),
        old_values_BxT=rng.normal(size=(b, t)).astype(np.float32),
        returns_BxT=rng.normal(size=(b, t)).astype(np.float32),
        cov_select_BxT=(rng.random((b, t)) < 0.2).astype(np.float32))
    return jax.tree.map(jnp.asarray, seqs)


# (algorithm, preset overrides, self_old, use_sampler): every separable objective, with
# the importance correction, an entropy bonus, PPO's value model.
CASES = [
    ("grpo", {}, True, False),
    ("grpo", {"tis_cap": 2.0, "kl_kind": "k1"}, True, True),
    ("dapo", {"entropy_coef": 0.01}, False, False),
    ("dr_grpo", {}, True, False),
    ("rloo", {"is_low": 0.5, "tis_cap": 3.0, "is_mode": "mask"}, False, True),
    ("ppo", {"entropy_coef": 0.02, "kl_in": "loss", "kl_kind": "k2"}, False, False),
    ("cispo", {}, False, False),
    ("sapo", {}, False, False),
    ("clip_cov", {}, False, False),
    ("kl_cov", {}, False, False),
    # On-policy (r = 1: the penalty's subgradient 0) with DeepSeek-V3.2's ratio-weighted k3.
    ("kl_cov", {"kl_in": "loss", "kl_coef": 0.05, "kl_kind": "k3_ratio"}, True, False),
]


@pytest.mark.parametrize("name,over,self_old,use_sampler", CASES)
def test_rl_loss_one_pass_equals_two_pass(name, over, self_old, use_sampler):
    cfg = algorithm_preset(name, group_size=4, **over)
    objective = make_objective(cfg, 8)
    assert obj.token_separable(objective)
    gd, st = tiny_model(num_layers=1)
    params = {"policy": st}
    value_gd = None
    if name == "ppo":
        value_gd, vst = nnx.split(ValueModel.from_policy(nnx.merge(gd, st), rngs=nnx.Rngs(3)))
        params["value"] = vst
    mb = _batch(np.random.default_rng(1))
    coef = make_coef(cfg)
    loss = functools.partial(rl_loss, policy_gd=gd, value_gd=value_gd, objective=objective,
                             chunk=4, temperature=0.9, remat=False, self_old=self_old,
                             use_sampler=use_sampler, entropy_grad=cfg.entropy_coef != 0)

    @jax.jit
    def run(params, mb):
        out = []
        for one_pass in (False, True):
            f = lambda p: (lambda ls, c, m: (ls, (c, m)))(*loss(p, mb, coef, one_pass=one_pass))
            out.append(jax.value_and_grad(f, has_aux=True)(params))
        return out

    ((l0, (c0, m0)), g0), ((l1, (c1, m1)), g1) = run(params, mb)
    np.testing.assert_allclose(l1, l0, rtol=1e-6, atol=1e-7)
    assert float(c1) == float(c0)
    assert m1.keys() == m0.keys()
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, atol=1e-7, err_msg=k)
    scale = float(optax.tree.norm(g0))
    assert scale > 0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * scale, err_msg=str(path))


def test_only_separable_objectives_take_the_one_pass_head():
    separable = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce", "ppo", "cispo", "sapo",
                 "clip_cov", "kl_cov"]
    for name in separable:
        assert obj.token_separable(make_objective(algorithm_preset(name, group_size=4), 8)), name
    for name in ("gspo", "gmpo", "distill"):
        assert not obj.token_separable(make_objective(algorithm_preset(name, group_size=4), 8))
    seq_level = algorithm_preset("grpo", group_size=4, is_level="sequence", tis_cap=2.0)
    assert not obj.token_separable(make_objective(seq_level, 8))
    mine = lambda batch, coef: obj.grpo(batch, coef)
    assert not obj.token_separable(mine)
    mine.token_separable = True
    assert obj.token_separable(functools.partial(mine))
    marked_off = functools.partial(obj.grpo)
    marked_off.token_separable = False
    assert not obj.token_separable(marked_off)


def test_trainer_steps_agree_on_8_devices(mesh8):
    """RLTrainer on the (data, fsdp, tensor) mesh, the head's vocabulary split over
    "tensor": two GRPO steps (KL, entropy bonus) with the one-pass head and without give
    the same metrics and weights to rounding, from separately compiled programs."""
    from _train_common import CharTok
    from rljax.train.config import OptimConfig, RLConfig, SamplingConfig
    from rljax.train.programs import CompileLog
    from rljax.train.rl import RLTrainer

    prompts = ["1+2=", "3+4=", "5+6=", "7+8="]
    source = lambda start, n: ([prompts[(start + i) % 4] for i in range(n)], [{}] * n)
    reward = lambda c, m: np.array([float(x.startswith("7")) for x in c], np.float32)
    gd, st = tiny_model(mesh=mesh8, num_layers=1)
    out = {}
    for one_pass in (True, False):
        tr = RLTrainer(gd, CharTok(), reward,
                       algorithm=algorithm_preset("grpo", group_size=4, kl_coef=0.05,
                                                  entropy_coef=0.01),
                       optim=OptimConfig(lr=1e-2), sampling=SamplingConfig(max_new_tokens=5),
                       rl=RLConfig(steps=2, prompts_per_step=2, logp_chunk=2,
                                   one_pass_head=one_pass), prompt_len=6, mesh=mesh8)
        state = tr.init_state(jax.tree.map(jnp.copy, st), seed=0)
        with CompileLog() as log:
            ms = []
            for _ in range(2):
                state, m = tr.step(state, source)
                ms.append(m)
        assert log.count > 0  # a program of its own, not the other setting's
        out[one_pass] = (ms, state.params["policy"])
    (ms1, p1), (ms0, p0) = out[True], out[False]
    for m1, m0 in zip(ms1, ms0):
        for k in ("loss", "kl_ref", "entropy", "grad_norm", "reward_mean"):
            np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # Adam divides each gradient entry by its own RMS, so an entry near zero turns its
    # rounding into an update difference of up to lr (1e-2) itself: bound it at 1e-3 lr.
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5)
