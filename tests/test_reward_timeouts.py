"""Issue 59, item 5: a reward that hangs on one completion is cut, counted and contained.

`reward/timeouts` (the share of completions whose reward a time limit cut) in a step's
metrics and in the held-out results; a batch reward in chunks (`reward.batch_chunk`) loses
only the hanging chunk; `env/tool_timeouts` is checked in tests/test_envs.py. 40 s
measured on the 2 shared cores at load average 10 (other sessions' runs): the sampler's
two compilations, the workers' start and 0.5 s limits.
"""

import time

import numpy as np
import pytest

from rljax.rewards import RewardPool
from rljax.rewards.pooled import PooledBatchReward, score_batch_fn

LIMIT_S = 0.5


def hangs_on_flag(completion, meta):
    """An item reward (module level: it pickles into a worker) that hangs on one prompt."""
    if meta.get("hang"):
        time.sleep(60)
    return 1.0


def hangs_in_batch(completions, metadata):
    """A batch reward that hangs when any of its completions' prompts is marked."""
    if any(m.get("hang") for m in metadata):
        time.sleep(60)
    return [float(len(c)) for c in completions]


def test_a_batch_reward_in_chunks_loses_only_the_hanging_chunk():
    texts = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]
    meta = [{}, {}, {"hang": 1}, {}, {}, {}]
    with RewardPool(2) as pool:
        t0 = time.monotonic()
        whole = PooledBatchReward(hangs_in_batch, lambda: pool, timeout_s=LIMIT_S)
        np.testing.assert_array_equal(score_batch_fn(whole, texts, meta, 2), [0] * 6)
        assert (whole.timeouts, whole.last_timeouts) == (1, 6)  # one call: the whole batch
        split = PooledBatchReward(hangs_in_batch, lambda: pool, timeout_s=LIMIT_S, chunk=2)
        np.testing.assert_array_equal(score_batch_fn(split, texts, meta, 2), [1, 2, 0, 0, 5, 6])
        assert (split.timeouts, split.last_timeouts) == (1, 2)  # the hanging group only
        np.testing.assert_array_equal(score_batch_fn(split, texts[:3], [{}] * 3, 2), [1, 2, 3])
        assert split.last_timeouts == 0 and split.timeouts == 1  # a call per step
        assert time.monotonic() - t0 < 60  # a hang guard: each hang sleeps 60 s
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        PooledBatchReward(hangs_in_batch, lambda: pool, timeout_s=1.0, chunk=0)


def test_batch_chunk_is_a_custom_batch_reward_setting():
    from rljax.run.experiment import RewardConfig
    from rljax.run.user_reward import custom_reward

    assert RewardConfig(function="m:f", batch_chunk=4).batch_chunk == 4
    for bad in (dict(function="m:f", batch_chunk=-1), dict(batch_chunk=4),
                dict(function="m:f", function_form="item", batch_chunk=4),
                dict(function="m:f", workers=0, batch_chunk=4)):
        with pytest.raises(ValueError, match="batch_chunk"):
            RewardConfig(**bad)

    class Cfg:  # custom_reward reads cfg.reward only
        reward = RewardConfig(function=f"{__name__}:hangs_in_batch", batch_chunk=4)

    assert custom_reward(Cfg, None).chunk == 4


def test_timeouts_are_in_the_step_metrics_and_the_held_out_results():
    import jax
    from flax import nnx

    from rljax.models import Decoder, ModelConfig
    from rljax.models.tokenizer import build_char_tokenizer
    from rljax.train.config import SamplingConfig
    from rljax.train.sources import Window
    from rljax.train.sources.evaluate import evaluate
    from rljax.train.sources.host import Rollouts
    from rljax.train.throughput import PhaseTimes

    tok = build_char_tokenizer()
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=1)
    gd, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    prompts = ["1+2=", "3+4=", "5+6=", "7+8="]
    meta = [{}, {"hang": 1}, {}, {}]
    with RewardPool(2) as pool:
        ro = Rollouts(gd, tok, [hangs_on_flag], sampling=SamplingConfig(max_new_tokens=2),
                      prompt_len=8, group_size=2, reward_pool=pool, reward_timeout_s=LIMIT_S)
        window = Window(lambda pos, n: (prompts[pos:pos + n], meta[pos:pos + n]), 0, 4)
        got = ro.collect(params, window, jax.random.key(0), PhaseTimes())
        held = evaluate(ro, params, prompts[:2], meta[:2])
    # 8 rows (4 prompts x 2), the hanging prompt's 2 cut; held out: 1 of 2 prompts
    assert got.metrics["reward/timeouts"] == pytest.approx(2 / 8)
    np.testing.assert_array_equal(np.asarray(got.rollout.rewards_B), [1, 1, 0, 0, 1, 1, 1, 1])
    assert held["reward/timeouts"] == pytest.approx(1 / 2)
    assert held["reward_mean"] == pytest.approx(1 / 2)
