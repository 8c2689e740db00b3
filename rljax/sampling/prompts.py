"""Host-side prompt packing: validation, left padding and length bucketing.

Prompts are left-padded so that every row's last prompt token sits in the same column
(the prefill's last column gives every row's next-token logits) and decode slots are
shared by all rows. The padded length is rounded up to a multiple of ``length_multiple``
so repeated calls with prompts of similar lengths reuse one compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.typing import ArrayLike

__all__ = ["PackedPrompts", "bucket_length", "pack_prompts"]


@dataclasses.dataclass(frozen=True)
class PackedPrompts:
    """Left-padded prompts (numpy, host side).

    tokens_BxP: int32, ``pad_id`` in padding. mask_BxP: bool, True on real tokens.
    positions_BxP: int32, ``cumsum(mask) - 1`` clipped at 0. lengths_B: real lengths.
    """

    tokens_BxP: np.ndarray
    mask_BxP: np.ndarray
    positions_BxP: np.ndarray
    lengths_B: np.ndarray


def bucket_length(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (the compiled prompt length)."""
    return -(-n // multiple) * multiple


def _rows_from_array(prompts, prompt_mask) -> list[np.ndarray]:
    ids = np.asarray(prompts)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"prompts given as an array must be an integer [B, T] array, got "
            f"{ids.dtype}{ids.shape}"
        )
    mask = np.ones(ids.shape, bool) if prompt_mask is None else np.asarray(prompt_mask)
    if mask.shape != ids.shape:
        raise ValueError(
            f"prompt_mask has shape {mask.shape}; it must match prompts {ids.shape}"
        )
    return [row[m] for row, m in zip(ids, mask.astype(bool))]


def _rows_from_lists(prompts) -> list[np.ndarray]:
    rows = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(
                f"prompts[{i}] must be a flat sequence of int token ids, got {a.dtype}{a.shape}"
            )
        rows.append(a.astype(np.int64))
    return rows


def pack_prompts(
    prompts: Sequence[Sequence[int]] | ArrayLike,
    *,
    vocab_size: int,
    length_multiple: int,
    max_prompt_len: int,
    prompt_mask: ArrayLike | None = None,
    pad_id: int = 0,
) -> PackedPrompts:
    """Validate prompts and left-pad them to ``bucket_length(longest, length_multiple)``.

    ``prompts``: a non-empty list of token-id lists, or an int ``[B, T]`` array with an
    optional ``prompt_mask`` (True on real tokens, padding anywhere). The bucketed length
    is capped at ``max_prompt_len`` (the room the cache leaves); a prompt longer than that
    is an error.
    """
    if isinstance(prompts, np.ndarray) or hasattr(prompts, "shape"):
        rows = _rows_from_array(prompts, prompt_mask)
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        if prompt_mask is not None:
            raise ValueError("prompt_mask is only allowed when prompts is a [B, T] array")
        rows = _rows_from_lists(prompts)
    else:
        raise ValueError(
            f"prompts must be a list of token-id lists or an int [B, T] array, got "
            f"{type(prompts).__name__}"
        )
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, r in enumerate(rows):
        if r.size == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        if r.min() < 0 or r.max() >= vocab_size:
            raise ValueError(
                f"prompts[{i}] has token ids outside [0, {vocab_size}) (the model's vocab)"
            )
    longest = max(r.size for r in rows)
    if longest > max_prompt_len:
        raise ValueError(
            f"prompts: the longest prompt has {longest} tokens but the cache leaves room "
            f"for at most {max_prompt_len} (max_len minus max_new_tokens - 1, and the "
            f"model's max_position_embeddings); shorten it or raise max_len"
        )
    p = min(bucket_length(longest, length_multiple), max_prompt_len)
    b = len(rows)
    tokens = np.full((b, p), pad_id, np.int32)
    mask = np.zeros((b, p), bool)
    for i, r in enumerate(rows):
        tokens[i, p - r.size :] = r
        mask[i, p - r.size :] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    lengths = np.array([r.size for r in rows], np.int32)
    return PackedPrompts(tokens, mask, positions, lengths)
