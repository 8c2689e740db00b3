"""Host-side batching: text -> padded token arrays in the trainer's sequence layout.

Prompts are left-padded to width P, completions right-padded to width T (with EOS
appended when it fits), masks float32 0/1. A completion ends at any of the tokenizer's
stop ids (``stop_ids``: EOS and generation_config.json's ``eos_token_id`` list). Every
training and evaluation batch is a dict ``{"prompt_BxP", "prompt_mask_BxP",
"completion_BxT", "completion_mask_BxT"}``; a multi-turn trace's batch
(``encode_traces``) adds ``loss_mask_BxT``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (HF tokenizers or a plain encode)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def special_ids(tokenizer: Any) -> tuple[int, int]:
    """``(pad_id, eos_id)`` of a tokenizer; pad falls back to EOS. Raises if EOS is missing."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id; the trainer needs one to end completions")
    pad = getattr(tokenizer, "pad_token_id", None)
    return (eos if pad is None else int(pad)), int(eos)


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a completion: EOS first, then generation_config.json's
    ``eos_token_id`` list (``rljax.models.tokenizer.stop_token_ids``). The sampler stops
    at any of them (and flags a completion without one as truncated), the loss mask ends
    at the first, and decoded text leaves them out."""
    from rljax.models.tokenizer import stop_token_ids  # imports transformers: only here

    return stop_token_ids(tokenizer)


def _id_set(ids: int | Sequence[int]) -> np.ndarray:
    return np.asarray([ids] if isinstance(ids, (int, np.integer)) else list(ids), np.int64)


def pad_left(seqs: Sequence[Sequence[int]], width: int, pad_id: int, what: str = "prompt"):
    """Left-pad id lists to ``width``: ``(ids_BxW int32, mask_BxW float32)``."""
    ids = np.full((len(seqs), width), pad_id, np.int32)
    mask = np.zeros((len(seqs), width), np.float32)
    for i, s in enumerate(seqs):
        if len(s) > width:
            raise ValueError(f"{what} {i} has {len(s)} tokens; the limit is {width}")
        if len(s) == 0:
            raise ValueError(f"{what} {i} is empty; prompts need at least one token")
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1.0
    return ids, mask


def pad_right(seqs: Sequence[Sequence[int]], width: int, pad_id: int):
    """Right-pad (truncate) id lists to ``width``: ``(ids_BxW int32, mask_BxW float32)``."""
    ids = np.full((len(seqs), width), pad_id, np.int32)
    mask = np.zeros((len(seqs), width), np.float32)
    for i, s in enumerate(seqs):
        s = list(s)[:width]
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1.0
    return ids, mask


def encode_pairs(tokenizer: Any, prompts: Sequence[str], completions: Sequence[str],
                 prompt_len: int, completion_len: int) -> dict:
    """SFT batch from (prompt, completion) text pairs; EOS ends each completion.

    Completions longer than ``completion_len - 1`` are truncated (and lose their EOS).
    """
    if len(prompts) != len(completions):
        raise ValueError(
            f"encode_pairs: {len(prompts)} prompts but {len(completions)} completions"
        )
    pad, eos = special_ids(tokenizer)
    p_ids, p_mask = pad_left([encode_text(tokenizer, p) for p in prompts], prompt_len, pad)
    c_ids, c_mask = pad_right(
        [encode_text(tokenizer, c) + [eos] for c in completions], completion_len, pad
    )
    return {"prompt_BxP": p_ids, "prompt_mask_BxP": p_mask,
            "completion_BxT": c_ids, "completion_mask_BxT": c_mask}


def encode_traces(tokenizer: Any, prompts: Sequence[str],
                  traces: Sequence[Sequence[tuple[str, bool]]], prompt_len: int,
                  completion_len: int) -> dict:
    """SFT batch from multi-turn traces: each trace a sequence of ``(text, trained)``
    segments (the model's turns trained, a tool's or an environment's output not).

    Each segment is encoded on its own, as a multi-turn rollout appends them (so the ids
    are those a rollout of the same turns holds), and EOS ends the trace. The batch is
    :func:`encode_pairs`' plus ``loss_mask_BxT``: 1 on trained segments and the EOS, 0 on
    the others. Traces longer than ``completion_len`` are truncated (and lose their EOS).
    """
    if len(prompts) != len(traces):
        raise ValueError(f"encode_traces: {len(prompts)} prompts but {len(traces)} traces")
    pad, eos = special_ids(tokenizer)
    ids, trained = [], []
    for i, trace in enumerate(traces):
        row_ids, row_trained = [], []
        for j, seg in enumerate(trace):
            if not (isinstance(seg, tuple) and len(seg) == 2 and isinstance(seg[0], str)):
                raise ValueError(f"encode_traces: trace {i} segment {j} is {seg!r}; a "
                                 "segment is a (text, trained) pair")
            seg_ids = encode_text(tokenizer, seg[0])
            row_ids += seg_ids
            row_trained += [float(bool(seg[1]))] * len(seg_ids)
        ids.append(row_ids + [eos])
        trained.append(row_trained + [1.0])
    p_ids, p_mask = pad_left([encode_text(tokenizer, p) for p in prompts], prompt_len, pad)
    c_ids, c_mask = pad_right(ids, completion_len, pad)
    loss = pad_right(trained, completion_len, 0)[0].astype(np.float32)  # 0/1 flags, as ids
    return {"prompt_BxP": p_ids, "prompt_mask_BxP": p_mask, "completion_BxT": c_ids,
            "completion_mask_BxT": c_mask, "loss_mask_BxT": loss}


def encode_prompts(tokenizer: Any, prompts: Sequence[str], prompt_len: int):
    """Left-padded prompt ids and mask ``(ids_BxP, mask_BxP)``."""
    pad, _ = special_ids(tokenizer)
    return pad_left([encode_text(tokenizer, p) for p in prompts], prompt_len, pad)


def completion_mask_from_tokens(tokens_BxT: np.ndarray, eos_id: int | Sequence[int]
                                ) -> np.ndarray:
    """1 up to and including the first stop id (``eos_id``: one id or the ``stop_ids``)
    of each row, 0 after it (float32)."""
    is_eos = np.isin(tokens_BxT, _id_set(eos_id))
    after = np.cumsum(is_eos, axis=1) - is_eos  # EOSes strictly before each position
    return (after == 0).astype(np.float32)


def decode_completions(tokenizer: Any, tokens_BxT: np.ndarray, mask_BxT: np.ndarray,
                       eos_id: int | Sequence[int]) -> list[str]:
    """Text of each completion's real tokens, stop ids excluded (``eos_id``: one id or
    the ``stop_ids``)."""
    out, stops = [], set(_id_set(eos_id).tolist())
    for row, m in zip(np.asarray(tokens_BxT), np.asarray(mask_BxT)):
        ids = [int(t) for t, keep in zip(row, m) if keep > 0 and int(t) not in stops]
        out.append(tokenizer.decode(ids))
    return out
