"""Countdown (as in TinyZero): reach a target from given numbers with + - * /.

The generator builds a random expression over the numbers with exact, non-negative
integer intermediate results, so every problem is solvable. The checker parses the
proposed equation with a small bounded parser (integers, + - * /, parentheses; no
unary minus, no eval), checks each given number is used at most once (or exactly once
with `use_all=True`), and compares the exact rational value with the target. The item
reward built on it (tag format, TinyZero's format score) is `rljax.run.tasks.CountdownReward`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from fractions import Fraction
from typing import Any

import numpy as np

MAX_EQUATION_CHARS = 256
_MAX_DEPTH = 32
_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_PROMPT = ("Using the numbers {nums}, write an equation that equals {target}. You may use "
           "+, -, * and / and each number at most once. Think inside <think> </think> and "
           "give only the equation inside <answer> </answer>, e.g. <answer> (1 + 2) * 3 "
           "</answer>.")


class _Fail(Exception):
    pass


class _Eq:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := integer | '(' expr ')'. Collects the integer literals it reads."""

    def __init__(self, s: str):
        self.s, self.i, self.depth, self.used = s, 0, 0, []

    def peek(self) -> str:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else ""

    def chain(self, ops: tuple[str, str], operand) -> Fraction:
        x = operand()
        while (op := self.peek()) in ops:
            self.i += 1
            x = _BINARY[op](x, operand())
        return x

    def expr(self) -> Fraction:
        return self.chain(("+", "-"), self.term)

    def term(self) -> Fraction:
        return self.chain(("*", "/"), self.factor)

    def factor(self) -> Fraction:
        c = self.peek()
        if c == "(":
            self.depth += 1
            if self.depth > _MAX_DEPTH:
                raise _Fail("nested too deeply")
            self.i += 1
            x = self.expr()
            if self.peek() != ")":
                raise _Fail("missing )")
            self.i += 1
            self.depth -= 1
            return x
        j = self.i
        while j < len(self.s) and self.s[j].isascii() and self.s[j].isdigit():
            j += 1
        if j == self.i or j - self.i > 9:
            raise _Fail("expected an integer")
        n = int(self.s[self.i:j])
        self.i = j
        self.used.append(n)
        return Fraction(n)


def evaluate_equation(equation: object) -> tuple[Fraction, list[int]] | None:
    """(exact value, integers used) of a Countdown equation, or None if it is not one.

    A trailing `= target` is ignored; `x`/`×` are read as `*` and `÷` as `/`. Bounded:
    at most `MAX_EQUATION_CHARS` characters and nesting depth 32; never raises.
    """
    if not isinstance(equation, str) or len(equation) > MAX_EQUATION_CHARS:
        return None
    s = equation.split("=")[0]
    for a, b in (("\u00d7", "*"), ("x", "*"), ("\u00f7", "/"), ("\u2212", "-"),
                 ("\n", " "), ("\t", " ")):
        s = s.replace(a, b)
    p = _Eq(s)
    try:
        value = p.expr()
        if p.peek():
            return None
    except (_Fail, RecursionError, ZeroDivisionError):
        return None
    return value, p.used


def check_countdown(equation: object, numbers: list[int], target: int, *,
                    use_all: bool = False) -> bool:
    """Whether `equation` uses only `numbers` (each at most once; exactly once if
    `use_all`) and evaluates exactly to `target`."""
    res = evaluate_equation(equation)
    if res is None:
        return False
    value, used = res
    have, want = Counter(used), Counter(int(n) for n in numbers)
    if any(have[k] > want[k] for k in have) or (use_all and have != want):
        return False
    return value == target


@dataclasses.dataclass(frozen=True)
class CountdownTask:
    """Countdown problems. Difficulty knobs: `num_numbers` and `max_number`.

    Attributes:
      num_numbers: how many numbers are given (2..8).
      max_number: numbers are drawn from 1..max_number.
      max_target: targets are in 1..max_target (problems are redrawn until they fit).
      use_count: how many of the numbers the hidden solution uses (default all).
    """

    num_numbers: int = 3
    max_number: int = 99
    max_target: int = 1000
    use_count: int | None = None

    def __post_init__(self):
        if not isinstance(self.num_numbers, int) or not 2 <= self.num_numbers <= 8:
            raise ValueError(f"CountdownTask.num_numbers must be an int in 2..8, "
                             f"got {self.num_numbers!r}")
        for f in ("max_number", "max_target"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 2:
                raise ValueError(f"CountdownTask.{f} must be an int >= 2, got {v!r}")
        u = self.use_count
        if u is not None and (not isinstance(u, int) or not 2 <= u <= self.num_numbers):
            raise ValueError(f"CountdownTask.use_count must be None or an int in "
                             f"2..num_numbers={self.num_numbers}, got {u!r}")

    def _combine(self, x: int, y: int, rng) -> tuple[int, str] | None:
        op = "+-*/"[int(rng.integers(4))]
        x, y = max(x, y), min(x, y)
        if op == "-":
            return (x - y, op) if x - y > 0 else None
        if op == "/":
            return (x // y, op) if y > 1 and x % y == 0 else None
        return (x + y if op == "+" else x * y), op

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        """One problem: {"prompt", "numbers", "target", "solution"} (solvable)."""
        for _ in range(10_000):
            nums = [int(v) for v in rng.integers(1, self.max_number + 1, self.num_numbers)]
            k = self.use_count or self.num_numbers
            pool = [(n, str(n)) for n in rng.permutation(nums)[:k].tolist()]
            while len(pool) > 1:
                i, j = (int(v) for v in rng.choice(len(pool), 2, replace=False))
                got = self._combine(pool[i][0], pool[j][0], rng)
                if got is None:
                    break
                value, op = got
                a, b = sorted((pool[i], pool[j]), key=lambda t: -t[0]) if op in "-/" \
                    else (pool[i], pool[j])
                pool = [p for t, p in enumerate(pool) if t not in (i, j)]
                pool.append((value, f"({a[1]} {op} {b[1]})"))
            if len(pool) == 1 and 1 <= pool[0][0] <= self.max_target:
                target, sol = pool[0][0], pool[0][1]
                sol = sol[1:-1] if sol.startswith("(") else sol
                return {"prompt": _PROMPT.format(nums=nums, target=target), "numbers": nums,
                        "target": target, "solution": sol}
        raise RuntimeError("CountdownTask: could not draw a problem in 10000 tries; "
                           "raise max_target or lower num_numbers")

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        """`n` problems, deterministic for `seed`."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"CountdownTask.generate: n must be an int >= 0, got {n!r}")
        rng = np.random.default_rng(seed)
        return [self.sample(rng) for _ in range(n)]
