"""Multi-turn rollouts (issue 43, rljax.train.multiturn): turns decoded from one KV cache,
observations appended with loss mask 0, token in / token out, stop strings, fixed
shapes (a new rollout compiles nothing), learning on the result (the trainer's log-probs
equal the sampler's on model tokens; GRPO over episodes; GAE over observation gaps), and
a chat template's rendering (the trajectory's ids are the rollout's), and 2 processes x
4 devices equal to 1 x 8."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _multiprocess as mp
from _envs_chat import TOOL_TEMPLATE, build_tokenizer
from _mp_multiturn import (LIMITS, PROMPTS, TOK, TURN_TOKENS, CountEnv, policy,
                           replicated_key, run, source, trainer)
from _train_common import tiny_model
from rljax import objectives as obj
from rljax.envs import (Calculator, ChatRenderer, EnvBatch, EnvLimits, StepResult, ToolCall,
                        ToolRegistry)
from rljax.rewards import RewardPool
from rljax.train import hosts
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.multiturn import MultiTurnConfig, MultiTurnRollouts, stop_sequences
from rljax.train.programs import CompileLog
from rljax.train.rl import RLTrainer

TIMEOUT_S = 300  # a guard against a hung collective, not a speed assertion
EQ, STAR, EOS = TOK.encode("=")[0], TOK.encode("*")[0], TOK.eos_token_id


class Spy:
    """Records what crossed the host boundary: each turn's tokens and counts (own rows)
    and each `EnvBatch.step`'s observation ids."""

    def __init__(self, monkeypatch):
        self.turns, self.obs = [], []
        out, step = hosts.turn_tokens_out, EnvBatch.step

        def turn_tokens_out(arrays, lo, hi):
            got = out(arrays, lo, hi)
            self.turns.append(got)
            return got

        def env_step(envs, *args, **kw):
            res = step(envs, *args, **kw)
            self.obs.append(res.observation_ids)
            return res

        monkeypatch.setattr(hosts, "turn_tokens_out", turn_tokens_out)
        monkeypatch.setattr(EnvBatch, "step", env_step)


@pytest.fixture(scope="module")
def model(mesh8):
    """The policy on the 1 x 8 mesh (data 2, fsdp 2, tensor 2), as the 2 x 4 pair's."""
    return policy(mesh8)


@pytest.fixture(scope="module")
def tr(model, mesh8):
    return trainer(model[0], mesh8)


@pytest.fixture(scope="module")
def rollout(pair, model, tr):  # the pair starts first and runs beside these tests
    key = replicated_key(0, tr.mesh)
    with pytest.MonkeyPatch.context() as patch, jax.transfer_guard("disallow_explicit"):
        spy = Spy(patch)
        out = tr.multiturn.sample(model[1], source, 0, 4, key)
    return tr.multiturn, out, spy


def test_stop_strings_map_to_token_sequences():
    assert stop_sequences(TOK, ("=", "**", "=")) == ((EQ,), (STAR, STAR))
    with pytest.raises(ValueError, match="encodes to no tokens"):
        stop_sequences(TOK, ("",))


def test_token_in_token_out(rollout):
    """The completion is exactly the sampled turns' ids and the environment's
    observation ids, in order; the loss mask is 1 on the former and 0 on the latter;
    the sampler's log-probs are 0 at observation tokens."""
    _, out, spy = rollout
    ro = out.rollout
    comp, cmask, lmask, slogp = (np.asarray(x) for x in (
        ro.completion_BxT, ro.completion_mask_BxT, ro.loss_mask_BxT, ro.sampler_logp_BxT))
    assert len(spy.turns) == len(spy.obs) == out.metrics["env/rollout_turns"] == 3
    for i in range(comp.shape[0]):
        ids, loss = [], []
        for (tok, lens), obs in zip(spy.turns, spy.obs):
            ids += tok[i, :lens[i]].tolist() + list(obs[i])
            loss += [1] * int(lens[i]) + [0] * len(obs[i])
        n = len(ids)
        assert int(cmask[i].sum()) == n and cmask[i, :n].all(), i
        assert comp[i, :n].tolist() == ids, i
        assert lmask[i, :n].tolist() == loss and not lmask[i, n:].any(), i
        assert (slogp[i][lmask[i] == 0] == 0).all() and (slogp[i][lmask[i] > 0] < 0).all()
        assert out.info[i]["turns"] == sum(int(t[1][i] > 0) for t in spy.turns)
    assert sorted({len(o) for obs in spy.obs for o in obs}) == [0, 4, 6, 8, 10]  # 8, 16
    turns = [i["turns"] for i in out.info]
    assert turns == [1, 1, 2, 2, 3, 3, 3, 3] and out.metrics["env/turns"] == np.mean(turns)
    # The environments' token counts are the rollout's: prompt + completion, per row.
    lengths = np.asarray(ro.prompt_mask_BxP).sum(1) + cmask.sum(1)
    assert [i["tokens"] for i in out.info] == lengths.astype(int).tolist()
    assert [i["truncated"] for i in out.info] == [None] * 6 + ["max_turns"] * 2
    assert np.asarray(ro.truncated_B).tolist() == [0] * 6 + [1] * 2
    # The reward is the episode return (per turn: 0.5, then the final turn's score).
    np.testing.assert_allclose(np.asarray(ro.rewards_B), [sum(r) for r in out.turn_rewards])
    assert [len(r) for r in out.turn_rewards] == turns


def test_turns_end_at_a_stop_or_the_budget(rollout):
    _, out, spy = rollout
    for tok, lens in spy.turns:
        for row, n in zip(tok, lens):
            t = row[:n].tolist()
            if n and n < TURN_TOKENS:
                assert t[-1] in (EOS, EQ) or t[-2:] == [STAR, STAR], t
            assert EQ not in t[:-1] and EOS not in t[:-1], t  # no turn runs past a stop


def test_trainer_logprobs_equal_sampler_on_model_tokens(rollout, model):
    """A float32 forward of the whole sequence (prompt, turns, observations) gives the
    log-probs the sampler drew with from its cache: the turns continued the cache at
    the right slots and positions."""
    gd, st = model
    ro = rollout[1].rollout
    logp = jax.jit(lambda st, seqs: policy_logprobs(gd, st, seqs, chunk=8)[0])(st, ro.seqs())
    m = np.asarray(ro.loss_mask_BxT) > 0
    gap = np.abs(np.asarray(logp) - np.asarray(ro.sampler_logp_BxT))[m]
    assert m.sum() > 20 and gap.max() < 1e-5, gap.max()


def test_a_new_rollout_compiles_nothing(rollout, model):
    """After the first rollout (every program, each observation bucket seen), a rollout
    of other prompts and draws, with turns of other lengths, compiles nothing."""
    mt, first, _ = rollout
    key = replicated_key(1, mt.mesh)
    with CompileLog() as log:
        out = mt.sample(model[1], source, 4, 4, key)
    assert out.metrics["env/rollout_turns"] >= 2
    assert not np.array_equal(np.asarray(out.rollout.completion_BxT),
                              np.asarray(first.rollout.completion_BxT))
    assert log.count == 0, log.summary()


class CalcEnv(CountEnv):
    """CountEnv whose every turn calls the calculator (12*3) and a tool that does not
    exist, whatever the model wrote; the observation is "ab" and the results."""

    tools = ToolRegistry([Calculator()])

    def tool_calls(self, model_text):
        return [ToolCall("calculator", {"expression": "12*3"}), ToolCall("nope", {})]

    def step(self, model_text, tool_results=()):
        self.t += 1
        if self.t >= self.k:
            return StepResult("", 0.0, True)
        return StepResult("ab" + "".join(r.content for r in tool_results if r.ok), 0.5)


def test_tools_run_in_the_pool_during_a_rollout(model, tr, rollout):
    """A tool environment's calls run in the reward pool between turns; the calls, their
    errors and their results reach the metrics and the completion, with the same
    programs as before (nothing compiles)."""
    mt, key = tr.multiturn, replicated_key(2, tr.mesh)
    with RewardPool(workers=1) as pool, CompileLog() as log:
        tools = MultiTurnRollouts(mt.gd, TOK, CalcEnv, sampling=mt.sampling, limits=LIMITS,
                                  prompt_len=16, group_size=2, mesh=mt.mesh, pool=pool,
                                  obs_multiple=mt.obs_multiple)
        out = tools.sample(model[1], source, 0, 4, key)
    assert log.count == 0, log.summary()
    turns = np.array([i["turns"] for i in out.info])
    assert turns.tolist() == [1, 1, 2, 2, 3, 3, 3, 3]
    m = out.metrics
    assert m["env/tool_calls"] == 2 * turns.mean() and m["env/tool_errors"] == turns.mean()
    assert m["env/tool_s"] > 0
    comp, cmask, lmask = (np.asarray(x) for x in (out.rollout.completion_BxT,
                                                  out.rollout.completion_mask_BxT,
                                                  out.rollout.loss_mask_BxT))
    for row, cm, lm, t in zip(comp, cmask, lmask, turns):  # the results, after each turn
        assert row[(cm > 0) & (lm == 0)].tolist() == TOK.encode("ab36") * int(t - 1), row


def test_chat_template_rollout_keeps_the_sampled_ids():
    """With a chat renderer (`MultiTurnConfig.chat`) the prompt is the template's render
    and each observation its delta after the sampled ids: the rollout's sequence is the
    row's `ChatTrajectory` (ids and loss mask) followed by its last model turn."""
    tok = build_tokenizer(TOOL_TEMPLATE)  # a BPE with a ChatML template, EOS <|im_end|>
    gd, st = tiny_model(vocab_size=len(tok), num_layers=1)
    batches = []
    step = EnvBatch.step

    def keep(envs, *args, **kw):
        batches.append(envs)
        return step(envs, *args, **kw)

    mt = MultiTurnRollouts(gd, tok, CountEnv, sampling=SamplingConfig(max_new_tokens=6),
                           limits=EnvLimits(max_turns=3, max_obs_tokens=32,
                                            max_total_tokens=128),
                           prompt_len=32, group_size=2, chat=ChatRenderer(tok))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EnvBatch, "step", keep)
        out = mt.sample(st, source, 1, 2, jax.random.key(0))  # episodes of 2 and 3 turns
    ro = out.rollout
    pmask, cmask = np.asarray(ro.prompt_mask_BxP) > 0, np.asarray(ro.completion_mask_BxT) > 0
    assert [i["turns"] for i in out.info] == [2, 2, 3, 3]
    for i in range(4):
        traj = batches[-1].trajectory(i)
        ids = np.asarray(ro.prompt_BxP)[i][pmask[i]].tolist() + \
            np.asarray(ro.completion_BxT)[i][cmask[i]].tolist()
        loss = [0] * int(pmask[i].sum()) + np.asarray(ro.loss_mask_BxT)[i][cmask[i]].tolist()
        n = len(traj.ids)
        assert ids[:n] == list(traj.ids) and loss[:n] == list(traj.loss_mask), i
        assert len(ids) > n and set(loss[n:]) == {1}, i  # the last turn, as sampled
        assert traj.messages[0] == {"role": "user", "content": PROMPTS[1 + i // 2]}


def test_grpo_step_on_episodes(model, tr):
    """An RL step with multiturn: the learner's log-probs equal the sampler's on model
    tokens (the gap metric reads the loss mask: observation tokens, whose sampler log-prob
    is 0, would show), GRPO groups episodes, and the episode metrics are reported."""
    state, m = tr.step(tr.init_state(jax.tree.map(jnp.copy, model[1])), source)
    assert m["sampler_gap"] < 1e-5 and np.isfinite(m["loss"])
    assert m["env/turns"] == 2.25 and m["env/rollout_turns"] == 3.0
    assert m["env/truncated"] == 0.25 and m["truncation_rate"] == 0.25
    assert m["reward_std"] > 0 and "env/tool_calls" in m and "env/env_s" in m
    assert m["model_flops_s"] > 0  # the policy's parameters counted on episodes too


def test_gae_steps_over_observations():
    """PPO on episodes: GAE's steps are the model's tokens, so on a loss mask with
    observation gaps it equals GAE over the same tokens with the gaps removed (the value
    and advantage of the next model token carry across a gap), and the episode's reward
    lands on its last model token."""
    rng = np.random.default_rng(0)
    mask = np.array([[1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0],
                     [1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]], np.float32)
    r, v = rng.standard_normal((2, 2, 12)).astype(np.float32)
    v_junk = np.where(mask > 0, v, np.nan)  # what observation positions hold is ignored
    gae = jax.jit(lambda r, v, m: obj.gae(r, v, m, gamma=0.9, lam=0.8))  # one program
    adv, ret = (np.asarray(x) for x in gae(r, v_junk, mask))
    # The same tokens without the gaps, right-padded (one shape: one compiled scan).
    packed = [np.zeros((2, 12), np.float32) for _ in range(3)]
    for i in range(2):
        keep = mask[i] > 0
        for dst, src in zip(packed, (r[i], v[i], mask[i])):
            dst[i, :keep.sum()] = src[keep]
    adv1, ret1 = (np.asarray(x) for x in gae(*packed))
    for i in range(2):
        keep, n = mask[i] > 0, int(mask[i].sum())
        np.testing.assert_allclose(adv[i, keep], adv1[i, :n], rtol=1e-6)
        np.testing.assert_allclose(ret[i, keep], ret1[i, :n], rtol=1e-6)
        assert not adv[i, ~keep].any() and np.isfinite(adv).all()
    final = np.asarray(jax.jit(obj.final_token_rewards)(np.float32([2.0, 3.0]), mask))
    assert final[0, 9] == 2.0 and final[1, 6] == 3.0 and np.count_nonzero(final) == 2


def test_multiturn_refuses_what_it_cannot_train(model):
    """A reward beside the episodes' returns, and bad first observations, are refused."""
    gd, _ = model
    kw = dict(optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=4),
              rl=RLConfig(steps=1, prompts_per_step=4), prompt_len=16,
              multiturn=MultiTurnConfig(CountEnv, LIMITS))
    with pytest.raises(ValueError, match="pass reward_fns=None"):
        RLTrainer(gd, TOK, lambda c, m: np.zeros(len(c)),
                  algorithm=algorithm_preset("grpo", group_size=2), **kw)
    # DAPO's refill rounds are rounds of any host source: episodes too (run in
    # tests/test_composition.py).
    dapo = RLTrainer(gd, TOK, None, algorithm=algorithm_preset("dapo", group_size=2), **kw)
    assert type(dapo.source).__name__ == "Refill"
    assert type(dapo.source.inner).__name__ == "Episodes"
    def sample(make_env, prompt):
        mt = MultiTurnRollouts(gd, TOK, make_env, sampling=SamplingConfig(max_new_tokens=4),
                               limits=LIMITS, prompt_len=16, group_size=1)
        mt.sample(model[1], lambda s, n: ([prompt] * n, [{"turns": 3}] * n), 0, 2,
                  jax.random.key(0))

    with pytest.raises(ValueError, match="first observation has 20 tokens"):
        sample(CountEnv, "1" * 20)

    class MoreStops(CountEnv):  # a stop string chosen per episode, unknown to the programs
        def reset(self, metadata):
            self.stop_strings = ("=", "**", "0" * int(metadata["turns"]))
            return super().reset(metadata)

    with pytest.raises(ValueError, match=r"stop strings \['000'\] that a fresh make_env"):
        sample(MoreStops, "1+1=")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The 2 x 4 pair (tests/_mp_multiturn.py), started with the module so that it runs
    beside the 1 x 8 tests; `test_two_processes_equal_one` waits for it."""
    root = tmp_path_factory.mktemp("mt_pair")
    port, env = mp.free_port(), mp._env(4)
    script = str(mp.REPO / "tests" / "_mp_multiturn.py")
    procs = [subprocess.Popen([sys.executable, script, f"127.0.0.1:{port}", str(i),
                               str(root / f"p{i}.npz")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    yield root, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_two_processes_equal_one(pair, mesh8):
    """2 processes x 4 devices, each driving the environments of its own rows and
    agreeing per turn through the named transfers only (any other is an error), sample
    the same episodes as 1 x 8: ids, masks, log-probs, rewards and episode metrics."""
    root, procs = pair
    ref = run(mesh8)
    outs = mp.outputs(procs, TIMEOUT_S)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    got = [dict(np.load(root / f"p{i}.npz")) for i in range(2)]
    assert [(int(g["lo"]), int(g["hi"])) for g in got] == [(0, 4), (4, 8)]
    for k in ("prompt_BxP", "completion_BxT", "loss_mask_BxT", "rewards_B", "truncated_B"):
        np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), ref[k], err_msg=k)
    np.testing.assert_allclose(np.concatenate([g["sampler_logp_BxT"] for g in got]),
                               ref["sampler_logp_BxT"], atol=1e-6)
    assert ref["loss_mask_BxT"].sum() < (ref["completion_BxT"] > 0).sum()  # observations
    for g in got:
        for k in ref:
            if k.startswith("env:") and not k.endswith("_s"):  # env_s, tool_s: times
                assert float(g[k.replace("/", "|")]) == ref[k], k
