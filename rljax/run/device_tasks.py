"""`ArithmeticDeviceReward`: the arithmetic task's verifier (`rljax.run.tasks.
check_arithmetic`, plain and reversed styles) as a JAX function of token ids
(`rljax.rewards.device`), for the one-program RL step. Apart from `rljax.run.tasks` so that
the host verifiers a reward worker unpickles import no JAX."""

from __future__ import annotations

import dataclasses

import numpy as np

from rljax.rewards.device import CharTable, DeviceReward, leading_integer_matches

__all__ = ["ArithmeticDeviceReward"]


@dataclasses.dataclass(frozen=True)
class ArithmeticDeviceReward(DeviceReward):
    """`ArithmeticReward` as a device reward: `scale` where `check_arithmetic(text,
    answer, style)` holds, else 0, computed from token ids in JAX.

    A frozen value: rewards built alike compare and hash equal, so trainers with equal
    rewards share their compiled programs (`rljax.train.programs`). Build one from a
    tokenizer with `from_tokenizer`.

    Fields:
      table: each token id's characters (`rljax.rewards.device.CharTable`), one row per id
        of the model's vocabulary.
      style: "plain" or "reversed" ("word" answers need the host's extraction).
      scale: the reward of a correct answer.
      max_digits: the widest answer in digits (answers are padded to it).
      max_chars: the completion characters read (the answer must start within them).
    """

    table: CharTable
    style: str = "plain"
    scale: float = 1.0
    max_digits: int = 40
    max_chars: int = 64

    verifier = True
    name = "arithmetic"

    def __post_init__(self):
        if self.style not in ("plain", "reversed"):
            raise ValueError(f"ArithmeticDeviceReward: style must be 'plain' or 'reversed', got "
                             f"{self.style!r} (word problems are checked on the host)")

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_id: int, **settings,
                       ) -> ArithmeticDeviceReward:
        """The reward for `tokenizer` (a character tokenizer: `CharTable` checks it), a
        model of `vocab_size` ids (ids past the tokenizer's decode as nothing) and the stop
        token `stop_id` (dropped from the text as the host's detokenisation does);
        `settings`: the other fields."""
        n = min(vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else vocab_size
        table = CharTable.from_tokenizer(tokenizer, n, skip_ids=(stop_id,))
        return cls(table.padded(vocab_size), **settings)

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

    def __call__(self, tokens_BxT, mask_BxT, task):
        text_BxC = self.table.text_classes(tokens_BxT, mask_BxT, self.max_chars)
        ok_B = leading_integer_matches(text_BxC, task["digits"], task["num_digits"],
                                       task["negative"])
        return ok_B.astype("float32") * self.scale
