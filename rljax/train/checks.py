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


def check_algorithm_sampling(algorithm, sampling) -> None:
    """Reject ``AlgorithmConfig`` settings that the ``SamplingConfig`` makes wrong.

    The sampler reports each token's log-prob under the distribution it drew from: with
    top-k / top-p that is the filtered, renormalised softmax, while the trainer's log-probs
    are of the full softmax. So

    - ``old_logp="sampler"`` would put the filtered probability in the ratio's denominator:
      at theta = theta_old the ratio equals the kept probability mass (< 1), not 1, and the
      clip acts from the first update;
    - ``tis_cap`` would weight each token by pi / pi_filtered = the kept mass, a shrinking
      of the gradient rather than a correction of the sampler/trainer numerical gap.

    Both are rejected; ``old_logp="auto"`` / ``"recompute"`` (full softmax on both sides)
    work with any filter. Also checks the overlong window against ``max_new_tokens``.

    Raises:
      ValueError: naming the fields, their values and what is allowed.
    """
    a = algorithm
    if sampling.filters:
        why = (f"with SamplingConfig.top_k={sampling.top_k}, top_p={sampling.top_p} the "
               "sampler's log-probs are of the filtered, renormalised distribution while "
               "the trainer's are of the full softmax")
        if a.old_logp == "sampler":
            raise ValueError(
                f"AlgorithmConfig.old_logp='sampler' is invalid {why}: at theta = theta_old "
                "the ratio would equal the kept probability mass, not 1. Allowed: "
                "old_logp='auto' or 'recompute', or top_k=0 and top_p=1.0")
        if math.isfinite(a.tis_cap):
            raise ValueError(
                f"AlgorithmConfig.tis_cap={a.tis_cap} is invalid {why}: every importance "
                "weight would be the kept probability mass, not a correction near 1. "
                "Allowed: tis_cap=inf, or top_k=0 and top_p=1.0")
    a.overlong_tokens(sampling.max_new_tokens)
