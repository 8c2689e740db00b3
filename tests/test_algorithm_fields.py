"""Behaviour from fields, not names: an algorithm's name selects its preset and objective in
the registry (``rljax.train.config.presets``) and nothing else; every branch reads a field
(``advantage_estimator``, ``needs_value_model``, ``needs_teacher``, the objective's entry
``loss``), and only resolution (``AlgorithmConfig``) looks a name up in the registry."""

import ast
import dataclasses
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from rljax import objectives as obj
from rljax.train.config import ALGORITHMS, GROUP_BASELINES, AlgorithmConfig
from rljax.train.config.checks import NO_RATIO
from rljax.train.config.presets import PRESET_FIELDS
from rljax.train.learn import algorithms as alg

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rljax"
REGISTRY = {"train/config/presets.py"}  # the one module that may spell out algorithm names
RESOLUTION = {"train/config/algorithm.py"}  # the one module that looks a name up in it

# What the name-based branches chose before the fields (rljax at d0f705b), written out:
# the objective (algorithms.make_objective), the sequence estimator
# (algorithms.sequence_advantages), "ppo" -> value model + GAE + kl_in="reward" allowed
# (rl.py, learn.py, runner.py, algorithm_config.py), "distill" -> teacher (rl.py, learn.py,
# experiment.py, checks.py), GROUP_BASELINES, NO_RATIO, COV_RULE_OF.
OLD_GROUP = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "cispo", "sapo", "gmpo", "clip_cov",
             "kl_cov")
OLD_OBJECTIVE = {"reinforce": obj.reinforce, "rloo": obj.reinforce, "gspo": obj.gspo,
                 "ppo": obj.ppo, "cispo": obj.cispo, "sapo": obj.sapo, "gmpo": obj.gmpo,
                 "clip_cov": obj.clip_cov, "kl_cov": obj.kl_cov, "distill": obj.distill}
OLD_COV = {"clip_cov": "clip-cov", "kl_cov": "kl-cov"}


def _old_sequence_advantages(name, rewards_B, g, adv_std, eps):
    if name == "rloo":
        return obj.rloo_advantages(rewards_B, g)
    if name == "reinforce" and g == 1:
        return rewards_B - jnp.mean(rewards_B)
    return obj.group_advantages(rewards_B, g, std=adv_std, eps=eps)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_each_preset_resolves_to_what_the_name_branches_chose(name):
    cfg = AlgorithmConfig(name=name)
    r = cfg.resolve()
    assert r.advantage_estimator is not None
    assert cfg.needs_value_model == r.needs_value_model == (name == "ppo")
    assert cfg.needs_teacher == r.needs_teacher == (name == "distill")
    assert (name in GROUP_BASELINES) == (name in OLD_GROUP)
    assert (name in NO_RATIO) == (name in ("reinforce", "rloo"))
    assert (r.advantage_estimator == "gae") == (name == "ppo")  # kl_in="reward" allowed
    f = alg.make_objective(cfg, 8)
    assert f.func is OLD_OBJECTIVE.get(name, obj.grpo)
    assert ("discount" in f.keywords) == (name == "distill")
    rule = alg.cov_rule(cfg)
    assert (rule and rule[0]) == OLD_COV.get(name)
    if name not in ("ppo", "distill"):  # the per-completion estimators, numerically
        rng = np.random.default_rng(0)
        for g in ((1, 4) if name == "reinforce" else (4,)):
            rewards_B = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
            c = dataclasses.replace(cfg, group_size=g)
            want = _old_sequence_advantages(name, rewards_B, g, r.adv_std, r.adv_eps)
            np.testing.assert_array_equal(alg.sequence_advantages(c, rewards_B), want)


@pytest.mark.parametrize("a, b", [("grpo", "dr_grpo"), ("dapo", "grpo"), ("rloo", "reinforce"),
                                  ("reinforce", "rloo")])
def test_equal_resolved_fields_behave_the_same_under_another_name(a, b):
    """``a``'s resolved fields under ``b``'s name (the same objective): the same loss,
    coefficients and advantages: ``b`` adds nothing once the fields are set."""
    ra = AlgorithmConfig(name=a, group_size=4).resolve()
    rb = dataclasses.replace(ra, name=b)
    fa, fb = alg.make_objective(ra, 8), alg.make_objective(rb, 8)
    assert (fa.func, fa.keywords) == (fb.func, fb.keywords)
    assert alg.make_coef(ra) == alg.make_coef(rb) and alg.cov_rule(ra) == alg.cov_rule(rb)
    rewards_B = jnp.asarray(np.random.default_rng(1).normal(size=(8,)), jnp.float32)
    np.testing.assert_array_equal(alg.sequence_advantages(ra, rewards_B),
                                  alg.sequence_advantages(rb, rewards_B))
    assert (ra.needs_value_model, ra.needs_teacher) == (rb.needs_value_model, rb.needs_teacher)
    assert ra.spec() == rb.spec()  # what the programs read: the fields and the entry, no name


def test_estimator_is_a_field_a_user_may_set_and_bad_combinations_say_why():
    cfg = AlgorithmConfig(name="grpo", advantage_estimator="leave_one_out", group_size=4)
    rewards_B = jnp.arange(8.0)
    np.testing.assert_array_equal(alg.sequence_advantages(cfg, rewards_B),
                                  obj.rloo_advantages(rewards_B, 4))
    assert AlgorithmConfig(name="grpo", group_size=1,
                           advantage_estimator="group_mean_or_batch").resolve().group_size == 1
    with pytest.raises(ValueError, match=r"advantage_estimator='mean' is invalid; allowed: "
                       r"one of 'group_mean', 'group_mean_or_batch', 'leave_one_out', 'gae'"):
        AlgorithmConfig(advantage_estimator="mean")
    with pytest.raises(ValueError, match=r"advantage_estimator='gae' is invalid; allowed: one "
                       r"of 'group_mean', .* with name='grpo' \(the batch its objective reads"):
        AlgorithmConfig(name="grpo", advantage_estimator="gae")
    with pytest.raises(ValueError, match=r"advantage_estimator='group_mean' .* one of 'gae'"):
        AlgorithmConfig(name="ppo", advantage_estimator="group_mean")
    with pytest.raises(ValueError, match=r"group_size=1 .*advantage_estimator='leave_one_out'"):
        AlgorithmConfig(name="reinforce", group_size=1, advantage_estimator="leave_one_out")
    with pytest.raises(ValueError, match=r"kl_in='reward' .*advantage_estimator='gae'"):
        AlgorithmConfig(name="grpo", kl_in="reward")
    # A user objective takes any estimator: GAE (and so a value model) under name="grpo".
    mine = AlgorithmConfig(name="grpo", objective="mypkg.mod:loss", advantage_estimator="gae",
                           group_size=1, kl_in="reward")
    assert mine.needs_value_model and not mine.needs_teacher


# --- no branch on an algorithm's name outside the registry -----------------------------------

_ALG_NAME = re.compile(r"(^|\.)(alg|algorithm)\.name$")


def _is_name_literal(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in ALGORITHMS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name_literal(e) for e in node.elts)
    return False


def name_branches(source: str) -> list[str]:
    """Comparisons with an algorithm name (a literal, or ``alg.name`` / ``algorithm.name``),
    and tables of two or more algorithm names (``__all__`` aside): one line each."""
    tree, found = ast.parse(source), []
    exports = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "__all__" for t in n.targets)}
    for node in ast.walk(tree):
        if id(node) in exports:  # rljax.objectives names its functions after the algorithms
            continue
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_name_literal(s) or _ALG_NAME.search(ast.unparse(s)) for s in sides):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            if sum(_is_name_literal(e) for e in elts if e is not None) >= 2:
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_check_catches_name_branches():
    assert name_branches('if cfg.name == "ppo":\n    pass')
    assert name_branches('x = cfg.algorithm.name in ("ppo", "distill")')
    assert name_branches("y = self.alg.name != other")
    assert name_branches('NO_RATIO = ("reinforce", "rloo")')
    assert name_branches('f = {"rloo": 1, "ppo": 2}.get(cfg.name)')
    assert not name_branches('if t.name == "arithmetic" or e.name != name:\n    pass')
    assert not name_branches('__all__ = ["grpo", "ppo"]\nb.require("x", by="ppo")')


def registry_lookups(source: str) -> list[str]:
    """Subscripts of the registry's tables (``OBJECTIVES[...]``, ``PRESETS[...]``)."""
    return [f"{n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Subscript) and re.search(r"(^|\.)(OBJECTIVES|PRESETS)$",
                                                          ast.unparse(n.value))]


def test_the_check_catches_registry_lookups():
    assert registry_lookups("o = OBJECTIVES[cfg.name].cov_rule")
    assert registry_lookups("p = presets.PRESETS[name]")
    assert not registry_lookups("r = tuple(n for n, o in OBJECTIVES.items() if o.ratio)")


def test_no_module_outside_the_registry_branches_on_an_algorithm_name():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in REGISTRY:
            continue
        hits = name_branches(path.read_text())
        hits += [] if rel in RESOLUTION else registry_lookups(path.read_text())
        if hits:
            found[rel] = hits
    assert not found, f"branches on an algorithm name (or registry look-ups) outside the "
    f"registry {REGISTRY} (and its resolution, {RESOLUTION}): {found}"


def test_every_preset_field_is_set_for_every_name_after_resolve():
    for name in ALGORITHMS:
        r = AlgorithmConfig(name=name).resolve()
        assert all(getattr(r, f) is not None for f in PRESET_FIELDS)
