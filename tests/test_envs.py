"""rljax.envs: the environment protocol and its limits, the tool-call parser on hostile
text, tools in worker processes (hang, raise, 10 MB, wrong type), the calculator, reward
aggregation, and a scripted multi-turn episode end to end. No JAX program runs here."""

import json
import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import _tools
from rljax.data import ArithmeticTask
from rljax.envs import (ArithmeticToolEnv, Calculator, CalculatorError, EnvBatch, EnvError,
                        EnvLimits, StepResult, ToolCall, ToolCallError, ToolEnv, ToolFormat,
                        ToolRegistry, arithmetic_tool_rows, calculate, episode_return,
                        format_tool_results, parse_tool_calls, returns_to_go, run_tool_calls)
from rljax.rewards import RewardPool
from _envs_chat import *  # noqa: F401,F403  (chat templates)
from _envs_traces import *  # noqa: F401,F403  (SFT on tool-use traces)


def encode(text):
    """A byte-level 'tokenizer': one id per UTF-8 byte."""
    return list(text.encode())


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2) as p:
        yield p


class Scripted:
    """No tools. Each step returns the metadata's next (observation, reward, done)."""

    def reset(self, metadata):
        self.script = list(metadata["script"])
        return metadata["prompt"]

    def step(self, model_text, tool_results=()):
        obs, reward, done = self.script.pop(0)
        return StepResult(obs, reward, done)


class HostileToolsEnv(ToolEnv):
    """Offers the hostile tools; echoes tool responses; "stop" ends the episode."""

    def __init__(self):
        self.tools = ToolRegistry([_tools.Hang(), _tools.Raise(size=10_000_000), _tools.Huge(),
                                   _tools.NotText(), _tools.Echo()])

    def reset(self, metadata):
        return "go\n"

    def step(self, model_text, tool_results=()):
        if model_text == "stop":
            return StepResult("", 1.0, True)
        return StepResult(format_tool_results(tool_results) or "nothing\n")


# ---- the protocol and its limits ------------------------------------------------------

def test_limits_end_rows_and_mark_them_truncated():
    limits = EnvLimits(max_turns=3, max_obs_tokens=8, max_total_tokens=40)
    rows = [{"prompt": "p", "script": [("ok", 0.0, False)] * 5},           # max_turns
            {"prompt": "p", "script": [("x" * 9, 0.5, False)]},            # obs_tokens
            {"prompt": "p" * 30, "script": [("12345678", 0.0, False)]},    # total_tokens
            {"prompt": "p", "script": [("ok", 0.0, False), ("", 2.0, True)]},  # env's done
            {"prompt": "p" * 41, "script": []}]                            # prompt too long
    envs = EnvBatch(Scripted, encode, limits)
    first = envs.reset(rows)
    assert envs.stop_strings == ()
    assert first.done_B.tolist() == [False] * 4 + [True]
    assert first.observation_ids[0] == encode("p") and first.observations[4] == ""
    for turn in range(3):
        out = envs.step(["abc"] * 5)
        assert out.observation_ids == [encode(o) for o in out.observations]
    assert out.all_done and out.truncated_B.tolist() == [True, True, True, False, True]
    assert [envs.info(i)["truncated"] for i in range(5)] == [
        "max_turns", "obs_tokens", "total_tokens", None, "total_tokens"]
    assert [envs.info(i)["turns"] for i in range(5)] == [3, 1, 1, 2, 0]
    assert envs.info(3)["rewards"] == [0.0, 2.0] and envs.info(0)["tokens"] == 1 + 3 * 3 + 2 * 2
    np.testing.assert_array_equal(envs.returns_B(), [0.0, 0.5, 0.0, 2.0, 0.0])
    assert envs.metrics()["env/truncated"] == (4.0, 5)
    assert envs.metrics()["env/turns"] == (7.0, 5)


def test_done_rows_ignore_their_text_and_model_token_counts_are_used():
    envs = EnvBatch(Scripted, encode, EnvLimits(max_total_tokens=20))
    envs.reset([{"prompt": "p", "script": [("", 1.0, True)]},
                {"prompt": "p", "script": [("o", 0.0, False), ("o", 0.0, False)]}])
    out = envs.step(["a", "b"], model_tokens=[1, 18])  # 1 + 18 + "o" reaches 20
    assert out.rewards_B.tolist() == [1.0, 0.0] and out.done_B.tolist() == [True, True]
    assert envs.info(1)["truncated"] == "total_tokens"
    assert envs.step([None, None]).rewards_B.tolist() == [0.0, 0.0]  # all done: nothing runs


def test_bad_calls_and_bad_environments_get_clear_errors():
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        EnvLimits(max_turns=0)
    with pytest.raises(ValueError, match="tool_timeout_s"):
        EnvLimits(tool_timeout_s=float("inf"))
    envs = EnvBatch(Scripted, encode)
    envs.reset([{"prompt": "p", "script": [("o", float("nan"), False)]}])
    with pytest.raises(ValueError, match="1 rows, got 2 texts"):
        envs.step(["a", "b"])
    with pytest.raises(EnvError, match="row 0: Scripted.step returned reward nan"):
        envs.step(["a"])
    envs.reset([{"prompt": "p", "script": []}])
    with pytest.raises(EnvError, match="row 0: Scripted.step raised IndexError"):
        envs.step(["a"])
    envs.reset([{"prompt": "p", "script": [("o", "1", False)]}])
    with pytest.raises(EnvError, match="a float reward"):
        envs.step(["a"])
    envs.reset([{"prompt": "p", "script": []}])
    with pytest.raises(ValueError, match="row 0 is not done, so its model text must be a str"):
        envs.step([None])
    with pytest.raises(EnvError, match="row 0: Scripted.reset raised KeyError"):
        envs.reset([{"prompt": "p"}])
    with pytest.raises(ValueError, match="has tools but no pool"):
        EnvBatch(ArithmeticToolEnv, encode).reset([{"prompt": "1*2=", "answer": "2"}])


def test_rewards_per_turn_and_per_trajectory():
    r_T = [1.0, 0.0, 2.0]
    assert episode_return(r_T) == 3.0
    assert episode_return(r_T, "discounted", 0.5) == pytest.approx(1.0 + 0.25 * 2.0)
    np.testing.assert_allclose(returns_to_go(r_T, 0.5), [1.5, 1.0, 2.0])
    assert episode_return([0.0, 0.0, 1.0]) == 1.0  # a trajectory reward is its own return
    assert episode_return([]) == 0.0 and returns_to_go([], 0.9).shape == (0,)
    with pytest.raises(ValueError, match="return mode must be one of"):
        episode_return(r_T, "mean")
    with pytest.raises(ValueError, match=r"gamma must be a number in \[0, 1\]"):
        returns_to_go(r_T, 1.5)
    envs = EnvBatch(Scripted, encode)
    envs.reset([{"prompt": "p", "script": [("o", 1.0, False), ("", 2.0, True)]}])
    envs.step(["a"])
    envs.step(["a"])
    np.testing.assert_allclose(envs.returns_B("discounted", 0.9), [1.0 + 0.9 * 2.0])


# ---- the parser ------------------------------------------------------------------------

def test_parser_reads_the_documented_forms():
    qwen = call("calculator", expression="12*34")
    hf = '<tool_call>{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}</tool_call>'
    openai = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
    llama = '<tool_call>{"name": "f", "parameters": {"x": 3}}</tool_call>'
    got = parse_tool_calls(f"think... {qwen} then {hf}{openai}{llama} done")
    assert got == [ToolCall("calculator", {"expression": "12*34"}), ToolCall("f", {"x": 1}),
                   ToolCall("f", {"x": 2}), ToolCall("f", {"x": 3})]
    assert got[1].to_message() == {"type": "function", "function": {"name": "f",
                                                                    "arguments": {"x": 1}}}
    assert parse_tool_calls("no calls here") == [] and parse_tool_calls(None) == []


@pytest.mark.parametrize("body, message", [
    ("{bad json", "not valid JSON"),
    ('{"name": "f", "arguments": {"x": NaN}}', "not valid JSON"),
    ('{"name": "f", "arguments": {"x": 1e999}}', "not valid JSON"),
    ('{"name": "f", "arguments": {"x": ' + "1" * 3990 + "}}", "at most 4000 are read"),
    ('[1, 2]', "must be a JSON object"),
    ('{"arguments": {}}', '"name"'),
    ('{"name": "rm -rf /", "arguments": {}}', '"name"'),
    ('{"name": "f", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "f", "arguments": "not json"}', '"arguments" must be a JSON object'),
    ('{"name": "f", "arguments": ' + "[" * 100 + "]" * 100 + "}", "nests deeper than 16"),
    ('{"name": "f", "arguments": {"s": "' + "a" * 5000 + '"}}', "at most 4000 are read"),
])
def test_parser_turns_malformed_calls_into_errors(body, message):
    [err] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(err, ToolCallError) and message in err.message, err


def test_parser_refuses_integers_past_pythons_digit_limit():
    body = '{"name": "f", "arguments": {"x": ' + "1" * 5000 + "}}"
    [err] = parse_tool_calls(f"<tool_call>{body}</tool_call>", ToolFormat(max_call_chars=9000))
    assert "not valid JSON" in err.message


def test_parser_bounds_the_number_of_calls_and_unclosed_calls():
    fmt = ToolFormat(max_calls=2)
    got = parse_tool_calls(call("f") * 5, fmt)
    assert got[:2] == [ToolCall("f", {})] * 2 and "3 more tool calls" in got[2].message
    got = parse_tool_calls(call("f") + "<tool_call>{" + "x" * 200_000)
    assert got[0] == ToolCall("f", {}) and "never closed" in got[1].message
    with pytest.raises(ValueError, match="ToolFormat.max_calls must be an int >= 1"):
        ToolFormat(max_calls=0)


_pieces = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\",
                           '"name"', '"arguments"', ":", ",", '"f"', "1e9999", "null"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(_pieces, st.text(max_size=8)), max_size=60))
def test_parser_never_raises_on_hostile_text(parts):
    got = parse_tool_calls("".join(parts))
    assert len(got) <= ToolFormat().max_calls + 1
    for c in got:
        assert isinstance(c, ToolCallError) or (isinstance(c, ToolCall)
                                                and isinstance(c.arguments, dict))


def test_parser_on_megabytes_returns_quickly():
    t0 = time.monotonic()
    for text in ["<tool_call>" * 200_000, "{" * 2_000_000, "<tool_call>" + "[" * 3999 + "</tool_call>"]:
        parse_tool_calls(text)
    assert time.monotonic() - t0 < 5.0  # a hang guard, not a speed test


# ---- tools in worker processes ---------------------------------------------------------

def test_each_tool_failure_becomes_an_error_result(pool):
    reg = ToolRegistry([_tools.Hang(), _tools.Raise(size=10_000_000), _tools.Huge(),
                        _tools.NotText(), _tools.Echo(), _tools.Exit()])
    calls = [ToolCall("hang", {}), ToolCall("raise", {}), ToolCall("huge", {}),
             ToolCall("number", {}), ToolCall("echo", {"text": "hi"}), ToolCall("nope", {}),
             ToolCallError("bad json"), ToolCall("exit", {})]
    t0 = time.monotonic()
    got = run_tool_calls(pool, [(reg, c) for c in calls], timeout_s=0.3,
                         max_result_chars=1000, max_error_chars=200)
    assert time.monotonic() - t0 < 30.0  # the hang was stopped by its time limit
    assert [r.kind for r in got] == ["timeout", "raised", "too_large", "bad_result", None,
                                     "unknown_tool", "parse", "raised"]
    assert "worker process died" in got[7].content
    assert got[4].ok and got[4].content == "hi"
    assert all(len(r.content) <= 200 for r in got if not r.ok)
    assert "boom!!!" in got[1].content and "truncated" in got[1].content
    assert "10000000 characters" in got[2].content and "tools: hang, raise" in got[5].content
    again = run_tool_calls(pool, [(reg, ToolCall("echo", {"text": "still here"}))],
                           timeout_s=5, max_result_chars=1000)
    assert again[0].content == "still here"  # the killed worker was replaced


def test_hostile_tools_end_the_turn_and_the_run_goes_on(pool):
    limits = EnvLimits(max_turns=4, max_obs_tokens=400, tool_timeout_s=0.5,
                       max_tool_error_chars=120)
    envs = EnvBatch(HostileToolsEnv, encode, limits, pool=pool)
    envs.reset([{}, {}, {}])
    out = envs.step([call("hang"), call("huge") + call("raise"), call("echo", text="ok")])
    assert not out.done_B.any()
    assert "time limit" in out.observations[0] and "10000000 characters" in out.observations[1]
    assert all(len(o) < 400 for o in out.observations)
    assert out.observations[2] == "<tool_response>\nok\n</tool_response>\n"
    out = envs.step(["stop"] * 3)
    assert out.all_done and out.rewards_B.tolist() == [1.0] * 3
    assert [envs.info(i)["tool_errors"] for i in range(3)] == [1, 2, 0]
    assert [envs.info(i)["tool_timeouts"] for i in range(3)] == [1, 0, 0]  # the hang only
    assert envs.metrics()["env/tool_calls"] == (4.0, 3)
    assert envs.metrics()["env/tool_timeouts"] == (1.0, 3)
    assert envs.info(0)["tool_s"] > 0.4 and envs.info(0)["env_s"] >= 0


# ---- the calculator --------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.integers(-10**30, 10**30), st.integers(-10**30, 10**30))
def test_calculator_is_exact(a, b):
    assert calculate(f"{a} * {b}") == str(a * b)
    assert calculate(f"{a} + ({b}) - 7") == str(a + b - 7)
    if b:
        assert calculate(f"{a} // ({b})") == str(a // b)
        assert calculate(f"{a} % ({b})") == str(a % b)
        q = Fraction(a, b)
        assert calculate(f"{a} / ({b})") == (str(q.numerator) if q.denominator == 1
                                             else format(float(q), ".15g"))


def test_calculator_examples():
    assert calculate("2 ** 10 - -3") == "1027" and calculate("1/3") == "0.333333333333333"
    assert calculate("0.1 + 0.2") == "0.3" and calculate("2**-2") == "0.25"
    assert calculate("(1 + 2) * 3 % 4") == "1" and calculate("+-+5") == "-5"
    assert calculate("1 / 10**400") == "1/1" + "0" * 400  # under a float's range: exact


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')", "().__class__", "x + 1", "abs(-1)", "[1, 2]",
    "'a' * 3", "b'x'", "1j", "True + 1", "1 < 2", "1 and 2", "lambda: 1", "1 if 1 else 2",
    "9 ** 9 ** 9", "2 ** 5000", "10 ** 1001", "2 ** 0.5", "1 / 0", "5 % 0", "0 ** -1",
    "1e999", "1 << 9", "1 & 3", "1; 2", "", "(" * 150 + "1" + ")" * 150, "1" * 201,
    "[x for x in ()]", "(9**999)**9",
])
def test_calculator_refuses_everything_but_bounded_arithmetic(expr):
    t0 = time.monotonic()
    with pytest.raises(CalculatorError):
        calculate(expr)
    assert time.monotonic() - t0 < 2.0  # a hang guard
    with pytest.raises(CalculatorError, match="must be a string"):
        calculate(12)


_calc_pieces = st.sampled_from(["1", "9", "0", "0.5", "1e300", "999", "*", "**", "-", "+",
                                "/", "//", "%", "(", ")", " ", "e", "_", "j"])


@settings(max_examples=100, deadline=None)
@given(st.lists(_calc_pieces, max_size=40))
def test_calculator_answers_or_refuses_any_token_soup(parts):
    try:
        out = calculate("".join(parts))
    except CalculatorError:
        return
    assert isinstance(out, str) and len(out) < 2000


def test_registry_and_schemas():
    reg = ToolRegistry([Calculator()])
    [schema] = reg.schemas()
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolRegistry([Calculator(), Calculator()])
    with pytest.raises(ValueError, match="tool name 'a b' is not allowed"):
        ToolRegistry([Calculator(name="a b")])
    with pytest.raises(TypeError, match="is not a Tool"):
        ToolRegistry([print])


# ---- a scripted episode end to end -----------------------------------------------------

def test_scripted_arithmetic_episode_end_to_end(pool):
    rows = arithmetic_tool_rows(ArithmeticTask(digits=4, ops=("*",)), 4, seed=0)
    a, b = rows[0]["prompt"].rstrip("=").split("*")
    limits = EnvLimits(max_turns=3, max_obs_tokens=200, max_total_tokens=1000)
    envs = EnvBatch(ArithmeticToolEnv, encode, limits, pool=pool)
    first = envs.reset(rows)
    assert envs.stop_strings == ("</tool_call>", "</answer>")
    assert f"Solve {a}*{b}." in first.observations[0] and "<tool_call>" in first.observations[0]
    turn1 = [f"I will compute it. {call('calculator', expression=f'{a} * {b}')}",
             f"<answer>{rows[1]['answer']}</answer>",              # right without the tool
             f"<answer>{a}*{b}</answer>",                           # the question copied
             '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}'
             '</tool_call>']
    out = envs.step(turn1)
    assert out.observations[0] == f"<tool_response>\n{rows[0]['answer']}\n</tool_response>\n"
    assert out.done_B.tolist() == [False, True, True, False]
    assert out.rewards_B.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert "error: tool 'calculator' failed: CalculatorError" in out.observations[3]
    out = envs.step([f"So it is <answer>{rows[0]['answer']}</answer>", "", "", "hmm"])
    assert out.rewards_B.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert "No tool call or answer" in out.observations[3]
    out = envs.step(["", "", "", "<answer>0</answer>"])
    assert out.all_done
    np.testing.assert_array_equal(envs.returns_B(), [1.0, 1.0, 0.0, 0.0])
    assert [envs.info(i)["tool_calls"] for i in range(4)] == [1, 0, 0, 1]
    assert [envs.info(i)["tool_errors"] for i in range(4)] == [0, 0, 0, 1]
    assert envs.info(3)["turns"] == 3 and envs.info(3)["truncated"] is None
    control = EnvBatch(lambda: ArithmeticToolEnv(tools=ToolRegistry()), encode, limits, pool=pool)
    control.reset(rows[:1])
    assert "there is no tool 'calculator'" in control.step(turn1[:1]).observations[0]


_turn_pieces = st.sampled_from([
    call("calculator", expression="12*34"), call("calculator", expression="2**99999"),
    call("calculator"), call("nope"), "<tool_call>", "</tool_call>", "<tool_call>{]</tool_call>",
    "<answer>408</answer>", "<answer>", "</answer>", "<answer>12*34</answer>", "x" * 300, "é"])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.lists(_turn_pieces, max_size=4).map("".join), min_size=3,
                         max_size=3), min_size=1, max_size=4))
def test_hostile_turns_keep_every_limit(pool, turns_TxB):
    limits = EnvLimits(max_turns=3, max_obs_tokens=300, max_total_tokens=900,
                       tool_timeout_s=5.0)
    envs = EnvBatch(ArithmeticToolEnv, encode, limits, pool=pool)
    out = envs.reset([{"prompt": "12*34=", "answer": "408"}] * 3)
    for texts in turns_TxB:
        was_done = out.done_B
        out = envs.step(texts)
        assert (out.done_B >= was_done).all() and not out.rewards_B[was_done].any()
        assert out.observation_ids == [encode(o) for o in out.observations]
        assert all(len(i) <= limits.max_obs_tokens for i in out.observation_ids)
    for i in range(3):
        info = envs.info(i)
        assert info["turns"] <= limits.max_turns  # a row only passes the total by its last turn:
        assert info["tokens"] < limits.max_total_tokens or info["done"]  # the rollout bounds it
        assert set(info["rewards"]) <= {0.0, 1.0} and info["tool_errors"] <= info["tool_calls"]
    assert ((envs.remaining_tokens_B() > 0) == ~out.done_B).all()
