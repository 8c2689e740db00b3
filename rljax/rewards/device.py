"""Verifiers in JAX: rewards computed from token ids inside the compiled RL step.

A host reward needs the completions as text: the step stops, the ids travel to the host,
are detokenised and scored, and the rewards travel back. A *device reward* is a JAX
function of the ids, so sampling, scoring and learning compile into one program (and
``jax.vmap`` over a leading seed axis trains several runs in one program,
``rljax.train.seeds``). It has two parts:

- ``task_arrays(metadata) -> dict[str, np.ndarray]``: per-prompt arrays (leading axis =
  prompts) built on the host from the prompt source's metadata, next to the prompt ids;
- ``__call__(tokens_BxT, mask_BxT, task) -> rewards_B``: float32 rewards of ``B`` rows,
  where ``task`` holds ``task_arrays``' arrays repeated to one row per completion and
  ``mask_BxT`` is the completion mask (1 on sampled tokens, the stop token included).

``verifier = True`` declares that a reward above 0 means a correct answer (the step's
``accuracy`` metric then reads ``rewards_B > 0``).

This module gives the building block of answer checks on character-level text:
:class:`CharTable` maps every token id to the characters it decodes to, as classes
(digit 0-9, whitespace, ``+``, ``-``, other), and :func:`leading_integer_matches` is the
JAX twin of "after leading whitespace, the text starts with exactly this integer".
Both follow Python's ``str.isspace`` / ``str.isdigit`` on the decoded text, so a device
check built on them agrees with the host check on every completion (tested exhaustively
against ``rljax.run.tasks.check_arithmetic``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CharTable", "DeviceReward", "is_device_reward", "leading_integer_matches",
           "SPACE", "PLUS", "MINUS", "OTHER", "SKIP"]

Array = Any

# Character classes: digits are their value 0..9.
SPACE, PLUS, MINUS, OTHER, SKIP = 10, 11, 12, 13, 14


class DeviceReward:
    """Base of device rewards (see the module docstring). Subclasses define
    ``task_arrays`` and ``__call__``; ``verifier``: a reward above 0 means correct."""

    verifier: bool = False
    name: str = "device_reward"

    def task_arrays(self, metadata: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __call__(self, tokens_BxT: Array, mask_BxT: Array, task: Mapping[str, Array]) -> Array:
        raise NotImplementedError


def is_device_reward(fn) -> bool:
    """Whether ``fn`` is a device reward (a :class:`DeviceReward`)."""
    return isinstance(fn, DeviceReward)


def _char_class(c: str) -> int:
    if c.isascii() and c.isdigit():
        return int(c)
    if c.isspace():
        return SPACE
    return {"+": PLUS, "-": MINUS}.get(c, OTHER)


@dataclasses.dataclass(frozen=True)
class CharTable:
    """Each token id's decoded characters as classes: ``rows[i]`` the classes of token
    ``i``'s characters, ``SKIP`` past its end (every row as long as the longest token);
    ``skip_ids`` decode to nothing here (the stop token, which the host's detokenisation
    drops too). A value (tuples): equal tables compare and hash equal, so device rewards
    holding them key JAX's cache by value.

    Valid for tokenizers whose ``decode`` of a sequence is the concatenation of its tokens'
    single decodes (character tokenizers; checked on the whole vocabulary at build)."""

    rows: tuple[tuple[int, ...], ...]

    @property
    def classes_VxL(self) -> np.ndarray:
        """The table as int32 ``[vocab, longest token]``."""
        return np.asarray(self.rows, np.int32)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, skip_ids: Sequence[int] = ()
                       ) -> "CharTable":
        pieces = [tokenizer.decode([i]) for i in range(vocab_size)]
        joined = tokenizer.decode(list(range(vocab_size)) + list(range(vocab_size))[::-1])
        if joined != "".join(pieces + pieces[::-1]):
            raise ValueError("CharTable: this tokenizer's decode of a sequence is not the "
                             "concatenation of its tokens' decodes (a BPE or byte-level "
                             "tokenizer); device answer checks need a character tokenizer")
        for i in skip_ids:
            pieces[int(i)] = ""
        width = max(1, max(len(p) for p in pieces))
        return cls(tuple(tuple(_char_class(c) for c in p) + (SKIP,) * (width - len(p))
                         for p in pieces))

    def padded(self, vocab_size: int) -> "CharTable":
        """The table with ids ``len(rows) .. vocab_size - 1`` decoding to nothing."""
        blank = (SKIP,) * len(self.rows[0])
        return CharTable(self.rows + (blank,) * (vocab_size - len(self.rows)))

    def text_classes(self, tokens_BxT: Array, mask_BxT: Array, max_chars: int) -> Array:
        """``[B, max_chars + 1]`` classes of each row's text (masked tokens dropped), the
        first ``max_chars`` characters then ``OTHER`` (the end of the text)."""
        b = tokens_BxT.shape[0]
        cls_BxTxL = jnp.asarray(self.classes_VxL)[tokens_BxT]
        cls_BxTxL = jnp.where(mask_BxT[..., None] > 0, cls_BxTxL, SKIP)
        cls_BxC = cls_BxTxL.reshape(b, -1)
        # Compact: real characters first, in order (a stable sort on "is padding").
        order_BxC = jnp.argsort(cls_BxC == SKIP, axis=1, stable=True)
        cls_BxC = jnp.take_along_axis(cls_BxC, order_BxC, axis=1)
        width = max_chars + 1
        if cls_BxC.shape[1] < width:
            cls_BxC = jnp.pad(cls_BxC, ((0, 0), (0, width - cls_BxC.shape[1])),
                              constant_values=SKIP)
        cls_BxC = cls_BxC[:, :width].at[:, max_chars].set(SKIP)
        return jnp.where(cls_BxC == SKIP, OTHER, cls_BxC)


def leading_integer_matches(text_BxC: Array, digits_BxA: Array, num_digits_B: Array,
                            negative_B: Array) -> Array:
    """bool[B]: after leading whitespace the text is an optional sign and exactly the
    digits ``digits_BxA[:num_digits_B]``, ended by a non-digit; a ``-`` sign exactly when
    ``negative_B`` (``+`` is allowed on non-negative answers).

    ``text_BxC``: :meth:`CharTable.text_classes` (its last column is always ``OTHER``).
    """
    b, c = text_BxC.shape
    a = digits_BxA.shape[1]
    first_B = jnp.argmax(text_BxC != SPACE, axis=1)  # exists: the last column is OTHER
    lead_B = jnp.take_along_axis(text_BxC, first_B[:, None], axis=1)[:, 0]
    start_B = first_B + ((lead_B == PLUS) | (lead_B == MINUS))
    idx_BxA1 = jnp.minimum(start_B[:, None] + jnp.arange(a + 1)[None], c - 1)
    window_BxA1 = jnp.take_along_axis(text_BxC, idx_BxA1, axis=1)
    cols_A = jnp.arange(a)[None]
    want_BxA = cols_A < num_digits_B[:, None]
    same_B = jnp.all(jnp.where(want_BxA, window_BxA1[:, :a] == digits_BxA, True), axis=1)
    after_B = jnp.take_along_axis(window_BxA1, num_digits_B[:, None], axis=1)[:, 0]
    sign_ok_B = jnp.where(negative_B, lead_B == MINUS, lead_B != MINUS)
    return same_B & (after_B >= 10) & (num_digits_B >= 1) & sign_ok_B
