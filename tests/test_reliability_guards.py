"""Issue 20, item 2: every numerical guard with a test that injects the fault.

The guard (rljax.train.learn.update.make_update): an update whose loss or gradient norm is not
finite is skipped, parameters and optimiser state come back bit for bit as they went in,
the skip is counted, and `max_nonfinite` consecutive skips raise NonFiniteError. Faults
are injected into the real RL micro-batch loss (`rljax.train.rl.rl_loss`, GRPO with a k3
KL term) of a tiny decoder computing in bfloat16: NaN / inf in the logits (through the
weights of the output head), NaN / -inf in the old and reference log-probs, a float32
weight that overflows bfloat16 in the forward, an infinite gradient of a finite loss, and
a NaN in one micro-batch of several. NaN at padding positions must not cost an update.
Every case runs the same compiled update (only values change). The export guard: a
non-finite weight, or one that overflows bfloat16, is refused with the tensor's name
and nothing is written.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _train_common import random_seqs, tiny_model
from flax import nnx

from rljax.models.hf_io import save_pretrained
from rljax.train.config import OptimConfig, algorithm_preset
from rljax.train.learn import algorithms as alg
from rljax.train.learn.update import Learner, NonFiniteError, make_optimizer, new_train_state
from rljax.train.rl import rl_loss

BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # ~3.39e38 < float32's ~3.40e38
T = 4


def _bits(tree) -> list[bytes]:
    """Every leaf's bytes (NaN-safe, -0.0 != 0.0): what "bit-identical" compares."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _copy(tree):
    """Fresh device buffers (the update donates what it is given)."""
    return jax.tree.map(lambda x: jnp.array(np.array(x)), tree)


@pytest.fixture(scope="module")
def rl():
    """A learner on GRPO's loss with a k3 KL term, a bf16-compute decoder, a batch, and
    the state after one finite update (so Adam's moments and count are not zero)."""
    gd, params = tiny_model(num_layers=1, compute_dtype="bfloat16")
    a = algorithm_preset("grpo", kl_coef=0.1, group_size=4)
    loss = functools.partial(rl_loss, policy_gd=gd, value_gd=None,
                             objective=alg.make_objective(a, T), chunk=T, temperature=1.0,
                             remat=False, self_old=False, use_sampler=False,
                             entropy_grad=False)
    learner = Learner(loss, {"policy": make_optimizer(OptimConfig(lr=1e-2), 10)},
                      max_nonfinite=3)
    batch = random_seqs(np.random.default_rng(0), 4, 4, T)
    m = batch["completion_mask_BxT"]
    batch.update(old_logp_BxT=-2.0 * m, ref_logp_BxT=-2.5 * m, sampler_logp_BxT=-2.0 * m,
                 adv_BxT=np.array([[1.0], [-1.0], [0.5], [-0.5]], np.float32) * m)
    state = new_train_state({"policy": params}, learner.init_opt_state({"policy": params}),
                            seed=0)
    coef = alg.make_coef(a, 0.1)
    state, metrics = learner.update(state, batch, coef)
    assert float(metrics["skipped_update"]) == 0 and int(state.updates) == 1
    return learner, _copy(state), batch, coef


def _update(rl, params_fn=None, **batch_fix):
    """One update from the fixture's state with a fault injected into the policy's
    weights (`params_fn(flat dict) -> None`, in place) or into batch fields
    (`name=fn(array) -> array`); returns `(state in, state out, metrics)`."""
    learner, state, batch, coef = rl
    state = _copy(state)
    if params_fn is not None:
        flat = {k: np.array(v) for k, v in nnx.to_flat_state(state.params["policy"])}
        params_fn(flat)
        for k, v in nnx.to_flat_state(state.params["policy"]):
            v.set_value(jnp.asarray(flat[k]))
    batch = {k: (batch_fix[k](v.copy()) if k in batch_fix else v) for k, v in batch.items()}
    before = _copy(state)
    after, metrics = learner.update(state, batch, coef)
    return before, after, metrics


def _assert_skipped(before, after, metrics):
    assert float(metrics["skipped_update"]) == 1.0
    assert _bits(after.params) == _bits(before.params), "parameters changed"
    assert _bits(after.opt_state) == _bits(before.opt_state), "optimiser state changed"
    assert int(after.updates) == int(before.updates)  # the schedule's clock stands still
    assert int(after.skipped) == int(before.skipped) + 1
    assert int(after.nonfinite_run) == int(before.nonfinite_run) + 1


def _set_row(name: str, col: int, value: float):
    """Put `value` in column `col` of weight `name` (the output head: one vocab entry's
    logit becomes non-finite at every position)."""
    def fix(flat):
        flat[(name,)][:, col] = value
    return fix


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_logits_skip_the_update_bit_for_bit(rl, value):
    _assert_skipped(*_update(rl, _set_row("lm_head", 5, value)))


@pytest.mark.parametrize("field,value", [("old_logp_BxT", np.nan), ("old_logp_BxT", -np.inf),
                                         ("ref_logp_BxT", np.nan), ("ref_logp_BxT", np.inf)])
def test_nonfinite_logprobs_skip_the_update_bit_for_bit(rl, field, value):
    def poison(x):  # one real (unmasked) token of row 0
        x[0, 0] = value
        return x
    _assert_skipped(*_update(rl, **{field: poison}))


def test_bfloat16_overflow_in_the_forward_is_caught(rl):
    # A finite float32 master weight above bfloat16's largest finite value becomes inf
    # when the forward casts it for compute: the logits go non-finite, the update is
    # skipped, and the float32 masters are left exactly as they were.
    def big(flat):
        flat[("layers", 0, "mlp", "up")][0, 0] = np.float32(3.4e38)
    assert np.isfinite(np.float32(3.4e38)) and 3.4e38 > BF16_MAX
    before, after, metrics = _update(rl, big)
    _assert_skipped(before, after, metrics)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(after.params))


def test_nan_at_padding_positions_costs_no_update(rl):
    _, _, batch, _ = rl
    pad = np.argwhere(batch["completion_mask_BxT"] == 0)
    assert len(pad), "the fixture's batch has padding"

    def poison(x):
        x[tuple(pad.T)] = np.nan
        return x
    before, after, metrics = _update(rl, old_logp_BxT=poison, ref_logp_BxT=poison,
                                     sampler_logp_BxT=poison)
    assert float(metrics["skipped_update"]) == 0.0 and np.isfinite(float(metrics["loss"]))
    assert _bits(after.params) != _bits(before.params)


def test_consecutive_skips_raise_nonfinite_error_and_keep_the_last_good_state(rl):
    learner, state, batch, coef = rl
    good = _bits((state.params, state.opt_state))
    bad = dict(batch, old_logp_BxT=np.full_like(batch["old_logp_BxT"], np.nan))
    s = _copy(state)
    for _ in range(learner.max_nonfinite - 1):
        s, _ = learner.update(s, bad, coef)
    assert _bits((s.params, s.opt_state)) == good
    with pytest.raises(NonFiniteError, match=r"3 consecutive updates .*max_nonfinite_steps=3"):
        learner.update(s, bad, coef)


def _toy(micro_batch_size=0):
    """A one-weight learner: loss sum(sqrt(w * x)) (finite at w = 0, gradient inf)."""
    def loss(p, mb, coef):
        return jnp.sum(jnp.sqrt(p["toy"]["w"] * mb["x"])), jnp.float32(mb["x"].shape[0]), {}
    learner = Learner(loss, {"toy": make_optimizer(OptimConfig(lr=0.1), 10)},
                      micro_batch_size=micro_batch_size)
    params = {"toy": {"w": jnp.ones((3,), jnp.float32)}}
    return learner, new_train_state(params, learner.init_opt_state(params), seed=0)


def test_infinite_gradient_of_a_finite_loss_is_caught():
    learner, state = _toy()
    state = dataclasses.replace(state, params={"toy": {"w": jnp.zeros((3,), jnp.float32)}})
    before = _copy(state)
    after, metrics = learner.update(state, {"x": np.ones((4, 3), np.float32)}, None)
    assert np.isfinite(float(metrics["loss"])) and not np.isfinite(float(metrics["grad_norm"]))
    _assert_skipped(before, after, metrics)


def test_nan_in_one_micro_batch_skips_the_whole_update():
    learner, state = _toy(micro_batch_size=2)
    x = np.ones((4, 3), np.float32)
    state, m = learner.update(state, {"x": x}, None)  # finite: moments are set
    assert float(m["skipped_update"]) == 0
    x[3, 1] = np.nan  # row 3 is in the second micro-batch (rows 1, 3)
    before = _copy(state)
    after, metrics = learner.update(state, {"x": x}, None)
    _assert_skipped(before, after, metrics)


@pytest.mark.parametrize("value,dtype,match", [
    (np.nan, "float32", "non-finite"), (np.inf, "bfloat16", "non-finite"),
    (3.4e38, "bfloat16", "overflow bfloat16")])
def test_export_refuses_nonfinite_and_bfloat16_overflow(tmp_path, value, dtype, match):
    gd, params = tiny_model(num_layers=1)
    flat = dict(nnx.to_flat_state(params))
    w = np.array(flat[("lm_head",)].get_value())
    w[0, 0] = value
    flat[("lm_head",)].set_value(jnp.asarray(w))
    model = nnx.merge(gd, params)
    with pytest.raises(ValueError, match=f"'lm_head.weight'.*{match}"):
        save_pretrained(model, tmp_path / "out", dtype=dtype)
    assert not (tmp_path / "out").exists()  # nothing half-written
    if value == 3.4e38:  # finite in float32: that export is fine
        save_pretrained(model, tmp_path / "f32", dtype="float32")
