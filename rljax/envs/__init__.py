"""rljax.envs: multi-turn environments and tools, driven on the host.

An environment holds one row's episode (`reset(metadata) -> prompt`, `step(model_text,
tool_results) -> StepResult`); `EnvBatch` drives one process's rows a turn at a time,
runs their tool calls in a `rljax.rewards.RewardPool` under a time limit, applies the
turn and token limits (`EnvLimits`) and keeps per-row metrics. Tools are called with the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format (`parse_tool_calls`)
and answered in `<tool_response>` blocks (`parse_response_tool_calls` reads a model's
own syntax with its tokenizer's response parser); with `ChatRenderer`, prompts and tool
results are rendered with a Hugging Face tokenizer's chat template instead. `Calculator`
is a safe arithmetic tool and `ArithmeticToolEnv` a task that uses it. Guide: docs/environments.md.

Host-side plain Python + numpy: imports `rljax.rewards` and `rljax.data`, never JAX.
"""

from rljax.envs.arithmetic import ArithmeticToolEnv, arithmetic_tool_rows, tool_use_trace
from rljax.envs.batch import TRUNCATIONS, BatchStep, EnvBatch, EnvError
from rljax.envs.calculator import Calculator, CalculatorError, calculate
from rljax.envs.chat import (MARKER, ChatDelta, ChatRenderer, ChatTemplateError,
                             ChatTrajectory, observation_messages)
from rljax.envs.parse import (ParsedCall, ToolCall, ToolCallError, ToolFormat,
                              parse_response_tool_calls, parse_tool_calls)
from rljax.envs.protocol import (RETURN_MODES, EnvLimits, Environment, StepResult, ToolEnv,
                                 episode_return, returns_to_go)
from rljax.envs.tools import (ERROR_KINDS, Tool, ToolRegistry, ToolResult,
                              format_tool_results, run_tool_calls, truncate_text)

__all__ = [
    "Environment", "ToolEnv", "StepResult", "EnvLimits", "EnvBatch", "BatchStep", "EnvError",
    "TRUNCATIONS", "RETURN_MODES", "episode_return", "returns_to_go",
    "ChatRenderer", "ChatTrajectory", "ChatDelta", "ChatTemplateError", "MARKER",
    "observation_messages",
    "ToolFormat", "ToolCall", "ToolCallError", "ParsedCall", "parse_tool_calls",
    "parse_response_tool_calls",
    "Tool", "ToolRegistry", "ToolResult", "ERROR_KINDS", "run_tool_calls",
    "format_tool_results", "truncate_text",
    "Calculator", "CalculatorError", "calculate", "ArithmeticToolEnv", "arithmetic_tool_rows",
    "tool_use_trace",
]
