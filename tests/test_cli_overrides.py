"""apply_overrides on a sample nested frozen config: typed parsing, errors, re-validation."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import pytest

from rljax.run.overrides import OverrideError, apply_overrides, parse_value


@dataclasses.dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    clip_norm: Optional[float] = 1.0


@dataclasses.dataclass(frozen=True)
class Clip:
    low: float = 0.2
    high: float = 0.2

    def __post_init__(self):
        if self.high < self.low:
            raise ValueError(f"high must be >= low, got low={self.low} high={self.high}")


@dataclasses.dataclass(frozen=True)
class Sft:
    steps: int = 10
    batch_size: int = 4


@dataclasses.dataclass(frozen=True)
class Run:
    dir: str = "runs/x"
    seed: int = 0
    resume: bool = False
    stops: tuple[str, ...] = ()
    shape: tuple[int, int] = (1, 2)
    tag: str | None = None


@dataclasses.dataclass(frozen=True)
class Top:
    optim: Optim = Optim()
    clip: Clip = Clip()
    run: Run = Run()
    sft: Sft | None = None
    smoke: bool = False


def test_typed_values_parse_by_annotation():
    cfg = apply_overrides(
        Top(),
        [
            "optim.lr=1e-5",
            "optim.warmup_steps=20",
            "optim.schedule=cosine",
            "optim.clip_norm=none",
            "run.dir=/tmp/a=b",
            "run.seed=3",
            "run.resume=true",
            "run.stops=</answer>, </think>",
            "run.shape=(4, 8)",
            "run.tag=abc",
            "smoke=1",
        ],
    )
    assert cfg.optim == Optim(lr=1e-5, warmup_steps=20, schedule="cosine", clip_norm=None)
    assert cfg.run.dir == "/tmp/a=b"  # value split on the first '=' only
    assert cfg.run.seed == 3 and cfg.run.resume is True and cfg.smoke is True
    assert cfg.run.stops == ("</answer>", "</think>")
    assert cfg.run.shape == (4, 8) and cfg.run.tag == "abc"
    assert isinstance(cfg.optim.lr, float) and isinstance(cfg.run.seed, int)
    assert apply_overrides(cfg, []) is cfg


def test_none_section_is_created_with_defaults():
    cfg = apply_overrides(Top(), ["sft.steps=50"])
    assert cfg.sft == Sft(steps=50)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(OverrideError, match=r"optim.lrr.*\['clip_norm', 'lr', 'schedule', 'warmup_steps'\]"):
        apply_overrides(Top(), ["optim.lrr=1"])
    with pytest.raises(OverrideError, match=r"valid keys at the top level are \['clip', 'optim', 'run', 'sft', 'smoke'\]"):
        apply_overrides(Top(), ["optimizer.lr=1"])


@pytest.mark.parametrize(
    "text, pieces",
    [
        ("optim.lr=fast", ["optim.lr", "float", "'fast'"]),
        ("run.seed=1.5", ["run.seed", "int", "'1.5'"]),
        ("run.resume=maybe", ["run.resume", "bool", "'maybe'"]),
        ("optim.schedule=linear", ["optim.schedule", "constant", "'linear'"]),
        ("run.shape=1,2,3", ["run.shape", "tuple", "'1,2,3'"]),
        ("optim=3", ["optim", "Optim", "'3'"]),
    ],
)
def test_wrong_type_names_key_type_and_text(text, pieces):
    with pytest.raises(OverrideError) as info:
        apply_overrides(Top(), [text])
    for piece in pieces:
        assert piece in str(info.value)


def test_result_is_revalidated_once_with_all_changes():
    # Each change alone would break high >= low; together they are valid.
    cfg = apply_overrides(Top(), ["clip.low=0.5", "clip.high=0.6"])
    assert (cfg.clip.low, cfg.clip.high) == (0.5, 0.6)
    with pytest.raises(OverrideError, match="high must be >= low"):
        apply_overrides(Top(), ["clip.low=0.9"])


@pytest.mark.parametrize(
    "bad", ["optim.lr", "=3", "optim..lr=3", "optim.lr=1 ", "run.dir=x"]
)
def test_malformed_and_duplicate(bad):
    if bad in ("optim.lr=1 ", "run.dir=x"):  # well-formed: duplicated below
        with pytest.raises(OverrideError, match="twice"):
            apply_overrides(Top(), [bad, bad])
    else:
        with pytest.raises(OverrideError):
            apply_overrides(Top(), [bad])


def test_leaf_cannot_be_descended():
    with pytest.raises(OverrideError, match="not a config section"):
        apply_overrides(Top(), ["smoke.x=1"])


def test_parse_value_unions():
    assert parse_value(int | str, "7") == 7
    assert parse_value(int | str, "seven") == "seven"
    assert parse_value(Optional[str], "None") is None
    assert parse_value(float, "inf") == float("inf")
    with pytest.raises(TypeError):
        apply_overrides(Top(), "optim.lr=1")


# --- `none` and `preset` on the real experiment config --------------------------------

def _section(sec):
    """A None section built: its defaults, or an example where it has required fields."""
    from rljax.models.config import MoeConfig
    examples = {MoeConfig: lambda: MoeConfig(num_experts=4, experts_per_token=2,
                                             intermediate_size=16)}
    return examples.get(sec, sec)()


def _leaf_keys(obj, prefix=""):
    """Every settable leaf `section.field` of a config tree (None sections built)."""
    from rljax.run.overrides import _field_types
    for name, tp in _field_types(obj).items():
        value = getattr(obj, name)
        cls = value if dataclasses.is_dataclass(value) else None
        if cls is None and value is None:
            from rljax.train.config.dicts import dataclass_in
            sec = dataclass_in(tp)
            cls = _section(sec) if sec is not None else None
        if cls is not None:
            yield from _leaf_keys(cls, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def _experiment():
    """A config with every section set or buildable (the `env` section has a required
    field, so it is set: its fields are walked too)."""
    from rljax.models import ModelConfig
    from rljax.run.environment import EnvConfig
    from rljax.run.experiment import ExperimentConfig
    return ExperimentConfig(model=ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                              num_layers=1, num_heads=2, num_kv_heads=1),
                            env=EnvConfig(env="rljax.envs:ArithmeticToolEnv"))


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_none_means_none_on_every_field_that_allows_it():
    """`X=none` (and `X="none"`) gives None or "none" on every field that takes it, never
    the preset; fields that do not take it are refused, preset fields naming `preset`."""
    cfg = _experiment()
    took = set()
    for key in _leaf_keys(cfg):
        for text in ("none", '"none"'):
            try:
                out = apply_overrides(cfg, [f"{key}={text}"])
            except OverrideError as e:
                if key.startswith("algorithm.") and key.split(".")[1] in cfg.algorithm.PRESET_FIELDS:
                    assert "preset" in str(e), (key, str(e))
                continue
            value = _get(out, key)
            if key.startswith("algorithm."):
                value = out.algorithm.resolved(key.split(".")[1])
            parent, _, field = key.rpartition(".")
            section = _get(cfg, parent) if parent else cfg
            if section is None:
                section = _get(out, parent)
            # What the section's own constructor makes of None (ModelConfig.head_dim
            # derives it): none means None, then the config's meaning of None.
            derived = getattr(dataclasses.replace(section, **{field: None}), field) \
                if value not in (None, "none") else value
            assert value in (None, "none", derived) and not (
                parent == "algorithm" and field in cfg.algorithm.PRESET_FIELDS
                and value is None), (key, text, value)
            took.add((key, text))
    # The fields whose legal values include "none": both spellings reach "none".
    for key in ("algorithm.kl_in", "algorithm.adv_std", "remat", "model.remat"):
        assert {(key, "none"), (key, '"none"')} <= took, key
        assert _get(apply_overrides(cfg, [f"{key}=none"]), key) == "none"
    # Optional fields: unquoted none is None, quoted "none" is the string where it is one.
    assert apply_overrides(cfg, ["task.system_prompt=none"]).task.system_prompt is None
    assert apply_overrides(cfg, ['task.system_prompt="none"']).task.system_prompt == "none"


def test_kl_in_none_is_not_the_preset_and_preset_returns_to_it():
    cfg = _experiment()  # grpo: kl_in "loss" by preset
    out = apply_overrides(cfg, ["algorithm.kl_coef=0.1", "algorithm.kl_in=none"])
    assert out.algorithm.resolve().kl_in == "none" and out.algorithm.resolve().kl_coef == 0.1
    back = apply_overrides(out, ["algorithm.kl_in=preset", "algorithm.kl_coef=preset"])
    assert back.algorithm.kl_in is None and back.algorithm.resolve().kl_in == "loss"
    assert back.algorithm.resolve().kl_coef == 0.04
    for key in cfg.algorithm.PRESET_FIELDS:  # every preset field returns to its preset
        assert _get(apply_overrides(cfg, [f"algorithm.{key}=preset"]), f"algorithm.{key}") is None


@pytest.mark.parametrize("text, pieces", [
    ("algorithm.kl_in=off", ["'loss', 'reward', 'none'", "algorithm.kl_in=preset"]),
    ("algorithm.kl_coef=none", ["'none' is not one of its values", "algorithm.kl_coef=preset"]),
    ("algorithm.group_size=many", ["int, or 'preset'", "'many'"]),
])
def test_bad_preset_field_values_name_preset(text, pieces):
    with pytest.raises(OverrideError) as info:
        apply_overrides(_experiment(), [text])
    for piece in pieces:
        assert piece in str(info.value), str(info.value)


def test_quoted_values():
    assert parse_value(str, '"none"') == "none" and parse_value(Optional[str], "'x y'") == "x y"
    assert parse_value(Optional[float], '"none"') is None and parse_value(int, "'3'") == 3
    assert parse_value(Literal["none", "full"], '"none"') == "none"
