"""Whether a saved checkpoint fits this config's state, checked before orbax reads it.

A resume with a changed model size used to fail inside orbax's restore: its error
carried advice that does not apply to a run (set `strict=False` to pad or truncate
arrays), and the reads still in flight printed dozens of `RuntimeError: Event loop is
closed` tracebacks after the loop closed. `shape_changes` compares the arrays' shapes
from the checkpoint's metadata (nothing is read), so a resume that does not fit is
refused before any read starts; `orbax_reason` keeps the part of an orbax error that
says what differs.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["orbax_reason", "shape_changes"]

# Sentences of orbax's errors that advise changing orbax's own restore arguments.
_ADVICE = re.compile(r"(Truncating/padding is disabled|To enable it|strict=False)")
_SHOWN = 3  # differing arrays named in the error; the rest counted


def _name(key: Any) -> str:
    """A pytree path entry as orbax names it (dict key, attribute or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shapes(tree: Any) -> dict[tuple[str, ...], tuple]:
    return {tuple(_name(k) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if getattr(leaf, "shape", None) is not None}


def _saved_shapes(ck, step: int) -> dict[tuple[str, ...], tuple]:
    """The arrays' global shapes of checkpoint `step` from its metadata (no array read;
    orbax's warning about a metadata file older checkpoints lack is silenced)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        with ocp.PyTreeCheckpointer() as reader:
            meta = reader.metadata(ck.directory / str(step) / "state")
    finally:
        absl.setLevel(level)
    return _shapes(getattr(meta, "item_metadata", meta))


def shape_changes(ck, fresh: Any, step: int | None = None) -> list[str]:
    """The arrays whose shape in checkpoint `step` (default the latest) of `ck`
    (`rljax.train.checkpoint.Checkpointer`) differs from `fresh`'s (this config's state):
    `"params.policy.embed.value: saved (100, 32), this config (100, 16)"`, the first few
    and a count of the rest; empty when every array both hold has the same shape (arrays
    only one side holds are left to the restore, which names them)."""
    step = ck.latest_step() if step is None else step
    if step is None:
        return []
    try:
        saved = _saved_shapes(ck, step)
    except (OSError, ValueError, KeyError, TypeError):  # no readable metadata: the restore
        return []  # itself then says what does not fit
    now = _shapes(fresh)
    both = sorted(set(saved) & set(now), key=lambda p: (p[0] != "params", p))  # weights first
    diff = [f"{'.'.join(p)}: saved {saved[p]}, this config {now[p]}"
            for p in both if saved[p] != now[p]]
    if len(diff) > _SHOWN:
        diff = diff[:_SHOWN] + [f"and {len(diff) - _SHOWN} more"]
    return diff


def orbax_reason(err: BaseException) -> str:
    """The first line of `err` without orbax's advice on its own restore arguments and
    without a trailing period or colon (the caller's sentence goes on)."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    sentences = re.split(r"(?<=\.)\s+", first)
    kept = [s for s in sentences if not _ADVICE.search(s)] or sentences[:1]
    return " ".join(kept).rstrip(".:")
