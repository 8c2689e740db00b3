"""Procedural arithmetic problems with a difficulty knob (`digits`).

Two prompt styles from one sampled problem:
- plain, for tiny char-level models: prompt `"123+456="`, answer `"579"`;
- word, for instruction models: a short word problem whose worked solution ends with
  GSM8K's `#### 579`, so the SFT target and the verifier agree;
- reversed, plain prompts whose answer is written least-significant digit first
  (`"123+456="` -> `"975"`, sign first for negatives: `"-12"` -> `"-21"`). Small
  transformers learn this order much more robustly, because each output digit then depends
  only on digits already seen (Lee et al. 2023, "Teaching Arithmetic to Small
  Transformers", arXiv:2307.03381). `answer` stays the true integer.

The checker and the item reward (`check_arithmetic`, `ArithmeticReward`) are composed with
the answer extraction of `rljax.rewards` in the run layer: `rljax.run.tasks`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["OPS", "ArithmeticProblem", "ArithmeticTask", "reverse_digits"]

OPS = ("+", "-", "*", "/")
_STYLES = ("plain", "reversed", "word")
_WORD = {
    "+": "{name} has {a} marbles and finds {b} more. How many marbles does {name} have now?",
    "-": "{name} has {a} marbles and gives away {b}. How many marbles does {name} have left?",
    "*": "{name} fills {a} boxes with {b} marbles each. How many marbles is that in total?",
    "/": "{name} shares {a} marbles equally among {b} friends. How many does each friend get?",
}
_NAMES = ("Ada", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana")
_VERB = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: `prompt` (per the task's style), `answer` (integer string),
    `solution` (worked solution for SFT, ending in the answer), operands and operator."""

    prompt: str
    answer: str
    solution: str
    a: int
    b: int
    op: str

    def to_record(self) -> dict[str, Any]:
        """A metadata dict for `score_batch` (`prompt`, `answer`, `solution`)."""
        return {"prompt": self.prompt, "answer": self.answer, "solution": self.solution}


def _column_addition(a: int, b: int) -> str:
    """Digit-by-digit addition with carries, least significant digit first."""
    steps, carry, x, y, place = [], 0, a, b, 0
    while x or y or carry:
        s = x % 10 + y % 10 + carry
        steps.append(f"place {place}: {x % 10}+{y % 10}+{carry}={s}, write {s % 10}"
                     f" carry {s // 10}")
        carry, x, y, place = s // 10, x // 10, y // 10, place + 1
    return "; ".join(steps)


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """n-digit arithmetic: operands have exactly `digits` digits (0-9 for digits=1).

    Attributes:
      digits: difficulty knob, 1..18.
      ops: operators drawn uniformly from "+", "-", "*", "/" ("/" is exact division:
        the dividend is the product of the divisor and a `digits`-digit quotient).
      style: "plain" (`"12+34="` -> `"46"`), "reversed" (`"12+34="` -> `"64"`, digits
        least-significant first) or "word" (word problem, `#### 46`).
      nonnegative: for "-", order the operands so the answer is >= 0.
    """

    digits: int = 3
    ops: tuple[str, ...] = ("+",)
    style: str = "plain"
    nonnegative: bool = True

    def __post_init__(self):
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 18:
            raise ValueError(f"ArithmeticTask.digits must be an int in 1..18, got {self.digits!r}")
        ops = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
        if not ops or any(o not in OPS for o in ops):
            raise ValueError(f"ArithmeticTask.ops must be a non-empty subset of {OPS}, "
                             f"got {self.ops!r}")
        object.__setattr__(self, "ops", ops)
        if self.style not in _STYLES:
            raise ValueError(f"ArithmeticTask.style must be one of {_STYLES}, got {self.style!r}")

    def _operand(self, rng: np.random.Generator) -> int:
        lo = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return int(rng.integers(lo, 10 ** self.digits))

    def sample(self, rng: np.random.Generator) -> ArithmeticProblem:
        """One problem drawn with `rng` (a `numpy.random.Generator`)."""
        op = self.ops[int(rng.integers(len(self.ops)))]
        a, b = self._operand(rng), self._operand(rng)
        if op == "-" and self.nonnegative and a < b:
            a, b = b, a
        if op == "/":
            b = max(b, 1)
            a = a * b
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // max(b, 1)}[op]
        return self._render(a, b, op, str(value), rng)

    def _render(self, a, b, op, ans, rng) -> ArithmeticProblem:
        if self.style != "word":
            sol = ans if self.style == "plain" else reverse_digits(ans)
            return ArithmeticProblem(f"{a}{op}{b}=", ans, sol, a, b, op)
        name = _NAMES[int(rng.integers(len(_NAMES)))]
        prompt = _WORD[op].format(name=name, a=a, b=b)
        work = f"{a} {_VERB[op]} {b} is {ans}."
        if op == "+":
            work = f"Add column by column ({_column_addition(a, b)}). " + work
        return ArithmeticProblem(prompt, ans, f"{work}\n#### {ans}", a, b, op)

    def generate(self, n: int, seed: int) -> list[ArithmeticProblem]:
        """`n` problems, deterministic for `seed`."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"ArithmeticTask.generate: n must be an int >= 0, got {n!r}")
        rng = np.random.default_rng(seed)
        return [self.sample(rng) for _ in range(n)]


def reverse_digits(number: str) -> str:
    """`"579"` -> `"975"`, `"-12"` -> `"-21"`: the digits reversed, a leading sign kept."""
    sign = number[:1] if number[:1] in ("-", "+") else ""
    return sign + number[len(sign):][::-1]
