"""Verifiable instruction constraints in the spirit of IFEval (Zhou et al., 2023).

Each constraint is a small frozen dataclass with `check(text) -> bool` and a
`description` (the instruction a prompt would state). They compose with `AllOf` /
`AnyOf`, and `constraint_from_dict` builds one from a JSON-able spec such as
`{"type": "word_count", "min_words": 50}` so prompt files can carry their constraints.

Checks are linear and bounded: text longer than `MAX_CONSTRAINT_CHARS` fails every
constraint; JSON is size- and depth-checked before `json.loads` (a parser, not eval).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Protocol, runtime_checkable

from rljax.rewards.limits import (MAX_CONSTRAINT_CHARS, MAX_JSON_CHARS, MAX_JSON_DEPTH,
                                  json_depth_ok)


@runtime_checkable
class Constraint(Protocol):
    """Anything with `check(text) -> bool` and a `description` string."""

    description: str

    def check(self, text: str) -> bool:
        """True if `text` satisfies the constraint; False (never an exception) otherwise."""
        ...


def _bounded(text: object) -> str | None:
    return text if isinstance(text, str) and len(text) <= MAX_CONSTRAINT_CHARS else None


def _has_word(text: str, kw: str) -> bool:
    """Case-insensitive whole-word (or whole-phrase) match; the pattern is escaped, linear."""
    return re.search(r"(?<!\w)" + re.escape(kw) + r"(?!\w)", text, re.IGNORECASE) is not None


@dataclasses.dataclass(frozen=True)
class WordCount:
    """Between `min_words` and `max_words` whitespace-separated words (either may be None)."""

    min_words: int | None = None
    max_words: int | None = None

    def __post_init__(self):
        for f in ("min_words", "max_words"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"WordCount.{f} must be a non-negative int or None, got {v!r}")
        if self.min_words is None and self.max_words is None:
            raise ValueError("WordCount needs min_words or max_words")
        if self.max_words is not None and (self.min_words or 0) > self.max_words:
            raise ValueError(f"WordCount.min_words={self.min_words} > max_words={self.max_words}")

    @property
    def description(self) -> str:
        lo, hi = self.min_words, self.max_words
        if lo is not None and hi is not None:
            return f"Answer with between {lo} and {hi} words."
        return f"Answer with at least {lo} words." if hi is None else \
            f"Answer with at most {hi} words."

    def check(self, text: str) -> bool:
        t = _bounded(text)
        if t is None:
            return False
        n = len(t.split())
        return (self.min_words is None or n >= self.min_words) and \
            (self.max_words is None or n <= self.max_words)


@dataclasses.dataclass(frozen=True)
class _Keywords:
    keywords: tuple[str, ...]

    def __post_init__(self):
        name, kws = type(self).__name__, self.keywords
        if isinstance(kws, str) or not all(isinstance(k, str) and k.strip() for k in kws):
            raise ValueError(f"{name}.keywords must be a sequence of non-empty strings, "
                             f"got {kws!r}")
        if not kws:
            raise ValueError(f"{name}.keywords must not be empty")
        object.__setattr__(self, "keywords", tuple(kws))


@dataclasses.dataclass(frozen=True)
class IncludeKeywords(_Keywords):
    """Every keyword appears as a whole word or phrase (case-insensitive)."""

    @property
    def description(self) -> str:
        return "Include the keywords " + ", ".join(repr(k) for k in self.keywords) + "."

    def check(self, text: str) -> bool:
        t = _bounded(text)
        return t is not None and all(_has_word(t, k) for k in self.keywords)


@dataclasses.dataclass(frozen=True)
class ForbiddenKeywords(_Keywords):
    """No keyword appears as a whole word or phrase (case-insensitive)."""

    @property
    def description(self) -> str:
        return "Do not use the words " + ", ".join(repr(k) for k in self.keywords) + "."

    def check(self, text: str) -> bool:
        t = _bounded(text)
        return t is not None and not any(_has_word(t, k) for k in self.keywords)


@dataclasses.dataclass(frozen=True)
class NoCommas:
    """The response contains no comma (ASCII or full-width)."""

    description: str = "Do not use any commas in your response."

    def check(self, text: str) -> bool:
        t = _bounded(text)
        return t is not None and "," not in t and "\uff0c" not in t


@dataclasses.dataclass(frozen=True)
class AllLowercase:
    """The response has letters and none of them is upper case."""

    description: str = "Your entire response must be in lowercase letters."

    def check(self, text: str) -> bool:
        t = _bounded(text)
        return t is not None and t == t.lower() and any(c.isalpha() for c in t)


_BULLETS = ("* ", "- ", "\u2022 ")


@dataclasses.dataclass(frozen=True)
class BulletCount:
    """Exactly `count` Markdown bullet lines (`* `, `- ` or `• ` after indentation)."""

    count: int

    def __post_init__(self):
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 0:
            raise ValueError(f"BulletCount.count must be a non-negative int, got {self.count!r}")

    @property
    def description(self) -> str:
        return f"Your answer must contain exactly {self.count} bullet points."

    def check(self, text: str) -> bool:
        t = _bounded(text)
        return t is not None and sum(
            line.lstrip().startswith(_BULLETS) for line in t.splitlines()) == self.count


@dataclasses.dataclass(frozen=True)
class EndsWith:
    """The response ends with `phrase` (trailing whitespace ignored), nothing after it."""

    phrase: str

    def __post_init__(self):
        if not isinstance(self.phrase, str) or not self.phrase.strip():
            raise ValueError(f"EndsWith.phrase must be a non-empty string, got {self.phrase!r}")

    @property
    def description(self) -> str:
        return f"Finish your response with this exact phrase: {self.phrase!r}."

    def check(self, text: str) -> bool:
        t = _bounded(text)
        return t is not None and t.rstrip().endswith(self.phrase.strip())


def _strip_fence(s: str) -> str:
    s = s.strip()
    if s.startswith("```") and s.endswith("```") and len(s) >= 6:
        s = s[3:-3]
        nl = s.find("\n")
        head = s[:nl] if nl >= 0 else ""
        if head.strip().lower() in ("json", ""):
            s = s[nl + 1:] if nl >= 0 else s
    return s.strip()


@dataclasses.dataclass(frozen=True)
class ValidJson:
    """The whole response (optionally inside a ``` fence) parses as JSON, within bounds."""

    max_chars: int = MAX_JSON_CHARS
    max_depth: int = MAX_JSON_DEPTH
    description: str = "Your entire output should be wrapped in JSON format."

    def __post_init__(self):
        for f in ("max_chars", "max_depth"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ValidJson.{f} must be a positive int, got {v!r}")

    def check(self, text: str) -> bool:
        """True if `text` (fences stripped) is JSON within the size and depth bounds."""
        if not isinstance(text, str) or len(text) > self.max_chars:
            return False
        s = _strip_fence(text)
        if not s or not json_depth_ok(s, self.max_depth):
            return False
        try:
            json.loads(s)
        except (ValueError, RecursionError):
            return False
        return True


@dataclasses.dataclass(frozen=True)
class _Group:
    constraints: tuple[Any, ...]

    def __post_init__(self):
        name, cs = type(self).__name__, self.constraints
        if isinstance(cs, (str, bytes)) or not cs:
            raise ValueError(f"{name}.constraints must be a non-empty sequence of constraints")
        for c in cs:
            if not isinstance(c, Constraint):
                raise TypeError(f"{name}.constraints: {c!r} has no check(text) and description")
        object.__setattr__(self, "constraints", tuple(self.constraints))


@dataclasses.dataclass(frozen=True)
class AllOf(_Group):
    """Every constraint holds."""

    @property
    def description(self) -> str:
        return " ".join(c.description for c in self.constraints)

    def check(self, text: str) -> bool:
        """True if every member constraint holds."""
        return all(c.check(text) for c in self.constraints)


@dataclasses.dataclass(frozen=True)
class AnyOf(_Group):
    """At least one constraint holds."""

    @property
    def description(self) -> str:
        return "Do one of: " + " / ".join(c.description for c in self.constraints)

    def check(self, text: str) -> bool:
        """True if at least one member constraint holds."""
        return any(c.check(text) for c in self.constraints)


CONSTRAINT_TYPES = {
    "word_count": WordCount, "include_keywords": IncludeKeywords,
    "forbidden_keywords": ForbiddenKeywords, "no_commas": NoCommas,
    "all_lowercase": AllLowercase, "bullet_count": BulletCount, "ends_with": EndsWith,
    "valid_json": ValidJson,
}


def constraint_from_dict(spec: Mapping[str, Any]) -> Constraint:
    """Build a constraint from `{"type": name, **fields}`; `all_of`/`any_of` take a
    `constraints` list of specs. Unknown types or fields raise ValueError naming them."""
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ValueError(f"constraint spec must be a mapping with a 'type' key, got {spec!r}")
    kind = spec["type"]
    fields = {k: v for k, v in spec.items() if k != "type"}
    if kind in ("all_of", "any_of"):
        members = tuple(constraint_from_dict(s) for s in fields.get("constraints", ()))
        return (AllOf if kind == "all_of" else AnyOf)(members)
    if kind not in CONSTRAINT_TYPES:
        raise ValueError(f"unknown constraint type {kind!r}; allowed: "
                         f"{sorted(CONSTRAINT_TYPES) + ['all_of', 'any_of']}")
    cls = CONSTRAINT_TYPES[kind]
    allowed = {f.name for f in dataclasses.fields(cls)} - {"description"}
    bad = set(fields) - allowed
    if bad:
        raise ValueError(f"constraint {kind!r}: unknown fields {sorted(bad)}; "
                         f"allowed: {sorted(allowed)}")
    if "keywords" in fields and isinstance(fields["keywords"], list):
        fields["keywords"] = tuple(fields["keywords"])
    return cls(**fields)
