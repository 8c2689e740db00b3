"""The RL step as one SPMD program on one process: only the named host transfers, padding
groups that change nothing, and a hung reward cut at its time limit. (DAPO's refill
rounds of different prompt widths: tests/test_multiprocess_rl.py, on 1 x 8 and 2 x 4, and
tests/test_train_rl.py's refill counts.)"""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_common import CharTok, random_seqs, tiny_model
from rljax import objectives as obj
from rljax.rewards import RewardPool
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.learn import algorithms as alg
from rljax.train.programs.step import learn_fn
from rljax.train.rl import RLTrainer
from rljax.train.batch import Rollout

TOK = CharTok()
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8="]  # one prompt bucket: one compile


def source(start, n):
    idx = [(start + i) % len(PROMPTS) for i in range(n)]
    return [PROMPTS[i] for i in idx], [{"i": i} for i in idx]


def starts_with_7(completions, metadata):
    return np.array([1.0 if c.startswith("7") else 0.0 for c in completions], np.float32)


def _trainer(gd, reward=starts_with_7, mesh=None, name="grpo", prompts=4, **alg):
    return RLTrainer(gd, TOK, reward, algorithm=algorithm_preset(name, **alg),
                     optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=3),
                     rl=RLConfig(steps=4, prompts_per_step=prompts, logp_chunk=2),
                     prompt_len=24, mesh=mesh, accuracy_fn=lambda c, m: c.startswith("7"))


def test_step_makes_only_the_named_host_transfers(mesh8):
    gd, st = tiny_model(mesh=mesh8, num_layers=1)
    tr = _trainer(gd, mesh=mesh8, group_size=2, num_minibatches=2, kl_coef=0.04)
    state, _ = tr.step(tr.init_state(st), source)  # compiles
    with jax.transfer_guard("disallow_explicit"):  # the steady state: no compile
        state, m = tr.step(state, source)
    assert np.isfinite(m["loss"]) and np.isfinite(m["kl_ref"])


def _rollout(rng, groups: int, weight: float, rewards) -> Rollout:
    g = 2
    s = random_seqs(rng, groups * g, 6, 4)
    b = groups * g
    return Rollout(s["prompt_BxP"], s["prompt_mask_BxP"], s["completion_BxT"],
                   s["completion_mask_BxT"], -rng.random((b, 4), dtype=np.float32),
                   np.zeros(b, np.float32), rewards, np.zeros(b, np.float32),
                   np.full(b, weight, np.float32), group_size=g)


def _padded_pair(rng):
    kept = _rollout(rng, 3, 1.0, np.array([1, 0, 0, 1, 1, 0], np.float32))
    pad = _rollout(rng, 2, 0.0, np.ones(4, np.float32))
    return kept, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), kept, pad)


def test_padding_groups_change_neither_loss_nor_gradient_of_the_learning_program():
    gd, st = tiny_model(num_layers=1)
    tr = _trainer(gd, name="dapo", group_size=2, overlong_buffer=0)  # token-mean
    kept, both = _padded_pair(np.random.default_rng(1))
    state = tr.init_state(st)
    counters = (state.updates, state.nonfinite_run, state.skipped)
    learn = jax.jit(learn_fn(tr.base_spec))
    out = [learn(state.params, state.opt_state, counters, None, ro, state.kl_coef,
                 jax.random.key(0)) for ro in (kept, both)]
    (p0, _, _, _, m0), (p1, _, _, _, m1) = out
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), p0, p1)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean",
                                         "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_padding_groups_carry_zero_weight_in_every_aggregation(aggregation):
    """The objective on a batch with weight-0 groups equals the objective without them,
    in value and in gradient (which is exactly 0 on the padding rows)."""
    cfg = algorithm_preset("dapo", group_size=2, aggregation=aggregation).resolve()
    objective = alg.make_objective(cfg, max_new_tokens=4)
    coef = alg.make_coef(cfg)
    kept, both = _padded_pair(np.random.default_rng(2))

    def loss(logp_BxT, ro):
        ro = ro.masked_by_weight()
        adv = obj.broadcast_to_tokens(alg.sequence_advantages(cfg, ro.rewards_B),
                                      ro.completion_mask_BxT)
        batch = obj.ObjectiveBatch(logp_BxT=logp_BxT, old_logp_BxT=ro.sampler_logp_BxT,
                                   mask_BxT=ro.completion_mask_BxT, adv_BxT=adv)
        loss_sum, count, _ = objective(batch, coef)
        return loss_sum / count

    logp = both.sampler_logp_BxT + 0.1 * jnp.arange(both.sampler_logp_BxT.size).reshape(-1, 4) / 40
    b = kept.rewards_B.shape[0]
    l0, g0 = jax.value_and_grad(loss)(logp[:b], kept)
    l1, g1 = jax.value_and_grad(loss)(logp, both)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    np.testing.assert_allclose(g1[:b], g0, rtol=1e-6, atol=1e-9)
    assert np.all(np.asarray(g1[b:]) == 0.0)


def sleeps_on_prompt_3(completion, meta):
    """Module-level, so it pickles into a reward worker: hangs on prompt 3."""
    if meta["i"] == 3:
        time.sleep(600)
    return 1.0 if completion.startswith("7") else 0.0


def test_hung_reward_is_cut_at_timeout_and_the_run_goes_on(caplog):
    gd, st = tiny_model(num_layers=1)
    with RewardPool(2) as pool:
        tr = RLTrainer(gd, TOK, [sleeps_on_prompt_3], algorithm=algorithm_preset("grpo", group_size=2),
                       optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=3),
                       rl=RLConfig(steps=2, prompts_per_step=4, logp_chunk=2), prompt_len=24,
                       reward_pool=pool, reward_timeout_s=1.0)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rljax.train.sources.host"):
            state, m = tr.step(tr.init_state(st), source)
        assert time.monotonic() - t0 < 120  # hang guard: the 600 s sleep was abandoned
    assert "prompt index 3" in caplog.text and "timed out" in caplog.text
    assert np.isfinite(m["loss"]) and int(state.step) == 1
