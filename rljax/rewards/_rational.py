"""A small, bounded parser that evaluates a normalised answer to an exact rational.

Grammar (whitespace already removed by `_latex.normalize_answer`, but for a space that keeps
digits apart, `4 2`, which no rule accepts):

    expr   := term (('+' | '-') term)*
    term   := unary (('*' | '/') unary)*
    unary  := ('+' | '-') unary | power
    power  := atom ('^' unary)?            # right-associative
    atom   := number | '(' expr ')' | '{' expr '}' | '\\frac' arg arg
    arg    := '{' expr '}' | one digit     # \\frac12 is 1/2
    number := digits with optional 1,000-style groups (the first of 1-3 digits, not 0...),
              '.digits', and 'e[+-]digits'

Values are `fractions.Fraction`. Nothing is ever evaluated as code. Work is bounded:
literal length (`MAX_DIGITS`), exponents (`MAX_EXPONENT`), the bit length of every
intermediate numerator/denominator (`MAX_BITS`, checked *before* a power is computed),
and recursion depth (`MAX_DEPTH`). Anything outside the grammar or the bounds is
`None` ("not a number"), never an exception.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Callable

from rljax.rewards.limits import MAX_BITS, MAX_DEPTH, MAX_DIGITS, MAX_EXPONENT

INF = float("inf")
_INF_WORDS = {"\\infty": INF, "+\\infty": INF, "-\\infty": -INF, "inf": INF,
              "infinity": INF, "+inf": INF, "-inf": -INF, "-infinity": -INF}


class _Fail(Exception):
    """Input is outside the grammar or the bounds."""


def _check(x: Fraction) -> Fraction:
    if x.numerator.bit_length() > MAX_BITS or x.denominator.bit_length() > MAX_BITS:
        raise _Fail("value too large")
    return x


class _Parser:
    def __init__(self, s: str):
        self.s, self.i, self.depth = s, 0, 0

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def eat(self, c: str) -> None:
        if self.peek() != c:
            raise _Fail(f"expected {c!r}")
        self.i += 1

    def nested(self, parse: Callable[[], Fraction]) -> Fraction:
        """`parse()` one level deeper, refusing more than MAX_DEPTH levels."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Fail("nested too deeply")
        x = parse()
        self.depth -= 1
        return x

    def expr(self) -> Fraction:
        x = self.term()
        while self.peek() in ("+", "-") and self.peek():
            op = self.s[self.i]
            self.i += 1
            y = self.term()
            x = _check(x + y if op == "+" else x - y)
        return x

    def term(self) -> Fraction:
        x = self.unary()
        while self.peek() in ("*", "/") and self.peek():
            op = self.s[self.i]
            self.i += 1
            y = self.unary()
            if op == "/" and y == 0:
                raise _Fail("division by zero")
            x = _check(x * y if op == "*" else x / y)
        return x

    def unary(self) -> Fraction:
        c = self.peek()
        if c in ("+", "-") and c:
            self.i += 1
            x = self.nested(self.unary)
            return -x if c == "-" else x
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.i += 1
        return _pow(base, self.nested(self.unary))

    def atom(self) -> Fraction:
        c = self.peek()
        if c in ("(", "{"):
            self.i += 1
            x = self.nested(self.expr)
            self.eat(")" if c == "(" else "}")
            return x
        if self.s.startswith("\\frac", self.i):
            self.i += 5
            num = self.frac_arg()
            den = self.frac_arg()
            if den == 0:
                raise _Fail("division by zero")
            return _check(num / den)
        return self.number()

    def frac_arg(self) -> Fraction:
        c = self.peek()
        if c == "{":
            return self.atom()
        if c.isdigit() and c.isascii():
            self.i += 1
            return Fraction(int(c))
        raise _Fail("bad \\frac argument")

    def digits(self) -> str:
        j = self.i
        while j < len(self.s) and self.s[j].isascii() and self.s[j].isdigit():
            j += 1
        if j - self.i > MAX_DIGITS:
            raise _Fail("literal too long")
        out, self.i = self.s[self.i:j], j
        return out

    def number(self) -> Fraction:
        whole = self.digits()
        if whole and len(whole) <= 3 and whole[0] != "0":  # thousands groups: 1,234,567
            while (self.peek() == "," and self.s[self.i + 1:self.i + 4].isdigit()
                   and self.s[self.i + 1:self.i + 4].isascii()
                   and not self.s[self.i + 4:self.i + 5].isdigit()):
                whole += self.s[self.i + 1:self.i + 4]
                self.i += 4
                if len(whole) > MAX_DIGITS:
                    raise _Fail("literal too long")
        frac = ""
        if self.peek() == ".":
            self.i += 1
            frac = self.digits()
        if not whole and not frac:
            raise _Fail("expected a number")
        x = Fraction(int(whole or "0") * 10 ** len(frac) + int(frac or "0"),
                     10 ** len(frac))
        if self.peek() in ("e", "E") and self.peek():
            x = _check(x * _pow(Fraction(10), Fraction(self.sci_exponent())))
        return x

    def sci_exponent(self) -> int:
        self.i += 1
        sign = 1
        if self.peek() in ("+", "-") and self.peek():
            sign = -1 if self.s[self.i] == "-" else 1
            self.i += 1
        d = self.digits()
        if not d or len(d) > 6:
            raise _Fail("bad exponent")
        return sign * int(d)


def _pow(base: Fraction, exp: Fraction) -> Fraction:
    """base**exp for an integer exponent, refusing results beyond MAX_BITS up front."""
    if exp.denominator != 1:
        raise _Fail("non-integer exponent")
    e = exp.numerator
    if abs(e) > MAX_EXPONENT:
        raise _Fail("exponent too large")
    if base == 0 and e < 0:
        raise _Fail("division by zero")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if bits * abs(e) > MAX_BITS + 64:
        raise _Fail("value too large")
    return _check(base ** e)


def parse_value(s: str) -> Fraction | float | None:
    """Exact value of a normalised answer, +-inf for infinity, or None if not a number."""
    if not s:
        return None
    if s in _INF_WORDS:
        return _INF_WORDS[s]
    p = _Parser(s)
    try:
        x = p.nested(p.expr)
    except (_Fail, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None
    return x if p.i == len(s) else None
