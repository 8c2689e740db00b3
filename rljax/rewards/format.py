"""R1-Zero-style format reward: reasoning and answer between designated tags.

DeepSeek-R1-Zero (DeepSeek-R1, §2.2.2) rewards two rule-based things: an accuracy reward
for a verifiably correct answer and a format reward for putting the reasoning between
`<think>` and `</think>` (and the answer between `<answer>` tags). Tags are configurable.
All checks are `str.find`/`str.count` scans: linear, no regular expressions.
"""

from __future__ import annotations

import dataclasses

from rljax.rewards.limits import MAX_CONSTRAINT_CHARS


@dataclasses.dataclass(frozen=True)
class TagFormat:
    """The expected layout `<think>...</think><answer>...</answer>`.

    Attributes:
      think_open, think_close, answer_open, answer_close: the tags (non-empty strings).
      think_in_prompt: the prompt already ends with `think_open` (TinyZero's template), so
        the completion starts inside the reasoning and must not repeat the opening tag.
      allow_trailing: text allowed after `answer_close` (e.g. an EOS string), default none
        but whitespace.
    """

    think_open: str = "<think>"
    think_close: str = "</think>"
    answer_open: str = "<answer>"
    answer_close: str = "</answer>"
    think_in_prompt: bool = False
    allow_trailing: bool = False

    def __post_init__(self):
        for f in ("think_open", "think_close", "answer_open", "answer_close"):
            v = getattr(self, f)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"TagFormat.{f} must be a non-empty string, got {v!r}")
        tags = [self.think_open, self.think_close, self.answer_open, self.answer_close]
        if len(set(tags)) != 4:
            raise ValueError(f"TagFormat tags must be four distinct strings, got {tags}")


def _count_ok(text: str, fmt: TagFormat) -> bool:
    want_open = 0 if fmt.think_in_prompt else 1
    return (text.count(fmt.think_open) == want_open and text.count(fmt.think_close) == 1
            and text.count(fmt.answer_open) == 1 and text.count(fmt.answer_close) == 1)


def follows_format(text: object, fmt: TagFormat = TagFormat()) -> bool:
    """Whether `text` is exactly `[<think>]reasoning</think> <answer>answer</answer>`.

    Each tag appears exactly once, in order; only whitespace may precede `<think>`,
    separate `</think>` from `<answer>`, and (unless `allow_trailing`) follow
    `</answer>`; the reasoning and the answer are non-empty after stripping.
    """
    if not isinstance(text, str) or len(text) > MAX_CONSTRAINT_CHARS or not _count_ok(text, fmt):
        return False
    pos = 0
    if not fmt.think_in_prompt:
        k = text.find(fmt.think_open)
        if text[:k].strip():
            return False
        pos = k + len(fmt.think_open)
    t_end = text.find(fmt.think_close, pos)
    a_start = text.find(fmt.answer_open, pos)
    a_end = text.find(fmt.answer_close, pos)
    if not (pos <= t_end < a_start < a_end):
        return False
    reasoning = text[pos:t_end]
    between = text[t_end + len(fmt.think_close):a_start]
    answer = text[a_start + len(fmt.answer_open):a_end]
    trailing = text[a_end + len(fmt.answer_close):]
    return bool(reasoning.strip() and answer.strip() and not between.strip()
                and (fmt.allow_trailing or not trailing.strip()))


def tagged_answer(text: object, fmt: TagFormat = TagFormat()) -> str | None:
    """Contents of the last `<answer>...</answer>` in `text` (stripped), or None."""
    if not isinstance(text, str) or len(text) > MAX_CONSTRAINT_CHARS:
        return None
    e = text.rfind(fmt.answer_close)
    if e < 0:
        return None
    s = text.rfind(fmt.answer_open, 0, e)
    if s < 0:
        return None
    ans = text[s + len(fmt.answer_open):e].strip()
    return ans or None


def format_reward(text: object, fmt: TagFormat = TagFormat()) -> float:
    """1.0 if `follows_format(text, fmt)` else 0.0."""
    return 1.0 if follows_format(text, fmt) else 0.0
