"""The shared update step: chunked log-probs, exact micro-batch accumulation, 8 devices
vs 1, non-finite skipping, schedules, batch validation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _train_common import random_seqs, tiny_model as _tiny_model
from rljax.objectives import Coef, token_logprobs
from rljax.train.config import OptimConfig, algorithm_preset
from rljax.train.learn.algorithms import make_objective
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.learn.update import (Learner, NonFiniteError, accumulate, init_opt_state,
                                      make_optimizer, make_schedule, new_train_state,
                                      num_micro_batches)
from rljax.train.programs import CompileLog
from rljax.train.rl import rl_loss
from flax import nnx


def tiny_model(mesh=None):
    """One layer: chunking, accumulation and sharding need no depth, and each layer is
    compile time."""
    return _tiny_model(mesh=mesh, num_layers=1)


def test_chunked_logprobs_equal_full_logits():
    gd, st = tiny_model()
    seqs = random_seqs(np.random.default_rng(0), 4, 5, 7)
    model = nnx.merge(gd, st)
    ids = np.concatenate([seqs["prompt_BxP"], seqs["completion_BxT"]], 1)
    mask = np.concatenate([seqs["prompt_mask_BxP"], seqs["completion_mask_BxT"]], 1) > 0
    logits = jax.jit(lambda i, m: model(i, mask_BxT=m))(jnp.asarray(ids), jnp.asarray(mask))
    logits = logits[:, 4:11] / 0.7
    want = token_logprobs(logits, jnp.asarray(seqs["completion_BxT"]))
    for chunk in (1, 3, 7, 64):  # uneven, exact and larger-than-T chunks
        got, ent = jax.jit(functools.partial(policy_logprobs, gd, chunk=chunk,
                                             temperature=0.7))(st, seqs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert ent.shape == want.shape and np.all(np.asarray(ent) >= -1e-6)


def test_chunked_logprobs_gradient_matches_unchunked():
    gd, st = tiny_model()
    seqs = random_seqs(np.random.default_rng(1), 4, 3, 6)

    def loss(p, chunk):
        lp, _ = policy_logprobs(gd, p, seqs, chunk=chunk)
        return jnp.sum(lp * seqs["completion_mask_BxT"])

    g1 = jax.jit(jax.grad(loss), static_argnums=1)(st, 2)
    g2 = jax.jit(jax.grad(loss), static_argnums=1)(st, 64)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _rl_loss_fn(gd, name="grpo"):
    cfg = algorithm_preset(name, group_size=4)
    return functools.partial(rl_loss, policy_gd=gd, value_gd=None,
                             objective=make_objective(cfg, 8), chunk=4, temperature=1.0,
                             remat=False, self_old=False, use_sampler=False, entropy_grad=False)


def _rl_batch(seed=0, b=16, p=4, t=6):
    rng = np.random.default_rng(seed)
    seqs = random_seqs(rng, b, p, t)
    m = seqs["completion_mask_BxT"]
    seqs.update(
        adv_BxT=(rng.normal(size=(b, 1)) * m).astype(np.float32),
        old_logp_BxT=(-2.5 + 0.3 * rng.normal(size=(b, t))).astype(np.float32),
        ref_logp_BxT=(-2.5 + 0.3 * rng.normal(size=(b, t))).astype(np.float32),
        sampler_logp_BxT=(-2.5 + 0.3 * rng.normal(size=(b, t))).astype(np.float32))
    return seqs


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_micro_batch_accumulation_equals_full_batch(name):
    gd, st = tiny_model()
    loss_fn = _rl_loss_fn(gd, name)
    batch = jax.tree.map(jnp.asarray, _rl_batch())
    coef = Coef()
    params = {"policy": st}
    acc = jax.jit(lambda p, b, n: accumulate(loss_fn, p, b, coef, n), static_argnums=2)
    g1, l1, c1, m1 = acc(params, batch, 1)
    g4, l4, c4, m4 = acc(params, batch, 4)
    np.testing.assert_allclose(float(l4) / float(c4), float(l1) / float(c1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(np.asarray(b) / float(c4), np.asarray(a) / float(c1),
                                   rtol=1e-6, atol=1e-6 * float(optax.tree.norm(g1)) / float(c1))
    for k in m1:
        np.testing.assert_allclose(float(m4[k][0]) / max(float(m4[k][1]), 1),
                                   float(m1[k][0]) / max(float(m1[k][1]), 1), rtol=1e-5, atol=1e-7)


def test_one_step_on_8_devices_equals_one_device(mesh8):
    batch = _rl_batch(b=16)
    optim = make_optimizer(OptimConfig(lr=1e-2), 10)
    out = {}
    for tag, mesh in (("one", None), ("eight", mesh8)):
        gd, st = tiny_model(mesh=mesh)
        learner = Learner(_rl_loss_fn(gd), {"policy": optim}, micro_batch_size=8, mesh=mesh)
        params = {"policy": st}
        g, ls, c, _ = jax.jit(lambda p, b: accumulate(learner.loss_fn, p, b, Coef(), 2))(
            params, learner.put_batch(batch))
        state = new_train_state(params, learner.init_opt_state(params), 0)
        state, metrics = learner.update(state, batch, Coef())
        out[tag] = (float(ls) / float(c), jax.tree.map(lambda x: np.asarray(x) / float(c), g),
                    float(metrics["loss"]), jax.tree.map(np.asarray, state.params))
    (l1, g1, ml1, p1), (l8, g8, ml8, p8) = out["one"], out["eight"]
    np.testing.assert_allclose(l8, l1, rtol=1e-6)
    np.testing.assert_allclose(ml8, ml1, rtol=1e-6)
    gnorm = float(optax.tree.norm(g1))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
        assert np.max(np.abs(a - b)) <= 1e-5 * gnorm
    # After one Adam step parameters agree to about lr where gradients are near zero.
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
        assert np.max(np.abs(a - b)) <= 1e-2


def test_opt_state_init_compiles_once_per_optimiser_and_layout(mesh8):
    """A trainer's states for several seeds share one compiled init (JAX's cache, the
    optimisers static); another parameter layout gets its own, with each moment sharded
    like its parameter (spelled canonically, as the step programs return it)."""
    from rljax.sharding import canonical_sharding

    txs = {"policy": make_optimizer(OptimConfig(lr=1e-2), 10)[0]}
    one, eight = {"policy": tiny_model()[1]}, {"policy": tiny_model(mesh=mesh8)[1]}
    with CompileLog() as log:
        first, again = init_opt_state(txs, one), init_opt_state(txs, one)
        sharded = init_opt_state(txs, eight, mesh8)
    assert log.by_name()["jit(_opt_init)"] == 2, log.compiles
    jax.tree.map(np.testing.assert_array_equal, first, again)
    by_shape = {}
    for p in jax.tree.leaves(eight):
        by_shape.setdefault(p.shape, set()).add(canonical_sharding(p.sharding))
    moments = [m for m in jax.tree.leaves(sharded) if m.ndim]
    assert len(moments) == 2 * len(jax.tree.leaves(eight))  # Adam's mu and nu
    assert all(m.sharding in by_shape[m.shape] for m in moments)
    assert any(not m.sharding.is_fully_replicated for m in moments)


def _sft_like_loss(scale):
    def loss_fn(params, mb, coef):
        w = params["policy"]["w"]
        per = jnp.sum((mb["x_BxN"] @ w - mb["y_B"][:, None]) ** 2, axis=1) * scale
        return jnp.sum(per), jnp.float32(per.shape[0]), {"per": (jnp.sum(per), per.shape[0])}
    return loss_fn


def _toy_state(learner):
    params = {"policy": {"w": jnp.ones((3, 1))}}
    return new_train_state(params, learner.init_opt_state(params), 0)


def _toy_batch(bad=False):
    x = np.ones((4, 3), np.float32)
    if bad:
        x[2, 1] = np.nan
    return {"x_BxN": x, "y_B": np.zeros(4, np.float32)}


def test_nonfinite_loss_skips_update_and_counts():
    learner = Learner(_sft_like_loss(1.0), {"policy": make_optimizer(OptimConfig(lr=0.1), 10)},
                      max_nonfinite=3)
    state = _toy_state(learner)
    w0 = np.asarray(state.params["policy"]["w"])
    state, m = learner.update(state, _toy_batch(bad=True), None)
    assert float(m["skipped_update"]) == 1.0 and int(state.skipped) == 1
    np.testing.assert_array_equal(np.asarray(state.params["policy"]["w"]), w0)
    assert int(state.updates) == 0
    state, m = learner.update(state, _toy_batch(), None)  # a finite one resets the run
    assert float(m["skipped_update"]) == 0.0 and int(state.nonfinite_run) == 0
    assert int(state.updates) == 1 and not np.array_equal(state.params["policy"]["w"], w0)


def test_run_of_nonfinite_updates_stops_naming_the_step():
    learner = Learner(_sft_like_loss(1.0), {"policy": make_optimizer(OptimConfig(lr=0.1), 10)},
                      max_nonfinite=2)
    state = dataclasses.replace(_toy_state(learner), step=jnp.int32(7))
    state, _ = learner.update(state, _toy_batch(bad=True), None)
    with pytest.raises(NonFiniteError, match="step 7: 2 consecutive"):
        learner.update(state, _toy_batch(bad=True), None)


def test_batch_must_divide_into_micro_batches():
    with pytest.raises(ValueError, match="micro_batch_size=3 does not divide"):
        num_micro_batches(16, 3)
    assert num_micro_batches(16, 4) == 4 and num_micro_batches(16, 0) == 1


def test_schedule_warmup_then_cosine():
    sched = make_schedule(OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine",
                                      min_lr_ratio=0.1), 14)
    vals = [float(sched(i)) for i in range(15)]
    np.testing.assert_allclose(vals[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert vals[4] == pytest.approx(1.0) and vals[14] == pytest.approx(0.1, rel=1e-5)
    assert all(a >= b for a, b in zip(vals[4:], vals[5:]))
