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
