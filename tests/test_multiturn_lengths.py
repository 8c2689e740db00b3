"""Multi-turn lengths (issue 56, item 7): DAPO's overlong penalty and Dr.GRPO's constant
measure the model's own tokens (the loss mask) against the whole-response budget
(``MultiTurnConfig.max_model_tokens``), not the per-turn ``sampling.max_new_tokens``
over a completion that holds the environment's output; the budget ends a row, truncated
(``"model_tokens"``); ``response_len_*`` and ``completion_tokens`` count the model's
tokens and ``env/tool_tokens_*`` the rest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _mp_multiturn import LIMITS, TOK, TURN_TOKENS, CountEnv, source
from _train_common import tiny_model
from rljax.envs import EnvBatch, EnvLimits, StepResult
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.learn import algorithms as alg
from rljax.train.multiturn import MultiTurnConfig
from rljax.train.rl import RLTrainer

ROWS = 8  # 4 prompts x group 2


@pytest.fixture(scope="module")
def model():
    return tiny_model(num_layers=1)


def _trainer(gd, budget: int, buffer, aggregation=None):
    over = {} if aggregation is None else {"aggregation": aggregation}
    return RLTrainer(gd, TOK, None,
                     algorithm=algorithm_preset("grpo", group_size=2, kl_coef=0.0,
                                                overlong_buffer=buffer, **over),
                     optim=OptimConfig(lr=1e-3),
                     sampling=SamplingConfig(max_new_tokens=TURN_TOKENS),
                     rl=RLConfig(steps=1, prompts_per_step=4, logp_chunk=8), prompt_len=16,
                     multiturn=MultiTurnConfig(CountEnv, LIMITS, obs_multiple=8,
                                               max_model_tokens=budget))


def _step(tr, params, monkeypatch):
    """One RL step; the rollout it trained on (recorded from the episode source)."""
    seen, sample = [], tr.multiturn.sample

    def spy(*args, **kw):
        seen.append(sample(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(tr.multiturn, "sample", spy)
    _, m = tr.step(tr.init_state(jax.tree.map(jnp.copy, params)), source)
    return m, seen[0]


def _lengths(out):
    ro = out.rollout
    model_B = np.asarray(ro.loss_mask_BxT).sum(axis=1)
    return model_B, np.asarray(ro.completion_mask_BxT).sum(axis=1) - model_B


def test_no_turn_near_the_budget_no_penalty(model, monkeypatch):
    """The issue's probe: a budget no episode comes near (3 turns of at most 6 tokens
    against 40, window 8) gives no penalty, though every completion, with the observations,
    is longer than the per-turn budget (which the penalty used to read: every row -1)."""
    tr = _trainer(model[0], budget=40, buffer="auto")
    assert tr.base_spec.max_new_tokens == 40 and tr.base_spec.overlong == 8
    m, out = _step(tr, model[1], monkeypatch)
    model_B, tool_B = _lengths(out)
    assert model_B.max() <= LIMITS.max_turns * TURN_TOKENS and tool_B.max() > 0
    old = alg.overlong_shaping(model_B + tool_B, TURN_TOKENS, TURN_TOKENS // 5, 1.0)
    assert (np.asarray(old) == -1.0).any()  # what the per-turn reading gave
    assert m["reward_shaped_mean"] == m["reward_mean"]
    assert m["response_len_mean"] == pytest.approx(model_B.mean())
    assert m["response_len_max"] == model_B.max()
    assert m["completion_tokens"] == model_B.sum()
    assert m["env/tool_tokens_mean"] == pytest.approx(tool_B.mean())
    assert m["env/tool_tokens_max"] == tool_B.max()


def test_the_penalty_reads_model_tokens_and_the_budget_ends_rows(model, monkeypatch):
    """A budget the episodes reach (10 model tokens, window 5): each row's shaping is
    DAPO's Eq. 13 on its model tokens alone, whatever its observations; rows that used the
    budget up end truncated ("model_tokens") and no row passes it."""
    tr = _trainer(model[0], budget=10, buffer=5)
    m, out = _step(tr, model[1], monkeypatch)
    model_B, tool_B = _lengths(out)
    assert model_B.max() <= 10
    spent = [i for i, x in enumerate(out.info) if x["truncated"] == "model_tokens"]
    assert spent and all(out.info[i]["model_tokens"] == 10 for i in spent)
    shaping = np.asarray(alg.overlong_shaping(model_B, 10, 5, 1.0))
    assert (shaping < 0).any() and (shaping == 0).any()  # the probe tells the two apart
    rewards = np.asarray(out.rollout.rewards_B)
    assert m["reward_shaped_mean"] == pytest.approx((rewards + shaping).mean(), abs=1e-6)
    # Counting the observations too would have penalised differently.
    assert not np.allclose(shaping, alg.overlong_shaping(model_B + tool_B, 10, 5, 1.0))


def test_dr_grpo_constant_is_the_episode_budget(model):
    """Dr.GRPO's constant normaliser is the whole-response budget of a multi-turn run
    (every turn's budget by default), the per-turn budget of a single-turn run."""
    tr = _trainer(model[0], budget=None, buffer=0, aggregation="seq-mean-token-sum-norm")
    assert tr.base_spec.max_new_tokens == LIMITS.max_turns * TURN_TOKENS
    objective = alg.make_objective(tr.alg, tr.base_spec.max_new_tokens)
    assert objective.keywords["norm_const"] == float(LIMITS.max_turns * TURN_TOKENS)
    assert MultiTurnConfig(CountEnv, LIMITS, max_model_tokens=7).response_budget(6) == 7
    with pytest.raises(ValueError, match="max_model_tokens must be an int >= 1"):
        MultiTurnConfig(CountEnv, LIMITS, max_model_tokens=0)


class Talker:
    """Never done: every turn answers "ok"."""

    def reset(self, metadata):
        return "q"

    def step(self, model_text, tool_results=()):
        return StepResult("ok")


def test_env_batch_counts_model_and_tool_tokens_apart():
    """EnvBatch's model-token budget: what a row's next turn may take, then the row's end."""
    envs = EnvBatch(Talker, lambda t: [ord(c) for c in t], EnvLimits(max_turns=9, max_total_tokens=100),
                    max_model_tokens=7)
    envs.reset([{}, {}])
    assert list(envs.remaining_tokens_B()) == [7, 7]
    envs.step(["abcd", "ab"], model_tokens=[4, 2])
    assert list(envs.remaining_tokens_B()) == [3, 5]
    out = envs.step(["abc", "a"], model_tokens=[3, 1])
    assert list(out.done_B) == [True, False] and list(envs.remaining_tokens_B()) == [0, 4]
    first, second = envs.info(0), envs.info(1)
    assert first["truncated"] == "model_tokens" and first["model_tokens"] == 7
    assert (second["model_tokens"], second["tool_tokens"], second["tokens"]) == (3, 4, 8)
    with pytest.raises(ValueError, match="max_model_tokens must be an int >= 1"):
        EnvBatch(Talker, lambda t: [], max_model_tokens=0)


def test_an_overlong_window_is_checked_against_the_episode_budget(model):
    """An explicit overlong window wider than one turn's budget (TURN_TOKENS) but inside
    the episode's is accepted; one at the episode budget is refused naming it."""
    assert _trainer(model[0], 40, TURN_TOKENS + 2).base_spec.overlong == TURN_TOKENS + 2
    with pytest.raises(ValueError, match="40"):
        _trainer(model[0], 40, 40)
