"""Per-completion reward functions, their composition, and the batch `RewardFn` protocol.

Two shapes of reward function:
- an *item* reward `(completion: str, meta: Mapping) -> float` scores one completion with
  its prompt's metadata (the reference answer, the constraints, the task numbers);
- a *batch* `RewardFn` `(completions, metadata) -> float32[B]` is what the trainer calls.
  `batched(item_fn)` lifts one to the other and `score_batch` runs item rewards with
  per-item error attribution and, in a worker pool, time limits (both in
  `rljax.rewards.batch`, which imports this module and not the other way round).

Item rewards here are frozen dataclasses, so they pickle and can run in worker processes.
Composition follows the papers: `Verified(fn, 10.0, 0.0)` is Tülu 3's RLVR reward (10 if
verified, else 0; Tülu 3 §6), and `accuracy_plus_format` is DeepSeek-R1-Zero's rule-based
accuracy + format reward (DeepSeek-R1 §2.2.2).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from rljax.rewards.answers import math_equal
from rljax.rewards.constraints import Constraint, constraint_from_dict
from rljax.rewards.extract import MODES, extract_answer
from rljax.rewards.format import TagFormat, format_reward, tagged_answer
from rljax.rewards.strings import string_equal

ItemReward = Callable[[str, Mapping[str, Any]], float]


@runtime_checkable
class RewardFn(Protocol):
    """Batch reward: `(completions: list[str], metadata: list[dict]) -> float32[B]`."""

    def __call__(self, completions: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> np.ndarray: ...


@runtime_checkable
class BatchReward(Protocol):
    """A reward that scores the whole batch at once, e.g. the learned Bradley-Terry
    reward model (built in `rljax.train`, since it needs the model layer).

    It sets `is_batch_reward = True` and a `name`; `score_batch` then calls it once, in
    process, with the full lists, and checks that it returns `B` finite numbers (a
    non-finite value raises `RewardError` naming the function and the index).
    """

    is_batch_reward: bool
    name: str

    def __call__(self, completions: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]]) -> np.ndarray: ...


def reward_name(fn: Any) -> str:
    """A readable name for error messages and metrics: `.name`, `__name__` or the class."""
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


def _meta_field(meta: Mapping[str, Any], key: str, who: str) -> Any:
    if not isinstance(meta, Mapping) or key not in meta:
        have = sorted(meta) if isinstance(meta, Mapping) else type(meta).__name__
        raise KeyError(f"{who}: metadata has no {key!r} field (has {have})")
    return meta[key]


class _AnswerCheck:
    """What the answer verifiers share: the mode check, then `equal(answer, reference)`
    on the answer the completion gives (`answer_tags` when set: between them, a
    `\\boxed{}` inside preferred; else `extract_answer(mode)`; with `whole`, a completion
    in which mode "auto" finds no marked answer is the answer itself)."""

    whole = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"{type(self).__name__}.mode={self.mode!r} is not one of {MODES}")

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        ref = _meta_field(meta, self.reference_key, self.name)
        if self.answer_tags is not None:
            inner = tagged_answer(completion, self.answer_tags)
            pred = None if inner is None else extract_answer(inner, mode="boxed") or inner
        else:
            pred = extract_answer(completion, mode=self.mode)
            if pred is None and self.whole and self.mode == "auto":
                pred = completion
        return 1.0 if self.equal(pred, ref) else 0.0


@dataclasses.dataclass(frozen=True)
class MathAccuracy(_AnswerCheck):
    """1.0 if the answer extracted from the completion equals `meta[reference_key]`
    (`math_equal`).

    `answer_tags`: if set, the answer is first taken from between those tags (R1-Zero);
    a `\\boxed{}` inside the tags is then preferred. `mode`: `extract_answer` mode.
    """

    reference_key: str = "answer"
    mode: str = "auto"
    strip_units: bool = False
    answer_tags: TagFormat | None = None
    name: str = "math_accuracy"

    def equal(self, answer: str | None, reference: Any) -> bool:
        """`math_equal` (with this reward's `strip_units`)."""
        return math_equal(answer, reference, strip_units=self.strip_units)


@dataclasses.dataclass(frozen=True)
class StringAccuracy(_AnswerCheck):
    """1.0 if the completion's answer is the text `meta[reference_key]` (`string_equal`:
    case, whitespace and punctuation around words aside).

    The answer is found as `MathAccuracy` finds it (`answer_tags`, `mode`), except that
    with `mode="auto"` a completion with no marked answer (`\\boxed{}`, `####`, "the
    answer is") is the answer as a whole: `abcd` scores against `abcd`.
    """

    reference_key: str = "answer"
    mode: str = "auto"
    answer_tags: TagFormat | None = None
    name: str = "string_accuracy"
    whole = True  # a class attribute, not a field

    def equal(self, answer: str | None, reference: Any) -> bool:
        """`string_equal`."""
        return string_equal(answer, reference)


@dataclasses.dataclass(frozen=True)
class FormatReward:
    """1.0 if the completion follows the R1-Zero tag layout `fmt`, else 0.0."""

    fmt: TagFormat = TagFormat()
    name: str = "format"

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        return format_reward(completion, self.fmt)


@dataclasses.dataclass(frozen=True)
class ConstraintReward:
    """1.0 if every constraint holds. Constraints come from `constraints` (fixed) or, if
    that is empty, from `meta[key]`: constraint objects or dict specs."""

    constraints: tuple[Any, ...] = ()
    key: str = "constraints"
    name: str = "constraints"

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        cs = self.constraints or _meta_field(meta, self.key, self.name)
        built = [c if isinstance(c, Constraint) else constraint_from_dict(c) for c in cs]
        if not built:
            raise ValueError(f"{self.name}: no constraints to check")
        return 1.0 if all(c.check(completion) for c in built) else 0.0


@dataclasses.dataclass(frozen=True)
class WeightedSum:
    """sum_i w_i * f_i(completion, meta) over `terms = ((w, f), ...)`."""

    terms: tuple[tuple[float, Any], ...]
    name: str = "weighted_sum"

    def __post_init__(self):
        if not self.terms:
            raise ValueError("WeightedSum.terms must not be empty")
        for t in self.terms:
            if len(t) != 2 or not callable(t[1]) or not np.isfinite(float(t[0])):
                raise ValueError(f"WeightedSum.terms: each term is (finite weight, callable), "
                                 f"got {t!r}")

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        return float(sum(float(w) * float(f(completion, meta)) for w, f in self.terms))


@dataclasses.dataclass(frozen=True)
class Verified:
    """`correct` if `fn(completion, meta) >= threshold` else `incorrect`.

    `Verified(fn)` with the defaults is Tülu 3's RLVR reward: 10 for a verified answer or
    satisfied constraints, 0 otherwise (Tülu 3, §6, Eq. 7)."""

    fn: Any
    correct: float = 10.0
    incorrect: float = 0.0
    threshold: float = 0.5
    name: str = "verified"

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Verified.fn must be callable, got {type(self.fn).__name__}")

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        return self.correct if float(self.fn(completion, meta)) >= self.threshold \
            else self.incorrect


def accuracy_plus_format(fmt: TagFormat = TagFormat(), *, format_weight: float = 0.1,
                         reference_key: str = "answer",
                         strip_units: bool = False) -> WeightedSum:
    """DeepSeek-R1-Zero's rule-based reward: accuracy of the tagged answer (1/0) plus
    `format_weight` times the format reward (1/0)."""
    acc = MathAccuracy(reference_key=reference_key, answer_tags=fmt, strip_units=strip_units)
    return WeightedSum(((1.0, acc), (float(format_weight), FormatReward(fmt))),
                       name="accuracy_plus_format")
