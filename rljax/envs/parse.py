"""Tool calls in model text: the tag format and a parser bounded against hostile output.

The format is the one Qwen2.5's and Hermes-style chat templates train models on, and the
JSON inside is the shape Hugging Face chat templates use for a call (`{"name": ...,
"arguments": {...}}`, the `function` of an assistant message's `tool_calls`):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

`{"type": "function", "function": {"name": ..., "arguments": ...}}` is accepted too,
`arguments` may be a JSON string holding the object (OpenAI's form), and `parameters`
stands for a missing `arguments` (Llama 3.1's JSON calls). The parser never
raises on model text: every problem becomes a `ToolCallError` in the result list, in the
order the calls appear, so the environment can answer it as an observation. Work is
linear in the text: `str.find` scans over at most `ToolFormat.max_text_chars`
characters, and `json.loads` runs only on bodies under `max_call_chars` whose bracket
nesting is under `max_depth`. NaN, infinities and floats that overflow (`1e999`) are refused.

`parse_response_tool_calls` reads the calls with a Hugging Face tokenizer's own response
parser instead (`tokenizer.parse_response`, driven by the `response_template` a model's
tokenizer ships: Mistral's `[TOOL_CALLS]`, Llama's JSON, XML-style calls...) and checks
each call it finds the same way.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Union

from rljax.rewards.limits import json_depth_ok

__all__ = ["ToolFormat", "ToolCall", "ToolCallError", "ParsedCall", "parse_tool_calls",
           "parse_response_tool_calls", "valid_tool_name"]

MAX_NAME_CHARS = 64


def valid_tool_name(name: object) -> bool:
    """Whether `name` is a tool name: 1..64 characters of letters, digits, `_`, `-`, `.`."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS
            and all(c.isascii() and (c.isalnum() or c in "_-.") for c in name))


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """The tags around tool calls and tool responses, and the parser's bounds.

    Attributes:
      call_open, call_close: the tags around one call's JSON (`<tool_call>`, `</tool_call>`).
      response_open, response_close: the tags around one result in an observation
        (`<tool_response>`, `</tool_response>`, as Qwen2.5's template renders tool turns).
      max_calls: calls run per turn; further calls in the same turn get one error.
      max_call_chars: characters of JSON in one call; a longer body is an error, unread.
      max_text_chars: characters of the model's turn that are scanned for calls.
      max_depth: bracket nesting allowed in a call's JSON.
    """

    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    response_open: str = "<tool_response>"
    response_close: str = "</tool_response>"
    max_calls: int = 4
    max_call_chars: int = 4_000
    max_text_chars: int = 100_000
    max_depth: int = 16

    def __post_init__(self):
        for f in ("call_open", "call_close", "response_open", "response_close"):
            v = getattr(self, f)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"ToolFormat.{f} must be a non-empty string, got {v!r}")
        if self.call_open == self.call_close:
            raise ValueError(f"ToolFormat.call_open and call_close must differ, both are "
                             f"{self.call_open!r}")
        for f in ("max_calls", "max_call_chars", "max_text_chars", "max_depth"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ToolFormat.{f} must be an int >= 1, got {v!r}")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's `name` and its `arguments` (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def to_message(self) -> dict[str, Any]:
        """The call as an entry of an HF assistant message's `tool_calls` list."""
        return {"type": "function", "function": {"name": self.name,
                                                 "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call that could not be read: `message` says what was wrong (shown to the model)."""

    message: str


ParsedCall = Union[ToolCall, ToolCallError]


def _reject_constant(value: str) -> Any:
    raise ValueError(f"{value} is not allowed in a tool call")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} is out of range")
    return v


def _loads(text: str) -> Any:
    """`json.loads` refusing NaN, infinities and numbers that overflow a float."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def _decode(body: str, fmt: ToolFormat) -> ParsedCall:
    """One call's body -> a `ToolCall`, or a `ToolCallError` saying what is wrong."""
    if len(body) > fmt.max_call_chars:
        return ToolCallError(f"the tool call is {len(body)} characters long; at most "
                             f"{fmt.max_call_chars} are read")
    if not json_depth_ok(body, fmt.max_depth):
        return ToolCallError(f"the tool call's JSON nests deeper than {fmt.max_depth} levels")
    try:
        obj = _loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, huge ints, NaN
        return ToolCallError(f"the tool call is not valid JSON ({str(e)[:200]})")
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict):
        return ToolCallError('a tool call must be a JSON object {"name": ..., "arguments": '
                             f'{{...}}}}, got a JSON {type(obj).__name__}')
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not valid_tool_name(name):
        return ToolCallError('a tool call needs "name": 1 to 64 letters, digits, "_", "-" '
                             f'or ".", got {str(name)[:80]!r}')
    if isinstance(args, str):
        try:
            args = _loads(args)
        except (ValueError, RecursionError):
            args = None
    if not isinstance(args, dict):
        return ToolCallError(f'tool call {name!r}: "arguments" must be a JSON object')
    return ToolCall(name, args)


def _too_many(rest: int, fmt: ToolFormat) -> ToolCallError:
    return ToolCallError(f"{rest} more tool calls in this turn were not run: at most "
                         f"{fmt.max_calls} run per turn")


def parse_tool_calls(text: object, fmt: ToolFormat = ToolFormat()) -> list[ParsedCall]:
    """The calls in a model turn, in order: `ToolCall`s and `ToolCallError`s.

    Reads the first `fmt.max_text_chars` characters. A call opened and not closed is an
    error; calls beyond `fmt.max_calls` add one error and are not run. Text with no call
    gives `[]`. Never raises on any `text` (not even a non-string: that gives `[]`).
    """
    if not isinstance(text, str):
        return []
    text = text[:fmt.max_text_chars]
    out: list[ParsedCall] = []
    pos = 0
    while True:
        s = text.find(fmt.call_open, pos)
        if s < 0:
            break
        b = s + len(fmt.call_open)
        e = text.find(fmt.call_close, b)
        if len(out) == fmt.max_calls:  # each call read so far added one entry
            out.append(_too_many(text.count(fmt.call_open, s), fmt))
            break
        if e < 0:
            out.append(ToolCallError(f"a tool call was opened with {fmt.call_open} and "
                                     f"never closed with {fmt.call_close}"))
            break
        out.append(_decode(text[b:e].strip(), fmt))
        pos = e + len(fmt.call_close)
    return out


def parse_response_tool_calls(tokenizer: Any, text: object, fmt: ToolFormat = ToolFormat(),
                              *, prefix: str = "") -> list[ParsedCall]:
    """The calls in a model turn as the tokenizer's response parser reads them.

    `tokenizer.parse_response(text, prefix=prefix)` (transformers; it needs the
    tokenizer's `response_template`) parses the first `fmt.max_text_chars` characters;
    each entry of the message's `tool_calls` is then checked as a tagged call's JSON is
    (name, arguments, `max_call_chars`, `max_depth`, at most `fmt.max_calls`). A turn
    the parser cannot read (e.g. one call's JSON is broken) gives one `ToolCallError`
    with its message: the parser reads a turn whole, so no call of it runs. Never
    raises on `text`; a tokenizer without a response parser is a ValueError.
    """
    if getattr(tokenizer, "response_template", None) is None \
            or not callable(getattr(tokenizer, "parse_response", None)):
        raise ValueError(f"parse_response_tool_calls: tokenizer {type(tokenizer).__name__} has "
                         "no response_template (transformers' parse_response); use "
                         "parse_tool_calls with a ToolFormat for a tag format")
    if not isinstance(text, str):
        return []
    try:
        message = tokenizer.parse_response(text[:fmt.max_text_chars], prefix=prefix)
        calls = message.get("tool_calls") if isinstance(message, dict) else None
    except Exception as e:  # the parser's own errors on model text
        return [ToolCallError(f"the tool calls could not be read ({type(e).__name__}: "
                              f"{str(e)[:200]})")]
    if calls is None:
        return []
    if not isinstance(calls, list):
        return [ToolCallError(f"the response parser gave tool_calls as a "
                              f"{type(calls).__name__}, not a list")]
    out: list[ParsedCall] = []
    for call in calls[:fmt.max_calls]:
        try:
            body = json.dumps(call, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            out.append(ToolCallError(f"the tool call is not JSON ({str(e)[:200]})"))
            continue
        out.append(_decode(body, fmt))
    if len(calls) > fmt.max_calls:
        out.append(_too_many(len(calls) - fmt.max_calls, fmt))
    return out
