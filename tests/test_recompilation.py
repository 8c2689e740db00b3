"""Fixed shapes: RL steps on prompts of random length compile nothing new once each
prompt bucket has been seen (the sampler, log-prob and learning programs included); with
packed rows, once each (prompt bucket, micro-batch count) has been seen."""

import numpy as np

from _train_common import CharTok, tiny_model
from rljax.sampling.prompts import bucket_length
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.programs import CompileLog
from rljax.train.rl import RLTrainer

TOK = CharTok()
RNG = np.random.default_rng(0)
# Prompts of 5..60 tokens, addressed by position like any prompt source.
PROMPTS = ["".join(RNG.choice(list("0123456789+="), size=int(n)))
           for n in RNG.integers(5, 61, size=40)]
N_PROMPTS = 4


def source(start, n):
    return [PROMPTS[(start + i) % len(PROMPTS)] for i in range(n)], [{}] * n


def length_reward(completions, metadata):
    return np.array([float(len(c)) for c in completions], np.float32)


def _steps_compile_once_per_bucket(tr: RLTrainer, st, steps: int, bucket) -> list:
    """``steps`` RL steps; ``bucket(width, trainer)`` names each step's program shapes
    (``width``: the prompts' bucket): a step in a seen bucket must compile nothing."""
    state = tr.init_state(st)
    seen, log = set(), []
    with CompileLog() as counter:
        for step in range(steps):
            prompts, _ = source(step * N_PROMPTS, N_PROMPTS)
            width = min(bucket_length(max(len(p) for p in prompts), 16), 60)
            before = counter.count
            state, metrics = tr.step(state, source)
            key = bucket(width, tr)
            log.append((step, key, counter.count - before))
            if key in seen:
                assert counter.count == before, f"recompiled in a seen bucket: {log}"
            seen.add(key)
            assert np.isfinite(metrics["loss"])
            assert not tr.rl.tokens_per_micro_batch or 0 < metrics["useful_token_frac"] <= 1
    assert len(seen) >= 2, f"the steps must cover several buckets: {log}"
    assert log[0][2] > 0  # the counter does see compilations
    return log


def test_rl_steps_compile_once_per_prompt_bucket():
    gd, st = tiny_model(num_layers=1)
    tr = RLTrainer(gd, TOK, length_reward,
                   algorithm=algorithm_preset("grpo", group_size=2, num_minibatches=2),
                   optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=3),
                   rl=RLConfig(steps=10, prompts_per_step=N_PROMPTS, logp_chunk=2),
                   prompt_len=60)
    _steps_compile_once_per_bucket(tr, st, 10, lambda width, tr: width)


def test_packed_rl_steps_compile_once_per_prompt_and_micro_batch_bucket():
    """``rl.tokens_per_micro_batch``: the packed learning program's shape is (prompt width,
    micro-batch count); a step whose pair was seen compiles nothing. Seven steps: the
    last one that repeats a pair (step 8 brought a new pair and nothing after it)."""
    gd, st = tiny_model(num_layers=1)
    tr = RLTrainer(gd, TOK, length_reward, algorithm=algorithm_preset("grpo", group_size=2),
                   optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=3),
                   rl=RLConfig(steps=7, prompts_per_step=N_PROMPTS, logp_chunk=2,
                               tokens_per_micro_batch=64), prompt_len=60)
    _steps_compile_once_per_bucket(tr, st, 7, lambda width, tr: (width,
                                                                 tr.last_layout.num_micro))
