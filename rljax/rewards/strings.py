"""Exact-string answers: `string_equal(prediction, reference)` and `answer_verifier`, which
picks the verifier a task's reference answers need ("math" or "string").

`string_equal` compares after normalising both sides: Unicode compatibility forms (NFKC),
case (`casefold`), whitespace (runs become one space; ends dropped) and punctuation around
words (`"Paris."`, `"(B)"`, `'"abcd"'` equal `Paris`, `B`, `abcd`). Punctuation inside a
word counts: `3.5` != `35`, `a-b` != `ab`, `U.S.A` != `USA`. Bounded like `math_equal`:
`None`, non-strings and predictions longer than `limits.MAX_EXPR_CHARS` give False.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from numbers import Rational

from rljax.rewards.answers import is_number
from rljax.rewards.limits import MAX_EXPR_CHARS

__all__ = ["VERIFIERS", "answer_verifier", "normalize_text", "string_equal"]

#: The answer verifiers a task may use: `math_equal` or `string_equal`.
VERIFIERS = ("math", "string")


def _is_punctuation(c: str) -> bool:
    return unicodedata.category(c).startswith("P")


def _strip_punctuation(word: str) -> str:
    i, j = 0, len(word)
    while i < j and _is_punctuation(word[i]):
        i += 1
    while j > i and _is_punctuation(word[j - 1]):
        j -= 1
    return word[i:j]


def normalize_text(s: str) -> str:
    """`s` in `string_equal`'s canonical form (see the module docstring)."""
    words = unicodedata.normalize("NFKC", s).casefold().split()
    return " ".join(w for w in map(_strip_punctuation, words) if w)


def string_equal(prediction: object, reference: object) -> bool:
    """Whether `prediction` and `reference` are the same text up to case, whitespace and
    punctuation around words (the module docstring). `prediction` is untrusted model
    output (never raises); `reference` is a str or a number (TypeError otherwise)."""
    if isinstance(reference, bool) or not isinstance(reference, (str, int, Rational, float)):
        raise TypeError(f"string_equal: reference must be a str (or a number), got "
                        f"{type(reference).__name__}")
    if not isinstance(prediction, str) or len(prediction) > MAX_EXPR_CHARS:
        return False
    ref = normalize_text(str(reference))
    return bool(ref) and normalize_text(prediction) == ref


def answer_verifier(references: Iterable[object]) -> str:
    """"math" when any reference answer reads as a number (`math_equal` also compares the
    others, as normalised LaTeX), else "string" (words, letters, names)."""
    return "math" if any(is_number(r) for r in references) else "string"
