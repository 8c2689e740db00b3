"""Chat-template prompt building and length filtering with an explicit policy.

`build_chat_prompt` accepts any tokenizer-like object with Hugging Face's
`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`; rljax.data
does not import the model layer. `filter_by_length` never drops silently: every prompt
over the limit is counted in a `LengthReport` (returned and logged), and the policy says
whether it is dropped, truncated or an error.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Sequence

log = logging.getLogger(__name__)

ACTIONS = ("drop", "error", "truncate_left")


def chat_messages(user: str, *, system: str | None = None) -> list[dict[str, str]]:
    """`[{"role": "system", ...}, {"role": "user", ...}]` (system only if given)."""
    if not isinstance(user, str):
        raise TypeError(f"chat_messages: user must be a str, got {type(user).__name__}")
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user}]


def build_chat_prompt(tokenizer: Any, user: str, *, system: str | None = None,
                      assistant_prefix: str = "") -> str:
    """The prompt text for `user` under the tokenizer's chat template, ending with the
    generation prompt and then `assistant_prefix` (e.g. R1-Zero's `"<think>"`)."""
    fn = getattr(tokenizer, "apply_chat_template", None)
    if not callable(fn):
        raise TypeError(f"build_chat_prompt: tokenizer {type(tokenizer).__name__} has no "
                        "apply_chat_template(messages, tokenize=False, add_generation_prompt=True)")
    text = fn(chat_messages(user, system=system), tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(f"build_chat_prompt: apply_chat_template returned "
                        f"{type(text).__name__}, expected str (tokenize=False)")
    return text + assistant_prefix


def build_chat_prompts(records: Sequence[Mapping[str, Any]], tokenizer: Any, *,
                       field: str = "prompt", out_field: str = "prompt_text",
                       system: str | None = None, assistant_prefix: str = ""
                       ) -> list[dict[str, Any]]:
    """Copies of `records` with `out_field` = the chat prompt built from `record[field]`."""
    out = []
    for i, r in enumerate(records):
        if field not in r:
            raise ValueError(f"build_chat_prompts: record {i} ({r.get('source', 'no source')}) "
                             f"has no {field!r} field; fields present: {sorted(r)}")
        text = build_chat_prompt(tokenizer, r[field], system=system,
                                 assistant_prefix=assistant_prefix)
        out.append({**r, out_field: text})
    return out


@dataclasses.dataclass(frozen=True)
class LengthPolicy:
    """`max_tokens`: the limit. `action` for a prompt over it: "drop" (counted and
    reported), "error" (ValueError naming the prompt), or "truncate_left" (keep the last
    `max_tokens` token ids of `record[token_field]`)."""

    max_tokens: int
    action: str = "drop"
    token_field: str = "prompt_ids"

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"LengthPolicy.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"LengthPolicy.action must be one of {ACTIONS}, got {self.action!r}")


@dataclasses.dataclass(frozen=True)
class LengthReport:
    """What `filter_by_length` did: totals, the over-limit indices, the longest length."""

    total: int
    kept: int
    over_limit: int
    dropped: tuple[int, ...]
    truncated: tuple[int, ...]
    max_length: int
    limit: int

    def __str__(self) -> str:
        return (f"{self.over_limit}/{self.total} prompts over {self.limit} tokens "
                f"(longest {self.max_length}): {len(self.dropped)} dropped, "
                f"{len(self.truncated)} truncated, {self.kept} kept")


def filter_by_length(records: Sequence[Mapping[str, Any]], policy: LengthPolicy, *,
                     length_fn: Callable[[Mapping[str, Any]], int] | None = None,
                     name: str = "filter_by_length"
                     ) -> tuple[list[dict[str, Any]], LengthReport]:
    """Apply `policy` to each record's length: `length_fn(record)` if given, else
    `len(record[policy.token_field])`. Returns the kept records and a report (also
    logged as one warning, starting with `name`, e.g. the split's, when anything was
    over the limit)."""
    kept, dropped, truncated, longest = [], [], [], 0
    for i, r in enumerate(records):
        if length_fn is None and policy.token_field not in r:
            raise ValueError(f"filter_by_length: prompt {i} has no {policy.token_field!r} "
                             "field and no length_fn was given")
        n = len(r[policy.token_field]) if length_fn is None else length_fn(r)
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"filter_by_length: length of prompt {i} is {n!r}, not an int "
                             ">= 0")
        longest = max(longest, n)
        if n <= policy.max_tokens:
            kept.append(dict(r))
        elif policy.action == "error":
            raise ValueError(f"filter_by_length: prompt {i} ({r.get('source', 'no source')}) "
                             f"has {n} tokens > max_tokens={policy.max_tokens}")
        elif policy.action == "drop":
            dropped.append(i)
        else:
            if policy.token_field not in r:
                raise ValueError(f"filter_by_length: truncate_left needs token ids in "
                                 f"record[{policy.token_field!r}] (prompt {i})")
            kept.append({**r, policy.token_field:
                         list(r[policy.token_field])[-policy.max_tokens:]})
            truncated.append(i)
    rep = LengthReport(len(records), len(kept), len(dropped) + len(truncated), tuple(dropped),
                       tuple(truncated), longest, policy.max_tokens)
    if rep.over_limit:
        log.warning("%s: %s", name, rep)
    return kept, rep
