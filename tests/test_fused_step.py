"""With a device reward the RL step is one compiled program (sample -> score -> learn),
and it makes the same samples and updates as the host-reward step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


REWARD = DigitShare()  # one instance: trainers with it share their compiled programs


def _trainer(gd, reward):
    return RLTrainer(gd, TOK, reward, algorithm=algorithm_preset("grpo", group_size=4,
                                                                 num_minibatches=2, kl_coef=0.04),
                     optim=OptimConfig(lr=3e-3), sampling=SamplingConfig(max_new_tokens=3),
                     rl=RLConfig(steps=2, prompts_per_step=4, logp_chunk=2), prompt_len=8)


@pytest.fixture(scope="module")
def two_runs():
    """Two steps with the host reward and with the device reward, from equal states;
    the device trainer's second step runs under a transfer guard."""
    gd, st = tiny_model()
    copy = lambda: jax.tree.map(jnp.copy, st)
    host, dev = _trainer(gd, digit_share), _trainer(gd, REWARD)
    s_h, s_d = host.init_state(copy(), seed=3), dev.init_state(copy(), seed=3)
    rows = []
    for i in range(2):
        s_h, m_h = host.step(s_h, source)
        with jax.transfer_guard("disallow_explicit" if i else "allow"):
            s_d, m_d = dev.step(s_d, source)
        rows.append((m_h, m_d))
    return dev, (s_h, s_d), rows


def test_device_reward_step_equals_the_host_reward_step(two_runs):
    _, (s_h, s_d), rows = two_runs
    for m_h, m_d in rows:
        for k in ("reward_mean", "reward_std", "response_len_mean", "completion_tokens"):
            np.testing.assert_allclose(m_d[k], m_h[k], rtol=1e-6, err_msg=k)
        np.testing.assert_allclose(m_d["loss"], m_h["loss"], rtol=1e-4, atol=1e-6)
    assert rows[0][0]["reward_std"] > 0  # the rewards vary: the updates are real
    for a, b in zip(jax.tree.leaves(s_d.params), jax.tree.leaves(s_h.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert int(s_d.data_pos) == int(s_h.data_pos) == 8
    np.testing.assert_array_equal(s_d.key, s_h.key)
    assert "time_step" in rows[0][1] and "time_learn" not in rows[0][1]


def test_device_reward_step_compiles_once_and_fetches_only_metrics(two_runs):
    dev, _, rows = two_runs  # its second step ran under jax.transfer_guard("disallow_explicit")
    assert dev._learn._cache_size() == 1
    assert np.isfinite(rows[1][1]["loss"])


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
