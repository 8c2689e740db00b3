"""The composition matrix (docs/design.md, "Features compose"): rollout source {host
reward, device reward, episodes} x layout {padded, packed} x parameters {full, LoRA} x seeds
{1, 2} x algorithm {GRPO, PPO, DAPO}, on the 8-device mesh, through the one driver
(``rljax.train.driver.rl_step``).

``CELLS`` is a pairwise covering set: every pair of two factors' values appears in some
cell. Each cell runs two RL steps with finite metrics, or raises a refusal whose message
matches ``REFUSED`` (the same table, with reasons, is in docs/reference.md, "What composes").
A combination that runs must be right: ``test_packed_equals_padded_in_the_matrix``
compares one packed cell with the same run padded, and
``test_seeds_on_a_mesh_equal_each_seed_alone`` two seeds in one vmapped program with each
seed run alone on the same mesh (bit for bit).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from _mp_multiturn import LIMITS, CountEnv, source as episode_source
from _train_common import CharTok, DigitShare, digit_share, tiny_config, tiny_model
from rljax.models import ValueModel
from rljax.models.lora import LoraConfig
from rljax.sharding import shard_params
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.multiturn import MultiTurnConfig
from rljax.train.rl import RLTrainer
from rljax.train.seeds import SeedRL

TOK = CharTok()
PROMPTS = ["1+2=", "3+4=", "15+6=", "7+8=", "2*3=", "9-1=", "4+4=", "8-2="]

CELLS = [  # (source, layout, parameters, seeds, algorithm)
    ("host", "padded", "full", 1, "grpo"),
    ("device", "packed", "lora", 1, "ppo"),
    ("episodes", "padded", "lora", 2, "dapo"),
    ("host", "packed", "full", 2, "ppo"),
    ("episodes", "packed", "full", 1, "dapo"),
    ("device", "padded", "full", 2, "grpo"),
    ("host", "packed", "lora", 1, "grpo"),
    ("episodes", "padded", "full", 1, "ppo"),
    ("host", "padded", "full", 1, "dapo"),
    ("device", "padded", "full", 1, "dapo"),
    ("episodes", "padded", "full", 1, "grpo"),
]

# Refused combinations: (predicate on a cell, the refusal message's pattern). The first
# that matches a cell is the one its error must show.
REFUSED = [
    (lambda c: c[1] == "packed" and c[0] == "device",
     "tokens_per_micro_batch=.*rules out a device reward"),
    (lambda c: c[1] == "packed" and c[4] == "ppo",
     "tokens_per_micro_batch=.*rules out num_minibatches=2"),
    (lambda c: c[0] == "device" and c[4] == "dapo",
     "dynamic sampling decides its refills on the host"),
    (lambda c: c[3] > 1 and c[1] == "packed", "SeedRL: RLConfig.tokens_per_micro_batch"),
    (lambda c: c[3] > 1 and c[0] == "device",
     "SeedRL: with a device reward seeds are vmapped on one device"),
]


def refusal(cell) -> str | None:
    return next((why for test, why in REFUSED if test(cell)), None)


def prompt_source(start, n):
    idx = [(start + i) % len(PROMPTS) for i in range(n)]
    return [PROMPTS[i] for i in idx], [{"weight": 1.0 + i % 3} for i in idx]


REWARD = DigitShare()


def _models(cell, mesh, seed: int):
    """The policy ``(graphdef, params)`` and PPO's value parameters (else None) of one
    seed."""
    lora = LoraConfig(rank=2) if cell[2] == "lora" else None
    gd, st = tiny_model(seed=seed, mesh=mesh, num_layers=1, lora=lora)
    if cell[4] != "ppo":
        return gd, st, None, None
    with jax.set_mesh(mesh):
        value = ValueModel(tiny_config(num_layers=1), rngs=nnx.Rngs(seed + 1))
    value_gd, value_params = nnx.split(value)
    return gd, st, value_gd, shard_params(value_params, mesh)


def _trainer(cell, mesh, gd, value_gd):
    src, layout, _, _, name = cell
    alg = dict(group_size=1 if name == "ppo" else 2, kl_coef=0.05 if name == "ppo" else 0.0)
    multiturn = MultiTurnConfig(CountEnv, LIMITS, obs_multiple=8) if src == "episodes" else None
    reward = {"host": digit_share, "device": REWARD, "episodes": None}[src]
    return RLTrainer(gd, TOK, reward, algorithm=algorithm_preset(name, **alg),
                     optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=4),
                     # PPO: one completion per prompt, two minibatches of 4 rows (data x fsdp)
                     rl=RLConfig(steps=2, prompts_per_step=8 if name == "ppo" else 4,
                                 logp_chunk=4,
                                 tokens_per_micro_batch=64 if layout == "packed" else 0),
                     prompt_len=16, mesh=mesh, value_graphdef=value_gd, multiturn=multiturn)


def _two_steps(cell, mesh) -> list[list[dict]]:
    """Two RL steps of every seed of ``cell``: ``[step][seed] -> metrics``."""
    seeds = list(range(cell[3]))
    models = [_models(cell, mesh, s) for s in seeds]
    tr = _trainer(cell, mesh, models[0][0], models[0][2])
    prompts = episode_source if cell[0] == "episodes" else prompt_source
    values = None if cell[4] != "ppo" else [m[3] for m in models]
    out = []
    if len(seeds) == 1:
        state = tr.init_state(models[0][1], seed=0, value_params=models[0][3])
        for _ in range(2):
            state, m = tr.step(state, prompts)
            out.append([m])
        return out
    seeds_rl = SeedRL(tr)
    state = seeds_rl.init_state([m[1] for m in models], seeds, value_params=values)
    for _ in range(2):
        state, ms = seeds_rl.step(state, [prompts] * len(seeds))
        out.append(ms)
    return out


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(map(str, c)) for c in CELLS])
def test_cell_runs_or_is_refused(cell, mesh8):
    why = refusal(cell)
    if why is not None:
        with pytest.raises(ValueError, match=why):
            _two_steps(cell, mesh8)
        return
    steps = _two_steps(cell, mesh8)
    assert len(steps) == 2 and all(len(ms) == cell[3] for ms in steps)
    for m in (m for ms in steps for m in ms):
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (cell, bad)
        assert {"loss", "reward_mean", "response_len_mean"} <= set(m), (cell, sorted(m))
        if cell[4] == "dapo":
            assert "dyn_refill_rounds" in m
        if cell[0] == "episodes":
            assert "env/return" in m


def test_every_pair_is_covered():
    """CELLS covers every pair of two factors' values (the covering set's promise)."""
    factors = [("host", "device", "episodes"), ("padded", "packed"), ("full", "lora"),
               (1, 2), ("grpo", "ppo", "dapo")]
    want = {(i, a, j, b) for i in range(5) for j in range(i + 1, 5)
            for a in factors[i] for b in factors[j]}
    got = {(i, c[i], j, c[j]) for c in CELLS for i in range(5) for j in range(i + 1, 5)}
    assert want <= got, sorted(want - got)


def test_packed_equals_padded_in_the_matrix(mesh8):
    """The packed LoRA GRPO cell's first step equals the same step padded (the packed
    layout changes where tokens sit, not what is learned)."""
    packed = _two_steps(("host", "packed", "lora", 1, "grpo"), mesh8)[0][0]
    padded = _two_steps(("host", "padded", "lora", 1, "grpo"), mesh8)[0][0]
    for k in ("reward_mean", "loss", "entropy", "response_len_mean"):
        np.testing.assert_allclose(packed[k], padded[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _alone(cell, mesh, seed: int) -> list[dict]:
    """Two steps of seed ``seed`` of ``cell`` run by itself (``RLTrainer.step``)."""
    gd, st, value_gd, value_params = _models(cell, mesh, seed)
    tr = _trainer(cell, mesh, gd, value_gd)
    state = tr.init_state(st, seed=seed, value_params=value_params)
    out = []
    for _ in range(2):
        state, m = tr.step(state, episode_source if cell[0] == "episodes" else prompt_source)
        out.append(m)
    return out


def test_seeds_on_a_mesh_equal_each_seed_alone(mesh8):
    """Two seeds of a host-reward GRPO run on the 8-device mesh, in one vmapped learning
    program (``SeedRL``), against the reference: each seed run alone by ``RLTrainer.step``
    on the same mesh."""
    cell = ("host", "padded", "full", 2, "grpo")
    together = _two_steps(cell, mesh8)
    for s in range(2):
        for step, alone in enumerate(_alone(cell, mesh8, s)):
            got = together[step][s]
            for k in ("reward_mean", "loss", "entropy", "response_len_mean", "grad_norm"):
                assert got[k] == alone[k], (s, step, k, got[k], alone[k])
