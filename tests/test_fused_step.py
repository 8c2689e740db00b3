"""With a device reward the RL step is one compiled program (sample -> score -> learn),
and it makes the same samples and updates as the host-reward step."""

import jax
import jax.numpy as jnp
import numpy as np

from _train_common import CharTok, tiny_model
from rljax.rewards.device import DeviceReward
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.rl import RLTrainer

TOK = CharTok()
PROMPTS = ["1+2=", "3+4=", "15+6=", "7+8=", "2*3=", "9-1="]


def source(start, n):
    idx = [(start + i) % len(PROMPTS) for i in range(n)]
    return [PROMPTS[i] for i in idx], [{"weight": 1.0 + i % 3} for i in idx]


def digit_share(completions, metadata):
    """Host reward: the share of digits in the text, times the prompt's weight."""
    return np.array([m["weight"] * sum(c.isdigit() for c in t) / 3
                     for t, m in zip(completions, metadata)], np.float32)


class DigitShare(DeviceReward):
    """The same reward on token ids (digits are ids 2..11 of CharTok)."""

    def task_arrays(self, metadata):
        return {"weight": np.array([m["weight"] for m in metadata], np.float32)}

    def __call__(self, tokens_BxT, mask_BxT, task):
        digit = (tokens_BxT >= 2) & (tokens_BxT <= 11) & (mask_BxT > 0)
        return task["weight"] * jnp.sum(digit, axis=1) / 3


def _trainer(gd, reward):
    return RLTrainer(gd, TOK, reward, algorithm=algorithm_preset("grpo", group_size=4,
                                                                 num_minibatches=2, kl_coef=0.04),
                     optim=OptimConfig(lr=3e-3), sampling=SamplingConfig(max_new_tokens=3),
                     rl=RLConfig(steps=3, prompts_per_step=4, logp_chunk=2), prompt_len=8)


def test_device_reward_step_equals_the_host_reward_step():
    gd, st = tiny_model()
    copy = lambda: jax.tree.map(jnp.copy, st)
    host, dev = _trainer(gd, digit_share), _trainer(gd, DigitShare())
    s_h, s_d = host.init_state(copy(), seed=3), dev.init_state(copy(), seed=3)
    for _ in range(3):
        s_h, m_h = host.step(s_h, source)
        s_d, m_d = dev.step(s_d, source)
        for k in ("reward_mean", "reward_std", "response_len_mean", "completion_tokens"):
            np.testing.assert_allclose(m_d[k], m_h[k], rtol=1e-6, err_msg=k)
        np.testing.assert_allclose(m_d["loss"], m_h["loss"], rtol=1e-4, atol=1e-6)
    assert m_h["reward_std"] > 0  # the rewards vary: the updates are real
    for a, b in zip(jax.tree.leaves(s_d.params), jax.tree.leaves(s_h.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert int(s_d.data_pos) == int(s_h.data_pos) == 12
    np.testing.assert_array_equal(s_d.key, s_h.key)
    assert "time_step" in m_d and "time_learn" not in m_d


def test_device_reward_step_compiles_once_and_fetches_only_metrics():
    gd, st = tiny_model()
    tr = _trainer(gd, DigitShare())
    state, _ = tr.step(tr.init_state(st), source)  # compiles
    with jax.transfer_guard("disallow_explicit"):
        for _ in range(2):
            state, m = tr.step(state, source)
    assert tr._learn._cache_size() == 1
    assert np.isfinite(m["loss"])


def test_dynamic_sampling_needs_a_host_reward():
    gd, _ = tiny_model()
    try:
        RLTrainer(gd, TOK, DigitShare(), algorithm=algorithm_preset("dapo", group_size=2),
                  optim=OptimConfig(), sampling=SamplingConfig(max_new_tokens=3),
                  rl=RLConfig(steps=1, prompts_per_step=2), prompt_len=8)
    except ValueError as e:
        assert "dynamic sampling" in str(e)
    else:
        raise AssertionError("dapo with a device reward was accepted")
