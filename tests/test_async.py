"""Bounded-staleness asynchronous RL (``RLConfig.max_staleness``;
``rljax.train.async_driver``): staleness 0 is the synchronous step, bit for bit; at
staleness 1 the batch a step learns from was sampled by the parameters one update older,
the learning program is dispatched before the next batch is scored, a checkpoint holds
the in-flight batch so a resumed run equals an uninterrupted one, every host source
(rewards, DAPO's refill, episodes, packed rows) runs, and the refusals name why."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _experiments import load_experiment
from _mp_multiturn import LIMITS, CountEnv, source as episode_source
from _train_common import CharTok, DigitShare, digit_share, tiny_model
from rljax.train import async_driver
from rljax.train.async_driver import inflight_meta, inflight_target
from rljax.train.checkpoint import Checkpointer
from rljax.train.driver import rl_step
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.multiturn import MultiTurnConfig
from rljax.train.programs.step import learn_step
from rljax.train.rl import RLTrainer
from rljax.train.sources import Window

TOK = CharTok()
arithmetic_grpo = load_experiment("arithmetic_grpo")  # four seeds in one program
PROMPTS = ["1+2=", "3+4=", "15+6=", "7+8=", "2*3=", "9-1=", "4+4=", "8-2="]


def prompts(start, n):
    idx = [(start + i) % len(PROMPTS) for i in range(n)]
    return [PROMPTS[i] for i in idx], [{"weight": 1.0 + i % 3} for i in idx]


def _trainer(gd, staleness: int, *, name="grpo", reward=digit_share, mesh=None,
             multiturn=None, packed=False, **alg):
    alg = dict(dict(group_size=2, kl_coef=0.0), **alg)
    return RLTrainer(gd, TOK, reward, algorithm=algorithm_preset(name, **alg),
                     optim=OptimConfig(lr=3e-3), sampling=SamplingConfig(max_new_tokens=4),
                     rl=RLConfig(steps=4, prompts_per_step=4, logp_chunk=4,
                                 max_staleness=staleness,
                                 tokens_per_micro_batch=64 if packed else 0),
                     prompt_len=16, mesh=mesh, multiturn=multiturn)


def _steps(tr, state, n, source=prompts):
    out = []
    for _ in range(n):
        state, m = tr.step(state, source)
        out.append(_kept(m))
    return state, out


def _kept(m: dict) -> dict:
    """A step's metrics less its timings and rates (the machine's, not the run's)."""
    return {k: v for k, v in m.items() if not k.startswith(("time_", "async/"))
            and "_tok_s" not in k and "flops" not in k and k != "mfu"}


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state, state.key,
                                                    state.step, state.data_pos))]


def test_staleness_zero_is_the_synchronous_step(monkeypatch):
    """``max_staleness=0`` takes the synchronous driver's path: the trainer's steps equal
    ``rl_step`` driven by hand (metrics and state bit for bit), and the asynchronous step
    never runs."""
    monkeypatch.setattr("rljax.train.rl.async_step", None)  # calling it would raise
    gd, st = tiny_model(num_layers=1)
    tr = _trainer(gd, 0)
    sa, ma = _steps(tr, tr.init_state(jax.tree.map(np.copy, st), seed=3), 2)
    sb = tr.init_state(jax.tree.map(np.copy, st), seed=3)
    mb = []
    for _ in range(2):
        window = Window(prompts, int(sb.data_pos), 4)
        out = rl_step(tr.step_spec(sb), tr.source, sb, window)
        sb = out.state
        mb.append(_kept(tr.finish_metrics(out.metrics, out.times, sb.params)))
    assert ma == mb
    assert sa.inflight is None and sb.inflight is None
    for x, y in zip(_leaves(sa), _leaves(sb)):
        np.testing.assert_array_equal(x, y)


def test_one_step_off_samples_with_the_previous_parameters():
    """After step t the in-flight batch was sampled by the parameters before update t:
    its sampler log-probs are those parameters' log-probs (float32 rounding), not the
    updated ones'. The step learning from it reports staleness 1."""
    gd, st = tiny_model(num_layers=1)
    tr = _trainer(gd, 1)
    state = tr.init_state(st, seed=0)
    stale = []
    for _ in range(3):
        before = jax.tree.map(np.array, state.params["policy"])
        state, m = tr.step(state, prompts)
        stale.append(m["async/staleness"])
        ro = state.inflight[0].rollout
        seqs = {k: v for k, v in ro.seqs().items()}
        gap = lambda p: float(np.max(np.abs(np.asarray(  # noqa: E731
            policy_logprobs(gd, p, seqs, chunk=4)[0] - ro.sampler_logp_BxT)
            * np.asarray(ro.completion_mask_BxT))))
        assert gap(before) < 1e-5, gap(before)
        assert gap(state.params["policy"]) > 10 * max(gap(before), 1e-7)
        assert m["async/inflight"] == 1.0
        for k in ("mismatch_kl", "is_weight_max", "is_weight_min"):
            assert np.isfinite(m[k]), k
    assert stale == [0.0, 1.0, 1.0]
    assert m["is_weight_max"] > m["is_weight_min"] > 0


def test_learning_is_dispatched_before_the_next_batch_is_scored(monkeypatch):
    """With staleness 1 the reward of the batch collected in step t runs after step t's
    learning program was dispatched (the host scores while the chips learn); the
    synchronous step scores first."""
    learns, seen = [0], []
    real_run = async_driver.run

    def counting_run(*a, **kw):
        learns[0] += 1
        return real_run(*a, **kw)

    def reward(completions, metadata):
        seen.append(learns[0])
        return digit_share(completions, metadata)

    monkeypatch.setattr(async_driver, "run", counting_run)
    gd, st = tiny_model(num_layers=1)
    tr = _trainer(gd, 1, reward=reward)
    state = tr.init_state(st, seed=0)
    for _ in range(3):
        state, _ = tr.step(state, prompts)
    # step 0: the fill's batch (nothing learned yet), then the next batch after learn 1.
    assert seen == [0, 1, 2, 3]


def test_a_resumed_async_run_equals_the_uninterrupted_one(tmp_path, mesh8):
    """Two steps on the 8-device mesh, a checkpoint holding the in-flight batch, a fresh
    trainer restoring it from the metadata's record: its next two steps equal the
    uninterrupted run's, and the restored batch's shardings are those the learning
    program was compiled for (no second compile)."""
    gd, st = tiny_model(mesh=mesh8, num_layers=1)
    tr = _trainer(gd, 1, mesh=mesh8)
    state, first = _steps(tr, tr.init_state(jax.tree.map(jnp.copy, st), seed=1), 2)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(2, state, {"inflight": inflight_meta(state)})
        _, rest = _steps(tr, state, 2)
        meta = ck.read_meta()
        tr2 = _trainer(gd, 1, mesh=mesh8)
        fresh = tr2.init_state(jax.tree.map(jnp.copy, st), seed=1)
        fresh = dataclasses.replace(fresh, inflight=inflight_target(meta["inflight"], mesh8))
        restored, _ = ck.restore(fresh)
    assert restored.inflight[0].version == 1
    compiled = learn_step._cache_size()
    _, again = _steps(tr2, restored, 2)
    assert again == rest
    assert learn_step._cache_size() == compiled


@pytest.mark.parametrize("kind", ["refill", "episodes", "packed"])
def test_every_host_source_runs_one_step_off(kind, mesh8):
    gd, st = tiny_model(mesh=mesh8, num_layers=1)
    if kind == "episodes":
        tr = _trainer(gd, 1, reward=None, mesh=mesh8,
                      multiturn=MultiTurnConfig(CountEnv, LIMITS, obs_multiple=8))
        source = episode_source
    else:
        tr = _trainer(gd, 1, name="dapo" if kind == "refill" else "grpo", mesh=mesh8,
                      packed=kind == "packed")
        source = prompts
    state = tr.init_state(st, seed=0)
    for _ in range(2):
        state, m = tr.step(state, source)
        assert np.isfinite(m["loss"]) and np.isfinite(m["mismatch_kl"])
    assert m["async/staleness"] == 1.0
    if kind == "refill":
        assert "dyn_refill_rounds" in m
    if kind == "episodes":
        assert "env/turns" in m


@pytest.mark.parametrize("case, pattern", [
    ("device", "a device reward's step is one program"),
    ("sampler", "old_logp='sampler' would take it against the stale sampler"),
    ("negative", "max_staleness"),
    ("rloo", "has no importance ratio: set algorithm.tis_cap"),
    ("seeds", "several seeds learn in one vmapped program"),
])
def test_refusals_name_why(case, pattern):
    gd, _ = tiny_model(num_layers=1)
    with pytest.raises(ValueError, match=pattern):
        if case == "negative":
            RLConfig(max_staleness=-1)
        elif case == "seeds":
            cfg = arithmetic_grpo.config()
            dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, max_staleness=1))
        elif case == "rloo":
            _trainer(gd, 1, name="rloo")
        elif case == "device":
            _trainer(gd, 1, reward=DigitShare())
        else:
            _trainer(gd, 1, old_logp="sampler")
