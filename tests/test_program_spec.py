"""A program reads nothing outside its static key (issues 41, 56): the stale-program hazard.

Every compiled program of a run is a module-level `jax.jit` whose static arguments (the
*key*: a frozen `StepSpec`, `DecodeSpec`, `TurnSpec`, graphdef, mesh, device reward) are
all it reads besides its arrays, so JAX's cache keys it by them. The hazard: a config
field that reaches a program some other way (a global, or a key object whose equality
ignores part of what it holds). JAX would hand a trainer a program compiled for another
value, with wrong numbers and no error.

So every field of every config a trainer takes (algorithm, RL, optimiser, sampling,
model, with the fields of nested configs such as `LoraConfig` and the rope scalings) is
changed, one at a time, to another valid value, and for each program (learn, fused,
seeds, prefill, decode, the multi-turn turn programs, evaluation) either its key changes,
or the program lowered for the changed trainer is byte-identical to the base's. JAX
caches a trace by its key, so an equal key would return the cached trace whatever the
key holds: a key equal to the base's but holding something else is lowered afresh
(`_fresh`); one holding the same (`_content`) can only lower differently through state
outside it, which `test_programs_lower_the_same_after_every_variant` checks by lowering
every base program afresh after all variants were built. The programs are lowered,
never compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _mp_multiturn import LIMITS, CountEnv
from _train_common import CharTok, tiny_config
from rljax.models import Decoder, ModelConfig
from rljax.models.config import Llama3RopeScaling
from rljax.models.lora import LoraConfig
from rljax.rewards.device import DeviceReward
from rljax.sampling import sampler, state_vocab_major_weight, turns
from rljax.sampling.generate import prepare
from rljax.sharding import logical_constraints
from rljax.train.config import (ALGORITHMS, AlgorithmConfig, OptimConfig, RLConfig,
                                SamplingConfig)
from rljax.train.multiturn import MultiTurnConfig
from rljax.train.programs.device import device_rollout, device_scores, seeds_evaluate
from rljax.train.programs.step import (fused_step, learn_step, seeds_learn_step, seeds_step,
                                      state_scalars)
from rljax.train.rl import RLTrainer

TOK = CharTok()
BASE = dict(algorithm=AlgorithmConfig(name="grpo", group_size=2),
            optim=OptimConfig(lr=1e-2, warmup_steps=2),
            sampling=SamplingConfig(max_new_tokens=3), rl=RLConfig(steps=4, prompts_per_step=4,
                                                                    logp_chunk=2))
MODEL = tiny_config(num_layers=1)
PROMPT_LEN, SEEDS = 6, 2


@dataclasses.dataclass(frozen=True)
class Digits(DeviceReward):
    """A device reward: ``scale`` times the share of digit tokens (CharTok's ids 2..11)."""

    scale: float = 1.0
    verifier = True

    def task_arrays(self, metadata):
        return {"weight": np.ones(len(metadata), np.float32)}

    def __call__(self, tokens_BxT, mask_BxT, task):
        digit = (tokens_BxT >= 2) & (tokens_BxT <= 11) & (mask_BxT > 0)
        return self.scale * task["weight"] * jnp.mean(digit, axis=1)


def _reward(completions, metadata):
    return np.array([float(c.startswith("7")) for c in completions], np.float32)


def _source(start, n):
    return ["1+2="] * n, [{"turns": 2}] * n


def _trainers(configs: dict, model: ModelConfig, reward=Digits()) -> dict:
    """The kinds of trainer a run builds (a host reward, a device reward, episodes) that
    accept these configs, and the model config."""
    gd = nnx.split(nnx.eval_shape(lambda: Decoder(model, rngs=nnx.Rngs(0))))[0]
    make = functools.partial(RLTrainer, gd, TOK, prompt_len=PROMPT_LEN, **configs)
    kinds = {"host": lambda: make(_reward), "device": lambda: make(reward),
             "episodes": lambda: make(None, multiturn=MultiTurnConfig(CountEnv, LIMITS,
                                                                      obs_multiple=8))}
    out = {"model": model}
    for kind, build in kinds.items():
        try:
            out[kind] = build()
        except (ValueError, TypeError):
            continue  # a refused combination (e.g. packing with a device reward)
    return out


def _decode_spec(trs: dict, kind: str, greedy: bool = False):
    """The sampler's spec of a trainer's prompts (greedy: its evaluation's)."""
    ro = trs[kind].rollouts
    return prepare(trs["model"], [TOK.encode("1+2=")] * 4, **ro.decode_args(
        greedy=greedy, num_samples=1 if greedy else ro.group_size))[1]


def _keys(trs: dict) -> dict[str, tuple]:
    """Each program's static arguments, as the trainers build them (those of the kinds
    built)."""
    keys = {}
    if "host" in trs:
        host, decode = trs["host"], _decode_spec(trs, "host")
        keys.update(learn=(host.base_spec,), seeds_learn=(host.base_spec,),
                    prefill=(host.rollouts.gd, decode, None),
                    decode=(host.rollouts.gd, decode, None))
    if "device" in trs:
        device, decode = trs["device"], _decode_spec(trs, "device")
        reward = device.rollouts.reward
        keys.update(fused=(device.base_spec, decode), seeds=(device.base_spec, decode),
                    device_scores=(reward,),
                    seeds_evaluate=(device.rollouts.gd, reward,
                                    _decode_spec(trs, "device", greedy=True)))
    if "episodes" in trs:
        turn = trs["episodes"].multiturn
        keys.update(dict.fromkeys(("start", "observe", "decode_turn"),
                                  (turn.gd, turn.spec(PROMPT_LEN), None)))
    return keys


# program name -> the jitted function; `_fresh` clears all their caches (nested calls too).
JITS = {"learn": learn_step, "seeds_learn": seeds_learn_step, "fused": fused_step,
        "seeds": seeds_step,
        "prefill": sampler._prefill, "decode": sampler._decode, "start": turns.start,
        "observe": turns.observe, "decode_turn": turns.decode_turn,
        "device_scores": device_scores, "seeds_evaluate": seeds_evaluate}


def _abstract(tree, lead: tuple = ()):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(lead + jnp.shape(x), jnp.result_type(x)),
                        tree)


@pytest.fixture(scope="module")
def base():
    """The base trainers, their keys and every program's array arguments (abstract)."""
    trs = _trainers(BASE, MODEL)
    keys = _keys(trs)
    _, params = nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))
    head = _abstract(state_vocab_major_weight(params, MODEL))
    state = trs["device"].init_state(params, seed=0)
    policy = _abstract(state.params["policy"])
    _, arrays, task = trs["device"].rollouts.inputs(policy, _source, 0, 4)
    spec, decode = keys["fused"]
    ro = jax.eval_shape(functools.partial(device_rollout, spec.policy_gd, spec=decode,
                                          reward=Digits()), policy, arrays, task,
                        jax.random.key(1))
    fused = (state.params, state.opt_state, state_scalars(state), state.ref_params, arrays,
             task, state.key, None)
    prefill = (policy, head, *arrays, jax.random.key(0))
    s, prefix, _ = jax.eval_shape(functools.partial(sampler._prefill, *keys["prefill"]),
                                  *prefill)
    r, turn = 8, keys["start"]
    first = (policy, head, jnp.ones((r, PROMPT_LEN), jnp.int32),
             jnp.ones((r, PROMPT_LEN), bool), jnp.full((r,), 3, jnp.int32), jax.random.key(0))
    ts = jax.eval_shape(functools.partial(turns.start, *turn), *first)
    ones_R = jnp.ones((r,), jnp.int32)
    greedy = keys["seeds_evaluate"][2]
    out = jax.eval_shape(functools.partial(sampler.sample_arrays, keys["prefill"][0],
                                           spec=greedy, key=jax.random.key(0)),
                         policy, *arrays)
    learn = (state.params, state.opt_state, state_scalars(state), state.ref_params, ro,
             jax.random.key(2), None)
    args = {"learn": learn, "seeds_learn": (*_abstract(learn[:-1], (SEEDS,)), None),
            "fused": fused, "seeds": (*_abstract(fused[:-1], (SEEDS,)), None),
            "prefill": prefill, "decode": (policy, head, s, prefix),
            "start": first, "observe": (policy, head, ts, jnp.ones((r, 8), jnp.int32), ones_R,
                                        jnp.ones((r,), bool), ones_R),
            "decode_turn": (policy, head, ts), "device_scores": (out, task),
            "seeds_evaluate": _abstract((policy, *arrays, task), (SEEDS,))}
    hlo = {name: _fresh(name, keys[name], args[name]) for name in JITS}
    return keys, args, hlo


def _fresh(name: str, key: tuple, args: tuple) -> str:
    """The program lowered from a new trace (JAX's trace caches cleared: an equal key
    would return the cached trace whatever it holds)."""
    for fn in JITS.values():
        fn.clear_cache()
    return JITS[name].lower(*key, *args).as_text()


def _content(x):
    """Everything a key holds, field by field (dataclass fields whatever their ``compare``
    flag, tuples, dicts; other objects by repr): equal content traces the same program."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__,) + tuple((f.name, _content(getattr(x, f.name)))
                                           for f in dataclasses.fields(x))
    if isinstance(x, (tuple, list)):
        return tuple(_content(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _content(v)) for k, v in x.items())
    return repr(x)


def _allowed(cfg, field: str) -> list:
    """The values an invalid one's error lists (`allowed: ('a', 'b')`)."""
    try:
        dataclasses.replace(cfg, **{field: "\x00"})
    except (ValueError, TypeError) as e:
        return re.findall(r"'([\w.+-]+)'", str(e).split("allowed")[-1])
    return []


# Example values of fields whose type the generic alternatives cannot guess; a dataclass
# example's own fields are varied too.
EXAMPLES = {"objective": ["rljax.objectives.recent:cispo"],
            "advantages": ["rljax.objectives:rloo_advantages"],
            "rope_scaling": [Llama3RopeScaling()],
            "lora": [LoraConfig(rank=2)], "targets": [("q",), ("q", "v", "o")]}
# Fields that no value changes for the base trainer (GRPO, KL in the loss), and why.
FIXED = {"algorithm.adaptive_kl_target": "the controller needs kl_in='reward' (PPO)",
         # Not varied alone: ModelConfig refuses a MoeConfig unless architecture is
         # 'qwen3_moe' (two fields at once); tests/test_moe.py compiles the MoE programs.
         "model.moe": "a MoeConfig needs architecture='qwen3_moe' too"}


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


def _variants(cfg, path: str):
    """``(dotted path, replace)`` for every field under ``cfg``, nested configs included:
    ``replace(value)`` is ``cfg`` with that field set to ``value``; ``cfg`` is the base
    of the field's alternatives. A nested config that is None in the base is varied from
    each of its example values."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        yield f"{path}.{f.name}", cfg, f.name, (lambda v, n=f.name: dataclasses.replace(
            cfg, **{n: v}))
        nested = [value] if dataclasses.is_dataclass(value) else (
            [v for v in EXAMPLES.get(f.name, []) if dataclasses.is_dataclass(v)]
            if value is None else [])
        for inner in nested:
            for sub, owner, name, rep in _variants(inner, f"{path}.{f.name}"):
                yield sub, owner, name, (lambda v, rep=rep, n=f.name: dataclasses.replace(
                    cfg, **{n: rep(v)}))


def _configs(name: str, new) -> tuple[dict, ModelConfig]:
    return ({**BASE, name: new}, MODEL) if name != "model" else (dict(BASE), new)


def _changed(name: str, owner, field: str, replace):
    """The first alternative value of ``field`` that builds trainers with another resolved
    config: ``(value, trainers)``, or None when no value does."""
    for value in _alternatives(owner, field, getattr(owner, field)):
        try:
            new = replace(value)
        except (ValueError, TypeError):
            continue
        cfg = BASE.get(name, MODEL)
        if new == cfg or name == "algorithm" and new.resolve() == cfg.resolve():
            continue
        trs = _trainers(*_configs(name, new))
        if len(trs) > 1:
            return value, trs
    return None


def _all_variants():
    for name, cfg in [*BASE.items(), ("model", MODEL)]:
        yield from ((name, *v) for v in _variants(cfg, name))


def test_every_config_field_changes_each_key_or_not_the_program(base):
    keys0, args, hlo0 = base
    seen = {name: {_content(keys0[name])} for name in JITS}
    lowered, unchanged, paths = [], [], []
    for name, path, owner, field, replace in _all_variants():
        paths.append(path)
        found = _changed(name, owner, field, replace)
        if found is None:
            unchanged.append(path)
            continue
        value, trs = found
        for prog, key in _keys(trs).items():
            if key != keys0[prog] or _content(key) in seen[prog]:
                continue  # another key, or the same one holding the same
            seen[prog].add(_content(key))
            lowered.append(f"{prog}: {path}={value!r}")
            assert _fresh(prog, key, args[prog]) == hlo0[prog], (
                f"{path}={value!r} changes the {prog} program but not its key: a trainer "
                "would reuse a stale program")
    assert unchanged == sorted(FIXED), f"no other valid value found for {unchanged}: add an "
    "example value to EXAMPLES (or, with the reason, to FIXED)"
    nested = {"model.lora.rank", "model.lora.targets", "model.rope_scaling.factor",
              "model.rope_scaling.original_max_position_embeddings"}
    assert nested <= set(paths), "the nested configs' fields were not varied"
    print(f"\nvaried {len(paths)} fields; lowered afresh and equal: {lowered}")


def test_programs_lower_the_same_after_every_variant(base):
    """Every program, lowered afresh once all variants' trainers were built, is the base
    one: no trainer left state behind that a program reads."""
    keys, args, hlo = base
    for name in JITS:
        assert _fresh(name, keys[name], args[name]) == hlo[name], name


def test_a_key_that_hides_a_field_is_caught(base):
    """Control: a reward whose equality ignores its scale gives the evaluation's scoring
    program the base's key for another scale; lowered afresh, the program differs, so the
    check above would fail on it. From JAX's trace cache it would not: the hazard itself."""

    @dataclasses.dataclass(frozen=True)
    class Loose(Digits):
        scale: float = dataclasses.field(default=1.0, compare=False)

    _, args, _ = base
    name, arrays = "device_scores", args["device_scores"]
    one, two = (_keys(_trainers(BASE, MODEL, Loose(scale=s)))[name] for s in (1.0, 2.0))
    assert one == two and _content(one) != _content(two)
    first = _fresh(name, one, arrays)
    assert JITS[name].lower(*two, *arrays).as_text() == first  # the cached trace
    assert _fresh(name, two, arrays) != first


def test_the_comparison_sees_a_field_the_program_reads(base):
    """Control: a field the learning program reads (the temperature divides the logits
    of every log-prob) changes the lowered program."""
    keys0, args, hlo0 = base
    hot = _trainers(dict(BASE, sampling=SamplingConfig(max_new_tokens=3, temperature=0.5)),
                    MODEL)
    assert _fresh("learn", _keys(hot)["learn"], args["learn"]) != hlo0["learn"]


def test_trace_time_switches_are_in_the_key():
    """The switches read while a program is traced (``logical_constraints``, the mesh's
    platform for splash attention) are part of JAX's cache key: a program traced with the
    constraints is not handed out inside ``logical_constraints(False)``."""
    from rljax.sharding import constrain_logical, make_mesh, MeshConfig

    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    f = jax.jit(lambda x: constrain_logical(x, ("batch", None)) * 2)
    x = jnp.ones((8, 4))
    with jax.set_mesh(mesh):
        on = f.lower(x).as_text()
        with logical_constraints(False):
            off = f.lower(x).as_text()
        assert f.lower(x).as_text() == on
    assert "sharding" in on and on != off


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
    spec = _keys(_trainers(dict(BASE, algorithm=algorithm), MODEL))["learn"][0]
    paths = _field_paths(spec)
    assert "alg.loss" in paths
    assert not [p for p in paths if p.rsplit(".", 1)[-1] == "name"], paths
    fields = {f: getattr(algorithm.resolve(), f) for f in AlgorithmConfig.PRESET_FIELDS}
    same = [n for n in ALGORITHMS if AlgorithmConfig(name=n).loss == algorithm.loss]
    for other in same:  # e.g. grpo's fields under dr_grpo's name: the same objective entry
        again = _keys(_trainers(dict(BASE, algorithm=dataclasses.replace(
            algorithm, name=other, **fields)), MODEL))["learn"][0]
        assert again == spec and hash(again) == hash(spec)
