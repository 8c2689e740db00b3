"""Math answer equivalence: `math_equal(prediction, reference)`.

Both sides are normalised (`_latex.normalize_answer`) and evaluated to exact rationals by
a bounded parser (`_rational.parse_value`); no `eval`, `exec` or symbolic parsing of model
output happens anywhere. Values are compared exactly (`0.5 == 1/2`, `0.333 != 1/3`).

A percentage matches both readings: `50\\%` equals `50` and `0.5`. A number never equals a
non-number. When both sides are not numbers (`\\text{(B)}`, `x+1`, `(1, 2)`), the
normalised strings are compared case-insensitively, without spaces.

Separators: `,` and whitespace (normal, thin `\\u2009`, no-break `\\u00a0` / `\\u202f`, `\\,`,
`~`) separate thousands only as in `1,234,567` / `1 234 567`: a first group of 1-3 digits,
then groups of exactly 3, before any decimal point, one kind per number. Digits split any
other way (`4 2`, `12 34`, `1234 567`, `1, 234`, `0.123 456`, `1_234`, `1.234.567`) are not
one number.
"""

from __future__ import annotations

from fractions import Fraction
from numbers import Rational

from rljax.rewards._latex import normalize_answer
from rljax.rewards._rational import parse_value
from rljax.rewards.limits import MAX_EXPR_CHARS


def _candidates(s: str, strip_units: bool) -> tuple[str, list[Fraction | float]]:
    """Normalised string and the numeric readings of one side (empty if not a number)."""
    norm = normalize_answer(s, strip_units=strip_units)
    percent = norm.endswith("%")
    body = norm.rstrip("%") if percent else norm
    value = None if "%" in body else parse_value(body)  # one trailing % at most
    if value is None:
        return norm, []
    if percent and isinstance(value, Fraction):
        return norm, [value, value / 100]
    return norm, [value]


def is_number(answer: object) -> bool:
    """Whether a reference answer (a str or a number) reads as a number for `math_equal`:
    `42`, `1,234`, `\\frac{1}{2}`, `50\\%`, `10^3`; not `abcd`, `x+1`, `(1, 2)`, `4 2`."""
    if isinstance(answer, bool):
        return False
    if isinstance(answer, (int, Rational, float)):
        return True
    return (isinstance(answer, str) and len(answer) <= MAX_EXPR_CHARS
            and bool(_candidates(answer, False)[1]))


def _coerce_reference(reference: object) -> str:
    if isinstance(reference, str):
        return reference
    if isinstance(reference, bool) or not isinstance(reference, (int, Rational, float)):
        raise TypeError(
            f"math_equal: reference must be a str (or an int/Fraction/float), "
            f"got {type(reference).__name__}")
    if isinstance(reference, float):
        return repr(reference) if reference == reference else "nan"
    return str(reference)


def math_equal(prediction: object, reference: object, *, strip_units: bool = False) -> bool:
    """Whether `prediction` and `reference` denote the same mathematical answer.

    Handles integers with thousands separators (`1,234`, `1 234`; see above), decimals, fractions `a/b`,
    `\\frac{a}{b}` / `\\dfrac` / `\\tfrac` / `\\frac12`, percentages, signs including the
    Unicode minus, integer powers (`10^{3}`, `2^-1`), `\\infty`, `+ - * /` between them, and
    the wrappers `\\text{}`, `\\boxed{}`, `$`, `\\$`, `\\left`/`\\right` and spaces. Units
    (`5 cm`, `90^\\circ`) are stripped only when `strip_units=True`.

    `prediction` is untrusted model output: `None`, non-strings and anything longer than
    `limits.MAX_EXPR_CHARS` give False; no input makes this raise. `reference` is trusted
    and must be a str or a number (TypeError otherwise).
    """
    ref = _coerce_reference(reference)
    if not isinstance(prediction, str) or len(prediction) > MAX_EXPR_CHARS:
        return False
    if len(ref) > MAX_EXPR_CHARS:
        raise ValueError(
            f"math_equal: reference is {len(ref)} characters; at most {MAX_EXPR_CHARS} allowed")
    p_norm, p_vals = _candidates(prediction, strip_units)
    r_norm, r_vals = _candidates(ref, strip_units)
    if p_vals and r_vals:
        return any(a == b for a in p_vals for b in r_vals)
    if p_vals or r_vals or not p_norm or not r_norm:
        return False  # a number never equals a non-number, whatever their spelling
    # Spaces kept between digits only kept them from reading as one number (`(1, 2)`).
    return p_norm.replace(" ", "").casefold() == r_norm.replace(" ", "").casefold()
