"""Field checks shared by the config dataclasses: each error names the class, the field,
the bad value and what is allowed."""

from __future__ import annotations

import math


def fail(cls: str, field: str, value, allowed: str):
    raise ValueError(f"{cls}.{field}={value!r} is invalid; allowed: {allowed}")


def check_choice(cls, field, value, choices):
    if value not in choices:
        fail(cls, field, value, "one of " + ", ".join(repr(c) for c in choices))


def check_bool(cls, field, value):
    if not isinstance(value, bool):
        fail(cls, field, value, "True or False")


def check_num(cls, field, value, *, lo=None, hi=None, lo_open=False, hi_open=False,
              integer=False, finite=True):
    """A number in [lo, hi] (open ends where asked); NaN never, inf only with finite=False."""
    kind = "an int" if integer else ("a finite number" if finite else "a number")
    if lo is not None and hi is not None:
        allowed = f"{kind} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    elif lo is not None:
        allowed = f"{kind} {'>' if lo_open else '>='} {lo}"
    else:
        allowed = kind
    if not finite and hi is None:
        allowed += " (inf allowed)"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        fail(cls, field, value, allowed)
    bad = math.isnan(value) or (finite and math.isinf(value))
    if bad or (lo is not None and (value <= lo if lo_open else value < lo)):
        fail(cls, field, value, allowed)
    if hi is not None and (value >= hi if hi_open else value > hi):
        fail(cls, field, value, allowed)


def check_import_path(cls, field, value):
    if value is None:
        return
    if not isinstance(value, str) or value.count(":") != 1 or not all(value.split(":")):
        fail(cls, field, value, "None or an import path 'package.module:function'")
