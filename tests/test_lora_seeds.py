"""LoRA with several seeds in one program (`run.seeds > 1`, issue 42): each seed's base
warmed up by a full-parameter SFT step (`sft.full_parameters`), then one vmapped GRPO step
of both seeds equals each seed's step alone (metrics; adapters within 1% of an Adam step)
with every base bitwise unchanged, and a stacked checkpoint (adapters only, or the whole
state when the warm-up trained the bases) gives each seed's policy back through
`restore_policy`. Tiny one-layer models."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _lora_common import LORA, randomise_adapters
from _train_common import tiny_config
from rljax.models.lora import merge_trainable, split_trainable
from rljax.models.tokenizer import build_char_tokenizer
from rljax.rewards.device import DeviceReward
from rljax.run.artifacts import export_hf, restore_policy
from rljax.run.builders import build_model
from rljax.run.experiment import ExperimentConfig, RunConfig
from rljax.run.lora_runs import AdapterCheckpoints, base_model, lora_checkpoints
from rljax.run.run_dir import RunDir
from rljax.train.batching import encode_pairs
from rljax.train.checkpoint import Checkpointer
from rljax.train.config import (AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig,
                                SFTConfig)
from rljax.train.rl import RLTrainer
from rljax.train.seeds import SeedRL, SeedSFT, stack_states, unstack


def _source(start, n):
    return ["1+2=", "3+4=", "5+6=", "7+8="][:n], [{}] * n


class _EvenShare(DeviceReward):
    """The share of a completion's tokens with an even id (a device reward: seeds vmap)."""

    def task_arrays(self, metadata):
        return {"n": np.ones(len(metadata), np.float32)}

    def __call__(self, tokens_BxT, mask_BxT, task):
        even = (tokens_BxT % 2 == 0) * mask_BxT
        return task["n"] * even.sum(axis=1) / jnp.maximum(mask_BxT.sum(axis=1), 1.0)


def _flat(tree) -> dict:
    """Leaves by their path of string keys (an NNX state or nested dicts alike)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree) if isinstance(
        tree, nnx.State) else tree)[0]
    return {tuple(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in leaves}


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory):
    """Two seeds (5, 6) of a LoRA experiment: each base warmed up by one full-parameter SFT
    step in one vmapped program (`sft.full_parameters`: `base_model` sets the adapters
    aside), the adapters then randomised (nonzero, so A's gradients could be wrong), one
    GRPO step of both seeds in one program and of each alone."""
    tok = build_char_tokenizer()
    exp = ExperimentConfig(name="lora_seeds", model=tiny_config(vocab_size=len(tok),
                                                                num_layers=1),
                           tokenizer="char", lora=LORA, sft=SFTConfig(full_parameters=True),
                           run=RunConfig(dir=str(tmp_path_factory.mktemp("run")), seed=5,
                                         seeds=2))
    per = [dataclasses.replace(exp, run=dataclasses.replace(exp.run, seed=s, seeds=1))
           for s in (5, 6)]
    splits = [nnx.split(build_model(c, tok)) for c in per]
    plain, bases, adapters = zip(*(base_model(gd, st) for gd, st in splits))
    init = [jax.tree.map(np.asarray, b) for b in bases]
    sft = SeedSFT(plain[0], SFTConfig(batch_size=4, optim=OptimConfig(lr=1e-2)))
    batch = encode_pairs(tok, ["1+2=", "3+4=", "5+6=", "7+8="], ["3", "7", "11", "15"], 6, 3)
    warm, _ = sft.step(sft.init_state(list(bases), [5, 6]), [batch, batch], [True, True])
    states = [randomise_adapters(merge_trainable(a, unstack(warm.params["policy"], k)),
                                  seed=k + 1, scale=0.1) for k, a in enumerate(adapters)]
    keep = [split_trainable(jax.tree.map(np.asarray, st))[1] for st in states]
    tr = RLTrainer(splits[0][0], tok, _EvenShare(),
                   algorithm=AlgorithmConfig(name="grpo", group_size=2),
                   optim=OptimConfig(lr=LR, warmup_steps=1),
                   sampling=SamplingConfig(max_new_tokens=3),
                   rl=RLConfig(steps=1, prompts_per_step=4, logp_chunk=2), prompt_len=6)
    copy = lambda st: jax.tree.map(jnp.copy, st)
    seeds = SeedRL(tr)
    stacked, ms = seeds.step(seeds.init_state([copy(st) for st in states], [5, 6]),
                             [_source, _source])
    alone = [tr.step(tr.init_state(copy(st), seed=5 + k), _source)
             for k, st in enumerate(states)]
    return exp, tok, init, keep, stacked, ms, alone


LR = 1e-2  # the seeds' RL learning rate


def test_a_full_parameter_warm_up_trains_each_base_and_not_its_adapters(seed_runs):
    _, _, init, keep, *_ = seed_runs
    for before, after in zip(init, keep):
        moved = [not np.array_equal(a, b) for a, b in
                 zip(jax.tree.leaves(before), jax.tree.leaves(after))]
        assert all(moved), moved  # every base weight (norms, embeddings, projections)


def test_seeds_in_one_program_equal_each_seed_alone(seed_runs):
    """Each seed's metrics and adapters are those of its run alone; every base bitwise
    unchanged by the step."""
    _, _, _, keep, stacked, ms, alone = seed_runs
    assert ms[0]["reward_mean"] != ms[1]["reward_mean"]  # the seeds differ
    for k, (state, m) in enumerate(alone):
        np.testing.assert_allclose(ms[k]["reward_mean"], m["reward_mean"], rtol=1e-6)
        np.testing.assert_allclose(ms[k]["loss"], m["loss"], rtol=1e-4, atol=1e-6)
        adapters, base = split_trainable(unstack(stacked.params["policy"], k))
        for a, b in zip(jax.tree.leaves(keep[k]), jax.tree.leaves(base)):
            np.testing.assert_array_equal(a, b)  # bitwise: each seed's base never moves
        # A vmapped matmul may sum in another order: 1% of one Adam step.
        for a, b in zip(jax.tree.leaves(adapters),
                        jax.tree.leaves(split_trainable(state.params["policy"])[0])):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * LR)


@pytest.mark.parametrize("warmed", [False, True])
def test_a_stacked_checkpoint_gives_each_seeds_policy_back(seed_runs, tmp_path, warmed):
    """As `run_seeds` saves it (`lora_checkpoints`): the adapters alone on the seeds'
    rebuildable bases, or the whole state when the warm-up trained the bases; either way
    `restore_policy` (what `rljax export/eval --seed S` read) gives seed S's policy."""
    exp, tok, _, _, stacked, _, _ = seed_runs
    exp = dataclasses.replace(exp, sft=SFTConfig(full_parameters=warmed),
                              run=dataclasses.replace(exp.run, dir=str(tmp_path)))
    RunDir(tmp_path, exp).close()
    tok.save_pretrained(str(tmp_path / "tokenizer"))
    if not warmed:  # stands for a run without a warm-up: the bases are the initial ones
        rebuilt = [split_trainable(nnx.split(build_model(dataclasses.replace(
            exp, run=dataclasses.replace(exp.run, seed=s, seeds=1)), tok))[1])[1] for s in (5, 6)]
        stacked = dataclasses.replace(stacked, params={"policy": merge_trainable(
            split_trainable(stacked.params["policy"])[0], stack_states(rebuilt))})
    with Checkpointer(tmp_path / "checkpoints") as raw:
        ck = lora_checkpoints(exp, raw)
        assert isinstance(ck, AdapterCheckpoints) != warmed
        ck.save(1, stacked, {}, force=True)
    if warmed:  # adapters of a base no folder holds
        with pytest.raises(ValueError, match="trained its base"):
            export_hf(tmp_path, tmp_path / "peft", adapters=True)
    for k, s in enumerate((5, 6)):
        _, _, policy, _ = restore_policy(tmp_path, None, run_seed=s)
        want, got = _flat(unstack(stacked.params["policy"], k)), _flat(policy)
        assert got.keys() == want.keys()
        for path in want:
            np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
