"""Several seeds in one vmapped program are the runs each seed makes alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_common import tiny_model
from rljax.train.batching import encode_pairs
from rljax.train.config import OptimConfig, SFTConfig
from rljax.train.seeds import SeedRL, SeedSFT, unstack
from rljax.train.sft import SFTTrainer
from test_fused_step import PROMPTS, REWARD, TOK, _trainer


def offset_source(k):
    """Seed k's own prompt stream."""
    def src(start, n):
        idx = [(start + 2 * k + i) % len(PROMPTS) for i in range(n)]
        return [PROMPTS[i] for i in idx], [{"weight": 1.0 + i % 3} for i in idx]
    return src


def _close(a, b, rtol=1e-4, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# A vmapped matmul may sum in another order; Adam divides each gradient element by its
# own scale, so an element whose gradient is near 0 can move by a rounding-sized fraction
# of a step: bound the weights by 1% of one Adam step (lr 3e-3), not by float eps.
STEP_ATOL = 1e-2 * 3e-3


def test_seed_batch_equals_each_seed_alone():
    models = [tiny_model(seed=s) for s in (0, 1)]
    gd = models[0][0]
    copy = lambda st: jax.tree.map(jnp.copy, st)
    tr = _trainer(gd, REWARD)
    seeds = SeedRL(tr)
    state = seeds.init_state([copy(st) for _, st in models], seeds=[5, 6])
    alone = [tr.init_state(copy(st), seed=s) for (_, st), s in zip(models, (5, 6))]
    state, ms = seeds.step(state, [offset_source(0), offset_source(1)])
    for k in (0, 1):
        alone[k], m = tr.step(alone[k], offset_source(k))
        np.testing.assert_allclose(ms[k]["reward_mean"], m["reward_mean"], rtol=1e-6)
        np.testing.assert_allclose(ms[k]["loss"], m["loss"], rtol=1e-4, atol=1e-6)
    assert ms[0]["reward_mean"] != ms[1]["reward_mean"]  # the seeds differ
    for k in (0, 1):
        _close(unstack(state.params, k), alone[k].params, atol=STEP_ATOL)
        assert int(state.data_pos[k]) == int(alone[k].data_pos)
    ev = seeds.evaluate(state.params["policy"], [PROMPTS, PROMPTS[::-1]], [
        [{"weight": 1.0}] * len(PROMPTS)] * 2)
    for k, prompts in ((0, PROMPTS), (1, PROMPTS[::-1])):
        want = tr.evaluate(alone[k], prompts, [{"weight": 1.0}] * len(prompts))
        np.testing.assert_allclose(ev[k]["reward_mean"], want["reward_mean"], rtol=1e-6)


def test_seed_sft_updates_only_active_seeds():
    models = [tiny_model(seed=s) for s in (0, 1)]
    gd = models[0][0]
    cfg = SFTConfig(steps=3, batch_size=4, optim=OptimConfig(lr=1e-2))
    batches = [encode_pairs(TOK, PROMPTS[k:k + 4], ["3", "7", "21", "15"], 8, 3) for k in (0, 1)]
    sft = SeedSFT(gd, cfg)
    copy = lambda st: jax.tree.map(jnp.copy, st)
    state = sft.init_state([copy(st) for _, st in models], seeds=[0, 1])
    state, ms = sft.step(state, batches, active=[True, False])
    one = SFTTrainer(gd, cfg)
    alone = one.init_state(copy(models[0][1]), seed=0)
    alone, m = one.step(alone, batches[0])
    _close(unstack(state.params, 0), alone.params)
    _close(unstack(state.params, 1)["policy"], models[1][1], rtol=0)
    assert [int(x) for x in state.step] == [1, 0]
    np.testing.assert_allclose(ms[0]["loss"], m["loss"], rtol=1e-5)


def test_seed_batch_needs_a_device_reward():
    gd, _ = tiny_model()
    with pytest.raises(ValueError, match="device reward"):
        SeedRL(_trainer(gd, lambda c, m: np.zeros(len(c), np.float32)))
