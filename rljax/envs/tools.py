"""Tools: the protocol, a registry, running calls in worker processes, results as text.

A tool runs on arguments the model wrote, so it runs in a `rljax.rewards.RewardPool`
worker (a fresh interpreter; a call past its time limit has its worker killed and
replaced), never in the trainer's process. Every way a call can go wrong becomes a
`ToolResult` with `ok=False` and a short message, never an exception in the caller:

| kind | what happened |
|---|---|
| `parse` | the call could not be read (`rljax.envs.parse.ToolCallError`) |
| `unknown_tool` | no tool of that name is registered |
| `timeout` | the call ran past `timeout_s` (its worker was killed and replaced) |
| `raised` | the tool raised (its message, cut to `max_error_chars` in the worker), or could not be sent to or loaded in a worker |
| `too_large` | the tool returned more than `max_result_chars` characters (checked in the worker, so a huge result never crosses the pipe) |
| `bad_result` | the tool returned something that is not a string |
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from rljax.envs.parse import ParsedCall, ToolCall, ToolCallError, ToolFormat, valid_tool_name
from rljax.rewards import RewardPool

__all__ = ["Tool", "ToolRegistry", "ToolResult", "ERROR_KINDS", "run_tool_calls",
           "format_tool_results", "truncate_text"]

ERROR_KINDS = ("parse", "unknown_tool", "timeout", "raised", "too_large", "bad_result")


@runtime_checkable
class Tool(Protocol):
    """A tool: `name`, `description`, `parameters` (a JSON schema of its arguments) and
    `__call__(arguments) -> str`. It must pickle into a worker process: a module-level
    class (a frozen dataclass is simplest), in a module that imports quickly."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        """The result text for `arguments` (the call's JSON object); raise to refuse."""
        ...


class ToolRegistry:
    """The tools an environment offers, by name.

    Args:
      tools: `Tool`s with distinct valid names (1..64 of letters, digits, `_`, `-`, `.`).
    """

    def __init__(self, tools: Sequence[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"ToolRegistry: {t!r} is not a Tool (needs name, "
                                "description, parameters and __call__(arguments) -> str)")
            if not valid_tool_name(t.name):
                raise ValueError(f"ToolRegistry: tool name {t.name!r} is not allowed; use 1 "
                                 "to 64 letters, digits, '_', '-' or '.'")
            if t.name in self._tools:
                raise ValueError(f"ToolRegistry: two tools are named {t.name!r}")
            self._tools[t.name] = t

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Tool | None:
        """The tool called `name`, or None."""
        return self._tools.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The tools as JSON schemas, the form `tokenizer.apply_chat_template(tools=...)`
        takes: `{"type": "function", "function": {"name", "description", "parameters"}}`."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": dict(t.parameters)}}
                for t in self._tools.values()]


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One call's outcome: `name` (the tool, "" when the call could not be read), `ok`,
    `content` (the result text, or the error message shown to the model), `kind` (None
    when ok, else one of `ERROR_KINDS`) and `seconds` (wall time of the pool batch it ran
    in; 0 for calls answered without a worker)."""

    name: str
    ok: bool
    content: str
    kind: str | None = None
    seconds: float = 0.0

    def to_message(self) -> dict[str, Any]:
        """The result as an HF chat message: `{"role": "tool", "name", "content"}`."""
        return {"role": "tool", "name": self.name, "content": self.content}


def truncate_text(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, marked `...[truncated N chars]`."""
    if len(text) <= max_chars:
        return text
    mark = f"...[truncated {len(text) - max_chars} chars]"
    keep = max(max_chars - len(mark), 0)
    return (text[:keep] + mark)[:max_chars]


@dataclasses.dataclass(frozen=True)
class _Invoke:
    """Runs in the worker: one tool on one call's arguments, its result bounded there.
    Called as a reward pool task, `fn(arguments, None)`."""

    tool: Any
    max_result_chars: int
    max_error_chars: int

    def __call__(self, arguments: Mapping[str, Any], _meta: Any) -> tuple[str, Any]:
        try:
            out = self.tool(arguments)
        except Exception as e:  # its message cut here: a huge one never crosses the pipe
            return ("raised", truncate_text(f"{type(e).__name__}: {e}", self.max_error_chars))
        if not isinstance(out, str):
            return ("bad_result", type(out).__name__)
        if len(out) > self.max_result_chars:
            return ("too_large", len(out))
        return ("ok", out)


def _error(name: str, kind: str, message: str, max_chars: int, seconds: float = 0.0
           ) -> ToolResult:
    return ToolResult(name, False, truncate_text(f"error: {message}", max_chars), kind, seconds)


def _from_pool(name: str, reply: tuple, timeout_s: float, max_result_chars: int,
               max_error_chars: int, seconds: float) -> ToolResult:
    """A pool reply (("ok", v), ("error", msg, tb) or ("timeout", s)) -> a ToolResult."""
    if reply[0] == "timeout":
        kind, what = "timeout", f"ran past its time limit of {timeout_s:g} s and was stopped"
    elif reply[0] == "error":  # the call could not be sent or loaded, or the worker died
        kind, what = "raised", f"failed: {str(reply[1])[:max_error_chars]}"
    elif reply[1][0] == "ok":
        return ToolResult(name, True, truncate_text(reply[1][1], max_result_chars), None, seconds)
    else:  # the worker's _Invoke status
        kind, value = reply[1]
        what = {"raised": f"failed: {value}", "bad_result": f"returned a {value}, not a string",
                "too_large": f"returned {value} characters, over the limit of "
                             f"{max_result_chars}"}[kind]
    return _error(name, kind, f"tool {name!r} {what}", max_error_chars, seconds)


def run_tool_calls(pool: RewardPool, calls: Sequence[tuple[ToolRegistry, ParsedCall]], *,
                   timeout_s: float, max_result_chars: int, max_error_chars: int = 500
                   ) -> list[ToolResult]:
    """Run `(registry, call)` pairs in `pool`, all at once; one `ToolResult` per pair.

    Parse errors and unknown names are answered without a worker; the other calls run
    in the pool's workers in parallel, each under `timeout_s`. Returned contents are at
    most `max_result_chars` (results) or `max_error_chars` (errors) characters. Never
    raises for anything a call or a tool does.
    """
    out: list[ToolResult | None] = [None] * len(calls)
    tasks, where = [], []
    for i, (registry, call) in enumerate(calls):
        if isinstance(call, ToolCallError):
            out[i] = _error("", "parse", call.message, max_error_chars)
        elif not isinstance(call, ToolCall) or call.name not in registry:
            name = getattr(call, "name", "")
            out[i] = _error(name, "unknown_tool", f"there is no tool {name!r}; tools: "
                            f"{', '.join(registry.names) or 'none'}", max_error_chars)
        else:
            tasks.append((_Invoke(registry.get(call.name), max_result_chars, max_error_chars),
                          call.arguments, None))
            where.append(i)
    if tasks:
        t0 = time.monotonic()
        replies = pool.run(tasks, timeout_s=timeout_s)
        seconds = time.monotonic() - t0
        for i, reply in zip(where, replies):
            out[i] = _from_pool(calls[i][1].name, reply, timeout_s, max_result_chars,
                                max_error_chars, seconds)
    return out  # type: ignore[return-value]


def format_tool_results(results: Sequence[ToolResult], fmt: ToolFormat = ToolFormat()) -> str:
    """Results as observation text, one `<tool_response>` block each, in call order:
    `<tool_response>\\n{content}\\n</tool_response>\\n`."""
    return "".join(f"{fmt.response_open}\n{r.content}\n{fmt.response_close}\n" for r in results)
