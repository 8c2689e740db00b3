"""A calculator tool: exact arithmetic on untrusted expressions, without `eval`.

`calculate` parses with `ast` (mode "eval") and walks the tree itself, allowing only
numeric literals (int, float; not bool or complex), `+ - * / // % **` and unary `+ -`.
Every value is an exact `fractions.Fraction`; names, calls, attributes, subscripts,
comparisons and everything else are refused. Work is bounded: the expression is at most
`MAX_EXPRESSION_CHARS` long, exponents are integers of at most `MAX_EXPONENT` in size,
and every intermediate value's numerator and denominator stay under `MAX_BITS` bits
(checked before a power is computed, so `9**9**9` is refused at once).
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from fractions import Fraction
from typing import Any, Mapping

__all__ = ["CalculatorError", "calculate", "Calculator", "MAX_EXPRESSION_CHARS",
           "MAX_EXPONENT", "MAX_BITS"]

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1_000
MAX_BITS = 4_096

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator allows, or its value is out of bounds."""


def _bounded(v: Fraction) -> Fraction:
    if v.numerator.bit_length() > MAX_BITS or v.denominator.bit_length() > MAX_BITS:
        raise CalculatorError(f"a value is larger than {MAX_BITS} bits")
    return v


def _power(base: Fraction, exp: Fraction) -> Fraction:
    if exp.denominator != 1:
        raise CalculatorError("exponents must be integers")
    e = exp.numerator
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"exponents must be at most {MAX_EXPONENT} in size, got {e}")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if bits > 1 and (bits - 1) * abs(e) > MAX_BITS:
        raise CalculatorError(f"the power would be larger than {MAX_BITS} bits")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    return base ** e


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {v!r}"[:120])
        if isinstance(v, float) and v != v or v in (float("inf"), float("-inf")):
            raise CalculatorError("only finite numbers are allowed")
        return _bounded(Fraction(repr(v)) if isinstance(v, float) else Fraction(v))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        if type(node.op) not in _BINARY:
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed; "
                                  "allowed: + - * / // % **")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalculatorError(f"{type(node).__name__} is not allowed; only numbers, "
                          "+ - * / // % ** and parentheses")


def _show(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    try:
        f = float(v)
    except OverflowError:
        f = 0.0
    return format(f, ".15g") if f else f"{v.numerator}/{v.denominator}"


def calculate(expression: object) -> str:
    """The value of an arithmetic expression, as text: an integer exactly (`"56088"`),
    otherwise a decimal to 15 significant digits (`"0.333333333333333"`), or `"a/b"`
    where a float cannot hold it.

    Raises `CalculatorError` for anything else (a non-string, text over
    `MAX_EXPRESSION_CHARS`, a syntax error, a name or call, division by zero, a value
    out of bounds); never evaluates Python.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got a {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is {len(expression)} characters long; at most "
                              f"{MAX_EXPRESSION_CHARS} are allowed")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not an arithmetic expression ({type(e).__name__})") from None
    try:
        return _show(_eval(tree.body))
    except RecursionError:
        raise CalculatorError("the expression nests too deeply") from None


@dataclasses.dataclass(frozen=True)
class Calculator:
    """The calculator as a `rljax.envs.Tool`: arguments `{"expression": "123 * 456"}`,
    result `calculate(expression)`."""

    name: str = "calculator"
    description: str = ("Evaluate an arithmetic expression with + - * / // % ** and "
                        "parentheses; returns the exact value.")
    parameters: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {
        "type": "object",
        "properties": {"expression": {"type": "string",
                                      "description": "e.g. \"123 * 456\""}},
        "required": ["expression"]})

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        if set(arguments) != {"expression"}:
            raise CalculatorError(f"the calculator takes one argument, 'expression'; got "
                                  f"{sorted(map(str, arguments))[:5]}")
        return calculate(arguments["expression"])
