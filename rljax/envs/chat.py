"""Multi-turn chat with a Hugging Face tokenizer's chat template: ids to append per turn.

Token in, token out: a trajectory is the prompt's ids, then per turn the ids the model
sampled (kept as drawn) and the ids the environment's answer adds (its *delta*: the rest
of the assistant turn's close, the tool or user messages, the next generation prompt).
Nothing already in the trajectory is re-tokenised. `ChatRenderer.next_turn` computes a
delta with the template, in text, then tokenises the delta alone:

1. *probe*: render the conversation with the model's turn replaced by a marker
   (`MARKER`) and the new messages after it, `add_generation_prompt=True`. The text
   after the marker is what the template writes after an assistant turn's content: its
   close (`<|im_end|>\\n`), the new messages and the generation prompt. The trailing
   special tokens the model sampled that begin it (its end-of-turn token) are already in
   the trajectory and are skipped.
2. *full render*: render the conversation with the model's turn as an assistant message
   (its text, the sampled close left out) and the new messages. If that text starts with
   the trajectory's text so far plus the sampled turn, the template is *prefix-stable* on
   this turn and the delta is the rest of it: the trajectory's text is then exactly
   `apply_chat_template` of the conversation.
3. otherwise (a template that re-renders earlier turns, e.g. one that drops earlier
   assistant turns' `<think>` reasoning, or one that trims the content) the delta is
   step 1's text: the new messages as the template renders them after an assistant turn.
   The trajectory keeps the sampled ids (the reasoning the model wrote stays in its
   context and in what the learner trains on), so it differs from a fresh render of
   the whole conversation exactly where the template rewrites earlier turns.

`ChatDelta.prefix_stable` and `ChatDelta.token_exact` (the trajectory's ids equal
`apply_chat_template(conversation, tokenize=True)`) say which case a turn was. A
turn's ids are token-exact when the model's turns are its tokenizer's own tokenization
of their text and every boundary falls where the tokenizer splits anyway: at a special
token, as chat templates' turn markers are.

Duck-typed: the tokenizer needs `apply_chat_template`, `encode` and `decode` (a
`transformers` tokenizer); this module imports neither `transformers` nor JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from rljax.envs.tools import ToolRegistry, ToolResult

__all__ = ["ChatRenderer", "ChatTrajectory", "ChatDelta", "ChatTemplateError", "MARKER",
           "observation_messages"]

MARKER = "\u27e6rljax:model-turn\u27e7"  # stands for the model's turn in the probe render


class ChatTemplateError(ValueError):
    """The chat template cannot give a turn's delta (e.g. it drops or repeats the
    assistant turn's content); the message says which render and why."""


@dataclasses.dataclass(frozen=True)
class ChatDelta:
    """What one environment answer appends after the model's sampled turn.

    `sampled`: the model's turn, the ids as drawn (loss mask 1); `ids`/`text`: the
    delta (loss mask 0); `turn_text`: the text of `sampled`;
    `assistant`: the model's turn as a message (its text, the sampled close left out);
    `messages`: the new messages rendered;
    `prefix_stable`: the delta is the suffix of the full render (False: built from the
    probe, step 3 of the module doc); `token_exact`: the trajectory's ids with this turn
    and delta equal `apply_chat_template(conversation, tokenize=True)`.
    """

    sampled: list[int]
    ids: list[int]
    text: str
    turn_text: str
    assistant: dict[str, Any]
    messages: list[dict[str, Any]]
    prefix_stable: bool
    token_exact: bool


@dataclasses.dataclass
class ChatTrajectory:
    """One row's conversation and the ids the learner trains on.

    `messages`: the conversation (model turns as assistant messages of their text);
    `tools`: the tool schemas rendered in the prompt (None: no tools); `ids`: prompt,
    sampled turns and deltas, in order; `loss_mask`: 1 on sampled ids, 0 elsewhere;
    `text`: the text of `ids`, piece by piece; `prefix_stable` / `token_exact`: every
    turn so far was (see `ChatDelta`).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ids: list[int]
    loss_mask: list[int]
    text: str
    prefix_stable: bool = True
    token_exact: bool = True

    def extend(self, delta: ChatDelta) -> None:
        """Append a turn: the model's sampled ids (mask 1), then `delta.ids` (mask 0)."""
        self.ids += delta.sampled + delta.ids
        self.loss_mask += [1] * len(delta.sampled) + [0] * len(delta.ids)
        self.text += delta.turn_text + delta.text
        self.messages += [delta.assistant, *delta.messages]
        self.prefix_stable &= delta.prefix_stable
        self.token_exact &= delta.token_exact


def _int_ids(ids: Sequence[int], what: str) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) and not hasattr(
            ids, "__array__"):
        raise TypeError(f"{what} must be a sequence of token ids, got {type(ids).__name__}")
    out = [int(i) for i in ids]
    if any(i < 0 for i in out):
        raise ValueError(f"{what}: token ids must be >= 0, got {min(out)}")
    return out


def _check_messages(messages: Sequence[Mapping[str, Any]], what: str) -> list[dict[str, Any]]:
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"{what} must be a list of message dicts, got {type(messages).__name__}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"{what}[{j}] must be a dict with a str 'role' and a str "
                             f"'content', got {m!r}"[:300])
        out.append(dict(m))
    return out


def observation_messages(observation: str, tool_results: Sequence[ToolResult] = ()
                         ) -> list[dict[str, Any]]:
    """An environment's answer as chat messages: one `tool` message per call result
    (`ToolResult.to_message()`, in call order; the observation text is then not used),
    else one `user` message holding `observation`."""
    if tool_results:
        return [r.to_message() for r in tool_results]
    return [{"role": "user", "content": observation}]


def _tool_schemas(tools: ToolRegistry | Sequence[Mapping[str, Any]] | None
                  ) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    schemas = tools.schemas() if isinstance(tools, ToolRegistry) else [dict(t) for t in tools]
    return schemas or None


class ChatRenderer:
    """Renders a row's multi-turn conversation with a tokenizer's chat template.

    Args:
      tokenizer: a Hugging Face tokenizer (or any object with `apply_chat_template`,
        `encode` and `decode`) whose `chat_template` is set.
      system: a system message put before the first user message (None: none).
      template_kwargs: extra variables for the template (e.g. `enable_thinking`).
      close_ids: ids that may end a model turn and begin the template's close of it
        (None: the tokenizer's special tokens, `all_special_ids`).
    """

    def __init__(self, tokenizer: Any, *, system: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None,
                 close_ids: Sequence[int] | None = None):
        for fn in ("apply_chat_template", "encode", "decode"):
            if not callable(getattr(tokenizer, fn, None)):
                raise TypeError(f"ChatRenderer: tokenizer {type(tokenizer).__name__} has no "
                                f"{fn}(); pass a transformers tokenizer")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatRenderer: the tokenizer has no chat_template; set "
                             "tokenizer.chat_template or use the tag format (EnvBatch's encode)")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"ChatRenderer.system must be a str or None, got {system!r}")
        self.tokenizer, self.system = tokenizer, system
        self.template_kwargs = dict(template_kwargs or {})
        special = getattr(tokenizer, "all_special_ids", ()) if close_ids is None else close_ids
        self.close_ids = frozenset(_int_ids(list(special), "close_ids"))

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, special tokens only where the text spells them out."""
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens kept."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None
               = None, *, add_generation_prompt: bool = True) -> str:
        """`apply_chat_template(messages, tools=tools, tokenize=False, ...)`; a template
        that raises (e.g. on a role it does not know) raises `ChatTemplateError`."""
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        except Exception as e:
            roles = [m.get("role") for m in messages]
            raise ChatTemplateError(f"the chat template failed on roles {roles}: "
                                    f"{type(e).__name__}: {e}"[:1000]) from e
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned a "
                                    f"{type(text).__name__}, not a str")
        return text

    def start(self, prompt: str | Sequence[Mapping[str, Any]],
              tools: ToolRegistry | Sequence[Mapping[str, Any]] | None = None
              ) -> ChatTrajectory:
        """A row's trajectory from its first prompt: `prompt` is the user's text (put
        after `system`, if any) or the first messages; `tools` a `ToolRegistry` or tool
        schemas (an empty registry renders no tools). The ids are those of
        `apply_chat_template(messages, tools, add_generation_prompt=True, tokenize=True)`."""
        if isinstance(prompt, str):
            messages = ([{"role": "system", "content": self.system}] if self.system else [])
            messages.append({"role": "user", "content": prompt})
        else:
            messages = _check_messages(prompt, "ChatRenderer.start: prompt")
        schemas = _tool_schemas(tools)
        text = self.render(messages, schemas)
        ids = self.encode(text)
        return ChatTrajectory(messages, schemas, ids, [0] * len(ids), text)

    def _sampled_close(self, sampled: list[int], after: str) -> int:
        """How many trailing sampled ids are special tokens whose text begins `after`
        (the template's close of the turn, e.g. `<|im_end|>`): the model wrote them."""
        n = 0
        while n < len(sampled) and sampled[len(sampled) - 1 - n] in self.close_ids:
            n += 1
        for k in range(n, 0, -1):
            if after.startswith(self.decode(sampled[-k:])):
                return k
        return 0

    def next_turn(self, traj: ChatTrajectory, sampled_ids: Sequence[int],
                  new_messages: Sequence[Mapping[str, Any]]) -> ChatDelta:
        """The delta to append after the model's turn `sampled_ids` when the environment
        answers with `new_messages` (e.g. `observation_messages(...)`). Pure: `traj` is
        not changed (`traj.extend(delta)` commits the turn)."""
        sampled = _int_ids(sampled_ids, "sampled_ids")
        new = _check_messages(new_messages, "new_messages")
        if not new:
            raise ValueError("ChatRenderer.next_turn: new_messages is empty; the environment "
                             "must answer with at least one message")
        probe = self.render([*traj.messages, {"role": "assistant", "content": MARKER}, *new],
                            traj.tools)
        if probe.count(MARKER) != 1:
            raise ChatTemplateError(
                f"the chat template rendered an assistant message's content {probe.count(MARKER)}"
                " times (once is needed to find what it writes after a model turn)")
        after = probe[probe.index(MARKER) + len(MARKER):]
        k = self._sampled_close(sampled, after)
        close = self.decode(sampled[len(sampled) - k:]) if k else ""
        turn_text = self.decode(sampled)
        assistant = {"role": "assistant", "content": self.decode(sampled[:len(sampled) - k])}
        full = self.render([*traj.messages, assistant, *new], traj.tools)
        done_text = traj.text + turn_text
        stable = full.startswith(done_text)
        text = full[len(done_text):] if stable else after[len(close):]
        ids = self.encode(text)
        exact = traj.ids + sampled + ids == self.encode(full)
        return ChatDelta(sampled, ids, text, turn_text, assistant, new, stable, exact)
