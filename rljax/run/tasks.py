"""The procedural tasks' verifiers: each task of `rljax.data` composed with `rljax.rewards`.

`rljax.data` generates problems and `rljax.rewards` extracts and compares answers; neither
imports the other. A task's reward is composed here, where the run builds the task
(`rljax.run.builders.build_reward`):
- `check_arithmetic(completion, answer, style)` and `ArithmeticReward`: arithmetic problems
  (`rljax.data.ArithmeticTask`), plain, reversed-digit or word style;
- `CountdownReward`: Countdown equations (`rljax.data.check_countdown`) inside answer tags,
  with TinyZero's format score.
Item rewards are `(completion, metadata) -> float`, for `rljax.rewards.score_batch`.
`ArithmeticDeviceReward` is `check_arithmetic` (plain and reversed styles) as a JAX
function of token ids (`rljax.rewards.device`), for the one-program RL step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from rljax.data import check_countdown, reverse_digits
from rljax.rewards import TagFormat, extract_answer, follows_format, math_equal, tagged_answer
from rljax.rewards.device import SKIP, CharTable, DeviceReward, leading_integer_matches

__all__ = ["ArithmeticDeviceReward", "ArithmeticReward", "CountdownReward", "check_arithmetic"]


def check_arithmetic(completion: object, answer: str, *, style: str = "plain") -> bool:
    """Whether `completion` answers correctly.

    plain: the completion, after leading whitespace, starts with the exact integer (an
    optional sign and digits, ended by anything that is not a digit), e.g. `"579\\n..."`.
    reversed: as plain, but the integer's digits are written least-significant first
    (`"975"` answers `"579"`; leading zeros of the reversed form must be written out, so
    `"003"` answers `"300"` and `"03"` does not).
    word: `extract_answer` (boxed, `####`, "the answer is") then `math_equal`.
    """
    if not isinstance(completion, str):
        return False
    if style == "word":
        return math_equal(extract_answer(completion), answer)
    s = completion[:64].lstrip()
    j = 1 if s[:1] in ("-", "+") else 0
    while j < len(s) and s[j].isascii() and s[j].isdigit():
        j += 1
    token = s[:j]
    if style == "reversed":
        token = reverse_digits(token)
    return token.lstrip("+") == answer and any(c.isdigit() for c in token)




@dataclasses.dataclass(frozen=True)
class ArithmeticReward:
    """Item reward: 1.0 if `check_arithmetic(completion, meta["answer"], style)`."""

    style: str = "plain"
    name: str = "arithmetic"

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        if "answer" not in meta:
            raise KeyError(f"{self.name}: metadata has no 'answer' field (has {sorted(meta)})")
        return 1.0 if check_arithmetic(completion, str(meta["answer"]), style=self.style) else 0.0


class ArithmeticDeviceReward(DeviceReward):
    """`ArithmeticReward` as a device reward: `scale` where `check_arithmetic(text,
    answer, style)` holds, else 0, computed from token ids in JAX.

    Args:
      tokenizer: a character tokenizer (`rljax.rewards.device.CharTable` checks it).
      vocab_size: the model's vocabulary (ids past the tokenizer's decode as nothing).
      stop_id: the stop token, dropped from the text as the host's detokenisation does.
      style: "plain" or "reversed" ("word" answers need the host's extraction).
      max_digits: the widest answer in digits (answers are padded to it).
    """

    verifier = True
    name = "arithmetic"

    def __init__(self, tokenizer, vocab_size: int, stop_id: int, *, style: str = "plain",
                 scale: float = 1.0, max_digits: int = 40, max_chars: int = 64):
        if style not in ("plain", "reversed"):
            raise ValueError(f"ArithmeticDeviceReward: style must be 'plain' or 'reversed', got "
                             f"{style!r} (word problems are checked on the host)")
        self.style, self.scale, self.max_digits, self.max_chars = style, scale, max_digits, max_chars
        n = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
        table = CharTable.from_tokenizer(tokenizer, n, skip_ids=(stop_id,))
        if n < vocab_size:  # ids the tokenizer does not know decode to nothing
            pad = np.full((vocab_size - n, table.classes_VxL.shape[1]), SKIP, np.int32)
            table = CharTable(np.concatenate([table.classes_VxL, pad]))
        self.table = table

    def task_arrays(self, metadata) -> dict[str, np.ndarray]:
        """`digits` int32 [n, max_digits] (written order: reversed for "reversed"),
        `num_digits` int32 [n], `negative` bool [n], from each record's "answer"."""
        n = len(metadata)
        digits = np.zeros((n, self.max_digits), np.int32)
        num, neg = np.zeros(n, np.int32), np.zeros(n, bool)
        for i, m in enumerate(metadata):
            if "answer" not in m:
                raise KeyError(f"{self.name}: metadata {i} has no 'answer' field (has {sorted(m)})")
            ans = str(m["answer"])
            neg[i], body = ans.startswith("-"), ans.lstrip("-")
            if not body.isdigit() or not body.isascii() or len(body) > self.max_digits:
                raise ValueError(f"{self.name}: answer {ans!r} of metadata {i} is not an integer "
                                 f"of at most max_digits={self.max_digits} digits")
            if self.style == "reversed":
                body = body[::-1]
            digits[i, :len(body)] = [int(c) for c in body]
            num[i] = len(body)
        return {"digits": digits, "num_digits": num, "negative": neg}

    def _identity(self) -> tuple:
        t = self.table.classes_VxL
        return self.style, self.scale, self.max_digits, self.max_chars, t.shape, t.tobytes()

    def __eq__(self, other) -> bool:
        """Equal when built alike (same table and settings): trainers with equal rewards
        share their compiled programs (`rljax.train.programs`)."""
        return type(other) is type(self) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __call__(self, tokens_BxT, mask_BxT, task):
        text_BxC = self.table.text_classes(tokens_BxT, mask_BxT, self.max_chars)
        ok_B = leading_integer_matches(text_BxC, task["digits"], task["num_digits"],
                                       task["negative"])
        return ok_B.astype("float32") * self.scale


@dataclasses.dataclass(frozen=True)
class CountdownReward:
    """Item reward, TinyZero style: `correct` if the tagged equation reaches
    `meta["target"]` with `meta["numbers"]`, else `format_score` if the completion
    follows the tag format, else 0."""

    fmt: TagFormat = TagFormat()
    correct: float = 1.0
    format_score: float = 0.1
    use_all: bool = False
    name: str = "countdown"

    def __call__(self, completion: str, meta: Mapping[str, Any]) -> float:
        for key in ("numbers", "target"):
            if key not in meta:
                raise KeyError(f"{self.name}: metadata has no {key!r} field (has {sorted(meta)})")
        eq = tagged_answer(completion, self.fmt)
        if check_countdown(eq, meta["numbers"], meta["target"], use_all=self.use_all):
            return self.correct
        return self.format_score if follows_format(completion, self.fmt) else 0.0
