"""A program reads nothing outside its spec (issue 41): the stale-program hazard.

The RL step's programs are module-level `jax.jit` functions of a frozen `StepSpec`
(`rljax.train.programs.step`), so JAX's cache keys them by the spec; a frozen static
argument's fields are in the key already. The hazard is a config field that a program
reads some other way (a closure, a global): JAX would hand a trainer a program compiled
for another value, with wrong numbers and no error. So every field of every config the
trainer takes (algorithm, RL, optimiser, sampling, model) is changed, one at a time, to
another valid value, and then either the trainer's spec changes, or the learning program
lowered for the changed trainer is byte-identical to the base trainer's (same arguments).
The fields come from the dataclasses, so a new field is covered without editing this
test. The mesh reaches the programs only as the `Mesh` object, which the spec holds (the
trainer takes no `MeshConfig`).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from _train_common import CharTok, tiny_config
from rljax.models import Decoder, ModelConfig
from rljax.models.config import Llama3RopeScaling
from rljax.models.lora import LoraConfig
from rljax.train.config import (ALGORITHMS, AlgorithmConfig, OptimConfig, RLConfig,
                                SamplingConfig)
from rljax.train.programs.step import learn_step, state_scalars
from rljax.train.rl import PhaseTimes, RLTrainer
from rljax.train.sources import Window

TOK = CharTok()
BASE = dict(algorithm=AlgorithmConfig(name="grpo", group_size=2),
            optim=OptimConfig(lr=1e-2, warmup_steps=2),
            sampling=SamplingConfig(max_new_tokens=3), rl=RLConfig(steps=4, prompts_per_step=4,
                                                                    logp_chunk=2))
MODEL = tiny_config(num_layers=1)


def _reward(completions, metadata):
    return np.array([float(c.startswith("7")) for c in completions], np.float32)


def _source(start, n):
    return ["1+2="] * n, [{}] * n


def _trainer(configs: dict, model: ModelConfig) -> RLTrainer:
    return RLTrainer(nnx.split(nnx.eval_shape(lambda: Decoder(model, rngs=nnx.Rngs(0))))[0],
                     TOK, _reward, prompt_len=6, **configs)


def _allowed(cfg, field: str) -> list:
    """The values an invalid one's error lists (`allowed: ('a', 'b')`)."""
    try:
        dataclasses.replace(cfg, **{field: "\x00"})
    except (ValueError, TypeError) as e:
        return re.findall(r"'([\w.+-]+)'", str(e).split("allowed")[-1])
    return []


# Example values of fields whose type the generic alternatives cannot guess.
EXAMPLES = {"objective": ["rljax.objectives.recent:cispo"],
            "advantages": ["rljax.objectives:rloo_advantages"],
            "rope_scaling": [Llama3RopeScaling()], "lora": [LoraConfig(rank=2)]}
# Fields that no value changes for the base trainer (GRPO, KL in the loss), and why.
FIXED = {"algorithm.adaptive_kl_target": "the controller needs kl_in='reward' (PPO)"}


def _alternatives(cfg, field: str, value) -> list:
    if field in EXAMPLES:
        return EXAMPLES[field]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, 2, 1, 0, 4]
    if isinstance(value, float):
        return [value * 0.5, value + 0.1, 0.5, 1.0, 2.0]
    return [*_allowed(cfg, field), 0.1, 1, 2, True, 0.5]


def _variants():
    """`(config name, field, changed configs, changed model)` for every field."""
    configs = [(k, v) for k, v in BASE.items()] + [("model", MODEL)]
    for name, cfg in configs:
        for f in dataclasses.fields(cfg):
            yield name, cfg, f.name


def _changed(name, cfg, field):
    """The first alternative value of `field` that makes a trainer with another resolved
    config (None when no value does)."""
    for value in _alternatives(cfg, field, getattr(cfg, field)):
        try:
            new = dataclasses.replace(cfg, **{field: value})
            if name == "algorithm" and new.resolve() == cfg.resolve():
                continue
            configs = {**BASE, name: new} if name != "model" else dict(BASE)
            tr = _trainer(configs, new if name == "model" else MODEL)
        except (ValueError, TypeError):
            continue
        if new != cfg:
            return value, tr
    return None


@pytest.fixture(scope="module")
def base():
    """The base trainer, its state and the learning program's arguments (one rollout)."""
    tr = _trainer(BASE, MODEL)
    _, params = nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))
    state = tr.init_state(params, seed=0)
    _, k_roll, k_learn = jax.random.split(jax.random.key(0), 3)
    ro = tr.rollouts.sample_round(state.params["policy"],
                                  Window(_source, 0, tr.rl.prompts_per_step), k_roll, PhaseTimes())
    args = (state.params, state.opt_state, state_scalars(state), state.ref_params, ro, k_learn,
            None)
    return tr, state, args


def _hlo(tr, state, args) -> str:
    return learn_step.lower(tr.step_spec(state), *args).as_text()


def test_every_config_field_changes_the_key_or_not_the_program(base):
    tr0, state, args = base
    key0, hlo0 = tr0.step_spec(state), _hlo(tr0, state, args)
    lowered, unchanged = [], []
    for name, cfg, field in _variants():
        found = _changed(name, cfg, field)
        if found is None:
            unchanged.append(f"{name}.{field}")
            continue
        value, tr = found
        if tr.step_spec(state) != key0:
            continue
        lowered.append(f"{name}.{field}={value!r}")
        assert _hlo(tr, state, args) == hlo0, (
            f"{name}.{field}={value!r} changes the learning program but not its spec "
            "(RLTrainer.step_spec): a trainer would reuse a stale program")
    assert unchanged == sorted(FIXED), f"no other valid value found for {unchanged}: add an "
    "example value to EXAMPLES (or, with the reason, to FIXED)"
    assert lowered, "no field kept the key: the HLO comparison never ran"
    print(f"\nlowered and equal: {lowered}\nno alternative: {unchanged}")


def test_the_comparison_sees_a_field_the_program_reads(base):
    """Control: a field the learning program reads (the temperature divides the logits
    of every log-prob) changes the lowered program, so a spec that forgot it would fail
    the test above."""
    tr0, state, args = base
    hot = _trainer(dict(BASE, sampling=SamplingConfig(max_new_tokens=3, temperature=0.5)),
                   MODEL)
    assert _hlo(hot, state, args) != _hlo(tr0, state, args)


# --- an algorithm's name selects its preset and objective, and reaches no program ------------

def _field_paths(x, prefix: str = "") -> list[str]:
    """The dotted path of every field under ``x``: dataclasses and named tuples, recursively."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        items = [(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)]
    elif isinstance(x, tuple) and hasattr(x, "_fields"):
        items = list(zip(x._fields, x))
    else:
        return []
    return [p for k, v in items for p in (prefix + k, *_field_paths(v, f"{prefix}{k}."))]


def test_the_walker_finds_a_name_field():
    """Control: the walk below reaches a nested dataclass's ``name`` (AlgorithmConfig's)."""
    nested = dataclasses.make_dataclass("Outer", [("alg", AlgorithmConfig)])(AlgorithmConfig())
    assert "alg.name" in _field_paths(nested)


@pytest.mark.parametrize("algorithm", [
    AlgorithmConfig(name="grpo", group_size=2), AlgorithmConfig(name="clip_cov", group_size=2),
    AlgorithmConfig(name="rloo", group_size=2),
    AlgorithmConfig(name="gspo", group_size=2, objective="rljax.objectives.recent:cispo")],
    ids=lambda a: a.name + ("+user" if a.objective else ""))
def test_the_step_spec_has_no_name_field(algorithm):
    """The resolved spec reads the objective's registry entry (``loss``), not the name: no
    field of ``StepSpec``, at any depth, is called ``name``, and configs with equal fields
    under names of one objective give one spec (one compiled program)."""
    spec = _trainer(dict(BASE, algorithm=algorithm), MODEL).base_spec
    paths = _field_paths(spec)
    assert "alg.loss" in paths
    assert not [p for p in paths if p.rsplit(".", 1)[-1] == "name"], paths
    fields = {f: getattr(algorithm.resolve(), f) for f in AlgorithmConfig.PRESET_FIELDS}
    same = [n for n in ALGORITHMS if AlgorithmConfig(name=n).loss == algorithm.loss]
    for other in same:  # e.g. grpo's fields under dr_grpo's name: the same objective entry
        again = _trainer(dict(BASE, algorithm=dataclasses.replace(algorithm, name=other,
                                                                   **fields)), MODEL)
        assert again.base_spec == spec and hash(again.base_spec) == hash(spec)
