"""The procedural tasks' verifiers: each task of `rljax.data` composed with `rljax.rewards`.

`rljax.data` generates problems and `rljax.rewards` extracts and compares answers; neither
imports the other. A task's reward is composed here, where the run builds the task
(`rljax.run.builders.build_reward`):
- `check_arithmetic(completion, answer, style)` and `ArithmeticReward`: arithmetic problems
  (`rljax.data.ArithmeticTask`), plain, reversed-digit or word style;
- `CountdownReward`: Countdown equations (`rljax.data.check_countdown`) inside answer tags,
  with TinyZero's format score.
Item rewards are `(completion, metadata) -> float`, for `rljax.rewards.score_batch`.
`ArithmeticDeviceReward` is `check_arithmetic` (plain and reversed styles) as a JAX
function of token ids (`rljax.rewards.device`), for the one-program RL step; it lives in
`rljax.run.device_tasks` and loads from here on first use, so a reward worker process
that unpickles a verifier of this module imports no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rljax.data import check_countdown, reverse_digits
from rljax.rewards import TagFormat, extract_answer, follows_format, math_equal, tagged_answer

__all__ = ["ArithmeticDeviceReward", "ArithmeticReward", "CountdownReward", "check_arithmetic"]


def __getattr__(name: str):  # PEP 562: the device reward (and JAX) load on first use
    if name == "ArithmeticDeviceReward":
        from rljax.run.device_tasks import ArithmeticDeviceReward
        return ArithmeticDeviceReward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_arithmetic(completion: object, answer: str, *, style: str = "plain") -> bool:
    """Whether `completion` answers correctly.

    plain: the completion, after leading whitespace, starts with the exact integer (an
    optional sign and digits, ended by anything that is not a digit), e.g. `"579\\n..."`.
    reversed: as plain, but the integer's digits are written least-significant first
    (`"975"` answers `"579"`; leading zeros of the reversed form must be written out, so
    `"003"` answers `"300"` and `"03"` does not).
    word: `extract_answer` (boxed, `####`, "the answer is") then `math_equal`.
    """
    if not isinstance(completion, str):
        return False
    if style == "word":
        return math_equal(extract_answer(completion), answer)
    s = completion[:64].lstrip()
    j = 1 if s[:1] in ("-", "+") else 0
    while j < len(s) and s[j].isascii() and s[j].isdigit():
        j += 1
    token = s[:j]
    if style == "reversed":
        token = reverse_digits(token)
    return token.lstrip("+") == answer and any(c.isdigit() for c in token)


@dataclasses.dataclass(frozen=True)
class ArithmeticReward:
    """Item reward: 1.0 if `check_arithmetic(completion, meta["answer"], style)`."""

    style: str = "plain"
    name: str = "arithmetic"

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        if "answer" not in meta:
            raise KeyError(f"{self.name}: metadata has no 'answer' field (has {sorted(meta)})")
        return 1.0 if check_arithmetic(completion, str(meta["answer"]), style=self.style) else 0.0


@dataclasses.dataclass(frozen=True)
class CountdownReward:
    """Item reward, TinyZero style: `correct` if the tagged equation reaches
    `meta["target"]` with `meta["numbers"]`, else `format_score` if the completion
    follows the tag format, else 0."""

    fmt: TagFormat = TagFormat()
    correct: float = 1.0
    format_score: float = 0.1
    use_all: bool = False
    name: str = "countdown"

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        for key in ("numbers", "target"):
            if key not in meta:
                raise KeyError(f"{self.name}: metadata has no {key!r} field (has {sorted(meta)})")
        eq = tagged_answer(completion, self.fmt)
        if check_countdown(eq, meta["numbers"], meta["target"], use_all=self.use_all):
            return self.correct
        return self.format_score if follows_format(completion, self.fmt) else 0.0
