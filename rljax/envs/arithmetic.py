"""`ArithmeticToolEnv`: multi-digit arithmetic with a calculator tool.

The prompt asks for one problem of `rljax.data.ArithmeticTask`; the model may call the
calculator (`<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}
</tool_call>`), reads the `<tool_response>`, and ends the episode with
`<answer>N</answer>`. The reward is trajectory-level: 1.0 on the final turn if the tagged
answer is a number equal to `metadata["answer"]` (`rljax.rewards.tagged_answer` and
`math_equal`, the verifiers of the single-turn tasks), else 0.0. The answer must be a
number (digits, a sign, thousands commas, a decimal point): `math_equal` also evaluates
`123*456`, which would credit a copy of the question. A turn with neither a call nor an answer
gets a reminder of the format; `EnvLimits.max_turns` ends a row that never answers.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from rljax.data import ArithmeticTask
from rljax.envs.calculator import Calculator
from rljax.envs.parse import ToolFormat
from rljax.envs.protocol import StepResult, ToolEnv
from rljax.envs.tools import ToolRegistry, ToolResult, format_tool_results
from rljax.rewards import TagFormat, math_equal, tagged_answer

__all__ = ["ArithmeticToolEnv", "arithmetic_tool_rows", "tool_use_trace", "INSTRUCTION",
           "REMINDER"]

INSTRUCTION = ("Solve {question} You may use the calculator: "
               '<tool_call>{{"name": "calculator", "arguments": {{"expression": "..."}}}}'
               "</tool_call>. Give the final answer as <answer>N</answer>.\n")
REMINDER = ("No tool call or answer found. Call the calculator in <tool_call> tags or "
            "answer in <answer> tags.\n")


class ArithmeticToolEnv(ToolEnv):
    """One arithmetic problem per episode, with the calculator.

    Args:
      tools: the registry offered (default: the calculator alone; an empty
        `ToolRegistry()` makes a control run where every call is an `unknown_tool`
        error).
      tool_format: the call and response tags.
      answer: the answer tags (`rljax.rewards.TagFormat`'s `answer_open`/`answer_close`).
      instruction: the prompt, a `str.format` template of `{question}` (default
        `INSTRUCTION`, which shows the call format; a model warmed up on traces may need
        only `"{question}\n"`).

    Metadata per row: `prompt` (the question, e.g. `"123*456="` or a word problem) and
    `answer` (the integer as text), as `ArithmeticProblem.to_record()` gives.
    """

    def __init__(self, tools: ToolRegistry | None = None, tool_format: ToolFormat = ToolFormat(),
                 answer: TagFormat = TagFormat(), instruction: str = INSTRUCTION):
        if not isinstance(instruction, str) or "{question}" not in instruction:
            raise ValueError(f"ArithmeticToolEnv: instruction must be a str.format template "
                             f"with {{question}}, got {instruction!r}")
        self.instruction = instruction
        self.tools = ToolRegistry([Calculator()]) if tools is None else tools
        self.tool_format, self.answer_format = tool_format, answer
        self.answer: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """A turn ends at a tool call's close or the answer's close."""
        return (self.tool_format.call_close, self.answer_format.answer_close)

    def reset(self, metadata: Mapping[str, Any]) -> str:
        """The instruction for `metadata["prompt"]`; remembers `metadata["answer"]`."""
        for key in ("prompt", "answer"):
            if key not in metadata:
                raise KeyError(f"ArithmeticToolEnv: metadata needs {key!r} (has "
                               f"{sorted(metadata)})")
        self.answer = str(metadata["answer"])
        question = str(metadata["prompt"]).rstrip("= ").strip()
        return self.instruction.format(question=question + ("" if question.endswith("?") else "."))

    def step(self, model_text: str, tool_results: Sequence[ToolResult] = ()) -> StepResult:
        """An answer ends the episode (reward 1.0 if correct); otherwise the tool
        responses (or a reminder) are the next observation."""
        if self.answer is None:
            raise RuntimeError("ArithmeticToolEnv.step called before reset")
        given = tagged_answer(model_text, self.answer_format)
        if given is not None:
            correct = _is_number(given) and math_equal(given, self.answer)
            return StepResult("", 1.0 if correct else 0.0, True)
        if tool_results:
            return StepResult(format_tool_results(tool_results, self.tool_format))
        return StepResult(REMINDER)


def _is_number(text: str) -> bool:
    body = text.strip().lstrip("+-")
    return bool(body) and any(c.isdigit() for c in body) and all(
        c.isascii() and (c.isdigit() or c in ",.") for c in body)


def arithmetic_tool_rows(task: ArithmeticTask, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` problems of `task` as row metadata for `ArithmeticToolEnv` (deterministic in
    `seed`), e.g. `arithmetic_tool_rows(ArithmeticTask(digits=4, ops=("*",)), 8, 0)`."""
    return [p.to_record() for p in task.generate(n, seed)]


def tool_use_trace(metadata: Mapping[str, Any], env: ArithmeticToolEnv | None = None
                   ) -> tuple[str, list[tuple[str, bool]]]:
    """A correct tool-using episode for SFT warm-up: ``(prompt, segments)``, the segments
    ``(text, trained)`` as ``rljax.train.batching.encode_traces`` takes them: the model's
    calculator call on the question (trained), the environment's observation (not
    trained), the tagged answer (trained).

    The episode runs through ``env`` (default ``ArithmeticToolEnv()``), the calculator
    called in-process (it is the project's own, exact and bounded), so the texts are the
    ones a rollout of the same turns would hold. Raises ValueError where the question is
    not a calculator expression or the episode does not end correct.
    """
    env = ArithmeticToolEnv() if env is None else env
    prompt = env.reset(metadata)
    calc = env.tools.get("calculator")
    if calc is None:
        raise ValueError(f"tool_use_trace: the environment offers no calculator (tools: "
                         f"{list(env.tools.names)})")
    expression = str(metadata["prompt"]).rstrip("= ").strip()
    fmt, tags = env.tool_format, env.answer_format
    call = (fmt.call_open + json.dumps({"name": calc.name,
                                        "arguments": {"expression": expression}})
            + fmt.call_close)
    try:
        value = calc({"expression": expression})
    except ValueError as e:
        raise ValueError(f"tool_use_trace: {metadata['prompt']!r} is not a calculator "
                         f"expression ({e})") from None
    observation = env.step(call, [ToolResult(calc.name, True, value)]).observation
    answer = tags.answer_open + value + tags.answer_close
    end = env.step(answer)
    if not (end.done and end.reward == 1.0):
        raise ValueError(f"tool_use_trace: the calculator's {value!r} is not the answer "
                         f"{metadata['answer']!r} of {metadata['prompt']!r}")
    return prompt, [(call, True), (observation, False), (answer, True)]
