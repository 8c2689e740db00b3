"""The bfloat16 KL reference (``RLConfig.ref_dtype``): stored as bfloat16 with the policy's
shardings in half the bytes, float32 log-probs close to (not equal to) the float32
reference's, a GRPO step with a KL term, a bit-exact checkpoint round trip and resume,
and bad values refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_common import CharTok, random_seqs, tiny_model
from rljax.run.experiment import ExperimentConfig
from rljax.run.overrides import OverrideError, apply_overrides
from rljax.train.checkpoint import Checkpointer, abstract_like
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.learn.reference import reference_copy
from rljax.train.rl import RLTrainer

PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8="]
# bfloat16 keeps 8 significand bits: rounding moves each weight by at most 2^-9 of its
# magnitude (a spacing of 2^-8). The log-probs may move by at most a relative 2^-8 of their
# largest magnitude (twice the per-weight rounding, for what accumulates over the
# matmuls); measured here: 6.4e-4 against a bound of 1.2e-2 (1 layer; 6.8e-4 with 2).
LOGP_RTOL = 2.0 ** -8


def source(start, n):
    idx = [(start + i) % len(PROMPTS) for i in range(n)]
    return [PROMPTS[i] for i in idx], [{"i": i} for i in idx]


def starts_with_7(completions, metadata):
    return np.array([1.0 if c.startswith("7") else 0.0 for c in completions], np.float32)


def _trainer(gd, mesh, ref_dtype):
    return RLTrainer(
        gd, CharTok(), starts_with_7,
        algorithm=algorithm_preset("grpo", group_size=4, kl_coef=0.04),
        optim=OptimConfig(lr=1e-2), sampling=SamplingConfig(max_new_tokens=3),
        rl=RLConfig(steps=4, prompts_per_step=4, logp_chunk=2, ref_dtype=ref_dtype),
        prompt_len=6, mesh=mesh)


@pytest.fixture(scope="module")
def model8(mesh8):
    """(graphdef, params) of a tiny decoder on the 8-device mesh (never donated here)."""
    return tiny_model(mesh=mesh8, num_layers=1)


@pytest.fixture(scope="module")
def bf16(mesh8, model8):
    return _trainer(model8[0], mesh8, "bfloat16")


def _fresh(params):
    """New buffers with ``params``' values: ``init_state`` takes ownership of its input."""
    return reference_copy(params, "float32")


def _leaves(tree):
    return jax.tree.leaves(tree)


def test_reference_is_stored_as_bfloat16_with_the_policys_shardings(mesh8, model8, bf16):
    state = bf16.init_state(_fresh(model8[1]))
    policy, ref = _leaves(state.params["policy"]), _leaves(state.ref_params)
    assert len(policy) == len(ref) > 0
    for p, r in zip(policy, ref):
        assert p.dtype == jnp.float32 and r.dtype == jnp.bfloat16
        assert r.shape == p.shape and r.sharding == p.sharding, (r.sharding, p.sharding)
    assert 2 * sum(r.nbytes for r in ref) == sum(p.nbytes for p in policy)
    f32 = _trainer(model8[0], mesh8, "float32").init_state(_fresh(model8[1]))
    assert all(r.dtype == jnp.float32 for r in _leaves(f32.ref_params))
    # The policy and its optimiser moments stay float32.
    assert all(x.dtype == jnp.float32 for x in _leaves(state.opt_state)
               if jnp.issubdtype(x.dtype, jnp.floating))


def test_bfloat16_reference_logprobs_are_float32_close_and_not_identical(model8):
    gd, st = model8
    seqs = {k: jnp.asarray(v) for k, v in random_seqs(np.random.default_rng(0), 8, 6, 5).items()}
    fwd = jax.jit(lambda p, s: policy_logprobs(gd, p, s, chunk=2)[0])
    logp32_BxT = np.asarray(fwd(reference_copy(st, "float32"), seqs))
    out = fwd(reference_copy(st, "bfloat16"), seqs)
    assert out.dtype == jnp.float32
    logp16_BxT = np.asarray(out)
    m = np.asarray(seqs["completion_mask_BxT"]) > 0
    diff = np.abs(logp16_BxT - logp32_BxT)[m]
    assert diff.max() <= LOGP_RTOL * np.abs(logp32_BxT[m]).max(), diff.max()
    assert diff.max() > 0  # the option really changes the computation


def test_grpo_step_and_checkpoint_round_trip_with_bfloat16_reference(model8, bf16, tmp_path):
    state, m = bf16.step(bf16.init_state(_fresh(model8[1]), seed=1), source)
    assert np.isfinite(m["kl_ref"]) and m["kl_coef"] > 0, m
    assert all(np.isfinite(v) for v in m.values()), m
    assert all(r.dtype == jnp.bfloat16 for r in _leaves(state.ref_params))
    saved = [np.asarray(r) for r in _leaves(state.ref_params)]
    target = abstract_like(state)  # what a fresh run's state looks like (bfloat16 reference)
    with Checkpointer(tmp_path / "ck", save_every=1) as ck:
        ck.save(1, state, {})
        ck.wait_until_finished()
        _, straight = bf16.step(state, source)
        restored, _ = ck.restore(target)
    for r, s, t in zip(_leaves(restored.ref_params), saved, _leaves(target.ref_params)):
        assert r.dtype == jnp.bfloat16 and r.sharding == t.sharding
        np.testing.assert_array_equal(np.asarray(r).view(np.uint16), s.view(np.uint16))
    _, resumed = bf16.step(restored, source)
    keys = [k for k in straight if not k.startswith(("time_", "rollout_tok", "train_tok",
                                                     "model_flops"))]
    assert {k: straight[k] for k in keys} == {k: resumed[k] for k in keys}


def test_bad_reference_dtypes_are_refused():
    for bad in ("float16", "bf16", None, 16):
        with pytest.raises(ValueError, match=r"RLConfig\.ref_dtype.*'float32', 'bfloat16'"):
            RLConfig(ref_dtype=bad)
    with pytest.raises(ValueError, match=r"reference_copy: dtype='float16'"):
        reference_copy({"w": jnp.ones(2)}, "float16")


def test_reference_dtype_is_set_from_the_command_line():
    from rljax.models import ModelConfig

    base = ExperimentConfig(model=ModelConfig(vocab_size=19, hidden_size=32, intermediate_size=64,
                                              num_layers=1, num_heads=4, num_kv_heads=2))
    assert base.rl.ref_dtype == "float32"
    assert apply_overrides(base, ["rl.ref_dtype=bfloat16"]).rl.ref_dtype == "bfloat16"
    with pytest.raises(OverrideError, match=r"ref_dtype.*'bfloat16'"):
        apply_overrides(base, ["rl.ref_dtype=float16"])
