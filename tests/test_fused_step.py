"""With a device reward the RL step is one compiled program (sample -> score -> learn),
and it makes the same samples and updates as the host-reward step, on one device and
sharded over an 8-device mesh; several seeds in one vmapped program are the runs each
seed makes alone (``rljax.train.seeds``). One file, so one test worker compiles the
shared programs once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _train_common import CharTok, DigitShare, digit_share, tiny_model as _tiny_model
from rljax.train.batching import encode_pairs
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, SFTConfig, algorithm_preset
from rljax.train.programs import CompileLog
from rljax.train.rl import RLTrainer
from rljax.train.seeds import SeedRL, SeedSFT, unstack
from rljax.train.sft import SFTTrainer

TOK = CharTok()


def tiny_model(seed=0, mesh=None):
    """One layer: what these tests compare needs no depth, and each layer is compile time."""
    return _tiny_model(seed=seed, mesh=mesh, num_layers=1)


PROMPTS = ["1+2=", "3+4=", "15+6=", "7+8=", "2*3=", "9-1="]


def source(start, n):
    idx = [(start + i) % len(PROMPTS) for i in range(n)]
    return [PROMPTS[i] for i in idx], [{"weight": 1.0 + i % 3} for i in idx]


REWARD = DigitShare()  # one instance: trainers with it share their compiled programs


def _close(a, b, rtol=1e-4, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _trainer(gd, reward, mesh=None):
    return RLTrainer(gd, TOK, reward, algorithm=algorithm_preset("grpo", group_size=4,
                                                                 num_minibatches=1, kl_coef=0.0),
                     optim=OptimConfig(lr=3e-3), sampling=SamplingConfig(max_new_tokens=3),
                     rl=RLConfig(steps=2, prompts_per_step=4, logp_chunk=2), prompt_len=8,
                     mesh=mesh)


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
        with jax.transfer_guard("disallow_explicit" if i else "allow"), CompileLog() as log:
            s_d, m_d = dev.step(s_d, source)
        rows.append((m_h, m_d))
    dev.second_step_compiles = log.compiles
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
    assert dev.second_step_compiles == []  # the first step's program serves every step
    assert np.isfinite(rows[1][1]["loss"])


def test_device_reward_step_on_a_mesh_equals_the_one_device_step(two_runs, mesh8):
    """The one-program step sharded over the (data, fsdp, tensor) mesh of 8 devices: the
    same samples, rewards and updates as on one device, and after its compile no host
    transfer but the metrics'."""
    _, (_, s_one), rows = two_runs
    gd, st = tiny_model(mesh=mesh8)
    tr = _trainer(gd, REWARD, mesh=mesh8)
    state = tr.init_state(st, seed=3)
    for i, (_, want) in enumerate(rows):
        with jax.transfer_guard("disallow_explicit" if i else "allow"), CompileLog() as log:
            state, m = tr.step(state, source)
        for k in ("reward_mean", "reward_std", "response_len_mean", "completion_tokens"):
            np.testing.assert_allclose(m[k], want[k], rtol=1e-6, err_msg=k)
        np.testing.assert_allclose(m["loss"], want["loss"], rtol=1e-4, atol=1e-6)
    assert log.compiles == []  # the second step compiled nothing
    leaves = jax.tree.leaves(state.params)
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
               for x in leaves)  # the parameters stayed sharded over the mesh
    _close(state.params, s_one.params)


def test_dynamic_sampling_needs_a_host_reward():
    gd, _ = tiny_model()
    with pytest.raises(ValueError, match="dynamic sampling"):
        RLTrainer(gd, TOK, REWARD, algorithm=algorithm_preset("dapo", group_size=2),
                  optim=OptimConfig(), sampling=SamplingConfig(max_new_tokens=3),
                  rl=RLConfig(steps=1, prompts_per_step=2), prompt_len=8)


def offset_source(k):
    """Seed k's own prompt stream."""
    def src(start, n):
        idx = [(start + 2 * k + i) % len(PROMPTS) for i in range(n)]
        return [PROMPTS[i] for i in idx], [{"weight": 1.0 + i % 3} for i in idx]
    return src


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


def test_seed_batch_refuses_a_device_reward_on_a_mesh(mesh8):
    """With a device reward the seeds' vmapped step is one device's; a host reward's seeds
    run anywhere (tests/test_composition.py)."""
    gd, _ = tiny_model(mesh=mesh8)
    with pytest.raises(ValueError, match="with a device reward seeds are vmapped on one device"):
        SeedRL(_trainer(gd, REWARD, mesh=mesh8))
    SeedRL(_trainer(gd, lambda c, m: np.zeros(len(c), np.float32), mesh=mesh8))
