"""The environment protocol, its limits, and how per-turn rewards become a return.

An environment holds one row's episode. `reset(metadata)` returns the first observation
(the prompt text); `step(model_text, tool_results)` takes the model's turn and returns a
`StepResult` (the next observation, this turn's reward, whether the episode is over).
An environment that offers tools has a `tools` registry and a `tool_calls(model_text)`
method (`ToolEnv` gives both); `rljax.envs.EnvBatch` then runs the calls of all its rows
in a worker pool and hands each row its results in `step`. An optional `stop_strings`
attribute names the text that ends a model turn (`EnvBatch.stop_strings` collects them).

Rewards are per turn: `episode_return` makes an episode's return of them, `returns_to_go`
each turn's discounted reward-to-go (per-turn credit). A trajectory-level task returns 0
until its last step; `"discounted"` then weighs its reward by `gamma^(T-1)` (a shorter
episode earns more).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from rljax.envs.parse import (ParsedCall, ToolFormat, parse_response_tool_calls,
                              parse_tool_calls)
from rljax.envs.tools import ToolRegistry, ToolResult

__all__ = ["StepResult", "Environment", "ToolEnv", "EnvLimits", "RETURN_MODES",
           "episode_return", "returns_to_go"]

RETURN_MODES = ("sum", "discounted")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One turn's answer from an environment: `observation` (text appended after the
    model's turn; ignored when `done`), `reward` (a finite float), `done`."""

    observation: str
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """One row's episode. Plain Python; it runs on the host of the process that holds
    the row. `tool_results` holds one `ToolResult` per call parsed from `model_text` (in
    call order), empty for an environment without tools."""

    def reset(self, metadata: Mapping[str, Any]) -> str:
        """Start the row's episode from its metadata; the first observation (the prompt)."""
        ...

    def step(self, model_text: str, tool_results: Sequence[ToolResult] = ()) -> StepResult:
        """Answer one model turn (and the results of the calls it made)."""
        ...


class ToolEnv:
    """Base class for an environment with tools: subclasses set `self.tools` (a
    `ToolRegistry`) and may set `self.tool_format`, and implement `reset` and `step`.
    `tool_calls` parses the model's turn with `parse_tool_calls`, or, when
    `self.response_parser` is a tokenizer with a `response_template`, with
    `parse_response_tool_calls` (the model's own call syntax)."""

    tools: ToolRegistry = ToolRegistry()
    tool_format: ToolFormat = ToolFormat()
    response_parser: Any = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Text that ends a model turn (kept in the turn): the close of a tool call."""
        return (self.tool_format.call_close,)

    def tool_calls(self, model_text: str) -> list[ParsedCall]:
        """The calls in `model_text` (`rljax.envs.parse_tool_calls` with `tool_format`, or
        `parse_response_tool_calls` with `response_parser`)."""
        if self.response_parser is not None:
            return parse_response_tool_calls(self.response_parser, model_text, self.tool_format)
        return parse_tool_calls(model_text, self.tool_format)

    def reset(self, metadata: Mapping[str, Any]) -> str:
        """As `Environment.reset`; subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__}.reset")

    def step(self, model_text: str, tool_results: Sequence[ToolResult] = ()) -> StepResult:
        """As `Environment.step`; subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__}.step")


@dataclasses.dataclass(frozen=True)
class EnvLimits:
    """Bounds on one row's episode and its tool calls.

    Attributes:
      max_turns: model turns per episode; a row still going after this many is ended
        and marked truncated (`"max_turns"`).
      max_obs_tokens: tokens of one observation after a model turn (the first one, the
        prompt, counts only toward the total); a longer observation ends the row,
        truncated (`"obs_tokens"`).
      max_total_tokens: prompt + model turns + observations; a row that would pass it
        is ended, truncated (`"total_tokens"`). Set it to the rollout's cache length.
      tool_timeout_s: time limit of one tool call in its worker.
      max_tool_result_chars: characters of one tool result; a longer result is a
        `too_large` error.
      max_tool_error_chars: characters of one tool error message shown to the model.

    A turn's observation holds up to `ToolFormat.max_calls` results: keep their tokens
    under `max_obs_tokens`, or a turn of full-size results ends its row.
    """

    max_turns: int = 4
    max_obs_tokens: int = 512
    max_total_tokens: int = 2048
    tool_timeout_s: float = 5.0
    max_tool_result_chars: int = 1_000
    max_tool_error_chars: int = 300

    def __post_init__(self):
        for f in ("max_turns", "max_obs_tokens", "max_total_tokens", "max_tool_result_chars",
                  "max_tool_error_chars"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EnvLimits.{f} must be an int >= 1, got {v!r}")
        t = self.tool_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ValueError(f"EnvLimits.tool_timeout_s must be a finite number > 0 (seconds), "
                             f"got {t!r}")


def check_return_mode(mode: str, gamma: float) -> None:
    """ValueError unless ``mode`` is one of ``RETURN_MODES`` and ``gamma`` is in [0, 1]."""
    if mode not in RETURN_MODES:
        raise ValueError(f"return mode must be one of {RETURN_MODES}, got {mode!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")


def returns_to_go(rewards_T: Sequence[float], gamma: float = 1.0) -> np.ndarray:
    """float32[T]: `G_t = r_t + gamma * G_{t+1}`, the discounted reward-to-go of each turn."""
    check_return_mode("discounted", gamma)
    r_T = np.asarray(rewards_T, np.float64).reshape(-1)
    g_T = np.zeros_like(r_T)
    acc = 0.0
    for t in range(len(r_T) - 1, -1, -1):
        acc = r_T[t] + gamma * acc
        g_T[t] = acc
    return g_T.astype(np.float32)


def episode_return(rewards_T: Sequence[float], mode: str = "sum", gamma: float = 1.0) -> float:
    """One episode's return from its per-turn rewards: `"sum"` is `sum_t r_t`,
    `"discounted"` is `sum_t gamma^t r_t` (t = 0 at the first model turn). A
    trajectory-level reward (0 until the last turn) is its own return under `"sum"`."""
    check_return_mode(mode, gamma)
    if mode == "sum":
        return float(np.sum(np.asarray(rewards_T, np.float64)))
    g_T = returns_to_go(rewards_T, gamma)
    return float(g_T[0]) if len(g_T) else 0.0
