"""Chat templates for multi-turn episodes (rljax.envs.chat); collected through
tests/test_envs.py, which imports these tests (and gives them its `pool` fixture).

A byte-level BPE tokenizer is trained here in milliseconds (merges included, so token
boundaries matter) and given two templates written for these tests: `TOOL_TEMPLATE`
(ChatML turns, a tool list, assistant `tool_calls`, consecutive `tool` messages grouped
in one user turn) and `DROPS_REASONING`, the same but an assistant turn followed by a
later user message loses its `<think>...</think>` block: not prefix-stable."""

import json
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rljax.envs import (ArithmeticToolEnv, Calculator, ChatRenderer, ChatTemplateError,
                        EnvBatch, ToolCall, ToolCallError, ToolFormat, ToolRegistry,
                        observation_messages, parse_response_tool_calls, parse_tool_calls)
from rljax.envs.tools import ToolResult

__all__ = ["tool_tok", "test_tool_episode_is_token_exact_with_apply_chat_template",
           "test_template_that_drops_reasoning_keeps_the_sampled_ids",
           "test_env_batch_renders_prompts_and_tool_results_with_the_template",
           "test_observation_messages_and_clear_errors",
           "test_calls_read_by_the_tokenizers_response_parser"]

_BODY = r"""
{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}
{%- set rest = messages[1:] %}{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}
{%- if sys or tools %}{{- '<|im_start|>system\n' + sys }}
  {%- if tools %}{{- ('\n\n' if sys else '') + 'Tools:' }}
    {%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
    {{- '\nCall one as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>' }}
  {%- endif %}{{- '<|im_end|>\n' }}
{%- endif %}
{%- for m in rest %}
  {%- if m.role == 'assistant' %}{%- set content = m.content %}
    @@REASONING@@
    {{- '<|im_start|>assistant\n' + content }}
    {%- for c in m.tool_calls or [] %}
      {{- ('\n' if (content or not loop.first) else '') + '<tool_call>\n{"name": '
          + (c.function.name | tojson) + ', "arguments": ' + (c.function.arguments | tojson)
          + '}\n</tool_call>' }}
    {%- endfor %}{{- '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}
      {{- '<|im_start|>user' }}
    {%- endif %}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
TOOL_TEMPLATE = _BODY.replace("@@REASONING@@", "")
# An assistant turn with a later user message is rendered without its reasoning.
DROPS_REASONING = _BODY.replace("@@REASONING@@", r"""
    {%- set ns = namespace(later_user=false) %}
    {%- for n in rest[loop.index0 + 1:] %}
      {%- if n.role == 'user' %}{%- set ns.later_user = true %}{%- endif %}
    {%- endfor %}
    {%- if ns.later_user and '</think>' in content %}
      {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}""")

SYSTEM = "You are a careful assistant."
TOOLS = ToolRegistry([Calculator()])


def build_tokenizer(template):
    """A byte-level BPE trained on chat-like text; `<|im_end|>` is its EOS."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [TOOL_TEMPLATE, json.dumps(TOOLS.schemas()), SYSTEM,
              "<think>\nthe product first\n</think>\n<tool_call>\n"
              '{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>',
              "user assistant tool_response answer 408 413 What is 12*34+5?"] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tool_tok():
    return build_tokenizer(TOOL_TEMPLATE)


def hf_ids(tok, messages, gen=True):
    """What transformers gives: the reference every trajectory is checked against."""
    return list(tok.apply_chat_template(messages, tools=TOOLS.schemas(), tokenize=True,
                                        add_generation_prompt=gen, return_dict=False))


def call_text(expression):
    return ("<tool_call>\n" + json.dumps({"name": "calculator",
                                          "arguments": {"expression": expression}})
            + "\n</tool_call>")


def as_hf_assistant(text):
    """The model's turn as transformers' conversation holds it: content + tool_calls."""
    calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)]
    content = text.split("<tool_call>")[0].rstrip("\n") if calls else text
    msg = {"role": "assistant", "content": content}
    return {**msg, "tool_calls": [c.to_message() for c in calls]} if calls else msg


def tool_msg(content):
    return ToolResult("calculator", True, content).to_message()


# (the model's turn; does it end with the EOS token (else a stop string ended it); the
# environment's answer)
EPISODE = [
    ("I will use the calculator.\n" + call_text("12*34"), True, [tool_msg("408")]),
    (call_text("408+5") + "\n" + call_text("5+408"), False, [tool_msg("413"), tool_msg("413")]),
    ("Both give 413.", True, [{"role": "user", "content": "Answer in <answer> tags."}]),
]


def test_tool_episode_is_token_exact_with_apply_chat_template(tool_tok):
    r = ChatRenderer(tool_tok, system=SYSTEM)
    traj = r.start("What is 12*34+5?", TOOLS)
    hf = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12*34+5?"}]
    assert traj.ids == hf_ids(tool_tok, hf)
    pieces, sampled_all = list(traj.ids), []
    for text, eos, answer in EPISODE:
        sampled = r.encode(text) + ([tool_tok.eos_token_id] if eos else [])
        delta = r.next_turn(traj, sampled, answer)
        traj.extend(delta)
        hf += [as_hf_assistant(text), *answer]
        assert traj.ids == hf_ids(tool_tok, hf)
        assert delta.prefix_stable and delta.token_exact and traj.token_exact
        # a turn a stop string ended is closed by the delta; an EOS is not repeated
        assert (delta.ids[0] == tool_tok.eos_token_id) == (not eos)
        pieces += sampled + delta.ids
        sampled_all.append(sampled)
    assert traj.ids == pieces
    assert [i for i, m in zip(traj.ids, traj.loss_mask) if m] == sum(sampled_all, [])
    final = r.encode("<answer>413</answer>") + [tool_tok.eos_token_id]
    hf.append({"role": "assistant", "content": "<answer>413</answer>"})
    assert hf_ids(tool_tok, hf, gen=False)[:len(traj.ids) + len(final)] == traj.ids + final
    assert tool_tok.decode(traj.ids) == traj.text
    # a turn drawn as single bytes (not how the tokenizer splits its text): kept as drawn
    start = r.start("What is 12*34+5?", TOOLS)
    by_byte = [i for ch in call_text("1+1") for i in r.encode(ch)]
    assert by_byte != r.encode(call_text("1+1"))
    delta = r.next_turn(start, by_byte, [tool_msg("2")])
    start.extend(delta)
    assert delta.prefix_stable and not delta.token_exact
    assert start.ids == r.start("What is 12*34+5?", TOOLS).ids + by_byte + delta.ids
    assert start.text == tool_tok.decode(hf_ids(tool_tok, start.messages))


def strip_reasoning(text):
    """What DROPS_REASONING does to an earlier assistant turn, on the rendered text."""
    return re.sub(r"<think>.*?</think>\n*", "", text, flags=re.S)


def test_template_that_drops_reasoning_keeps_the_sampled_ids():
    tok = build_tokenizer(DROPS_REASONING)
    r = ChatRenderer(tok)
    traj = r.start("What is 12*34+5?", TOOLS)
    turns = [("<think>\nthe product first\n</think>\n" + call_text("12*34"), [tool_msg("408")]),
             ("<think>\nadd 5\n</think>\nIt is 413.", [{"role": "user", "content": "Sure?"}]),
             ("<think>\ncheck\n</think>\n" + call_text("12*34+5"), [tool_msg("413")])]
    pieces = list(traj.ids)
    stable = []
    for text, answer in turns:
        sampled = r.encode(text) + [tok.eos_token_id]
        delta = r.next_turn(traj, sampled, answer)
        traj.extend(delta)
        pieces += sampled + delta.ids
        stable.append(delta.prefix_stable)
        # the delta is the fresh render's tail after the model's last turn either way
        fresh = hf_ids(tok, traj.messages)
        assert fresh[len(fresh) - len(delta.ids):] == delta.ids
    # turn 1: no later user message, nothing dropped; turn 2's user message drops the
    # reasoning of turns 1 and 2 from a fresh render, so from then on the delta comes
    # from the new messages alone
    assert stable == [True, False, False] and not traj.prefix_stable
    assert traj.ids == pieces  # the sampled ids (reasoning included) plus the deltas
    fresh_text = tok.decode(hf_ids(tok, traj.messages))
    assert "the product first" in traj.text and "the product first" not in fresh_text
    last_turn = traj.text.rindex("<|im_start|>assistant\n<think>\ncheck")
    assert strip_reasoning(traj.text[:last_turn]) + traj.text[last_turn:] == fresh_text
    assert not traj.token_exact


def test_env_batch_renders_prompts_and_tool_results_with_the_template(tool_tok, pool):
    rows = [{"prompt": "12*34=", "answer": "408"}, {"prompt": "2*3=", "answer": "6"}]
    r = ChatRenderer(tool_tok)
    envs = EnvBatch(ArithmeticToolEnv, None, pool=pool, chat=r)
    first = envs.reset(rows)
    hf = [[{"role": "user", "content": ArithmeticToolEnv().reset(m)}] for m in rows]
    assert first.observation_ids == [hf_ids(tool_tok, h) for h in hf]
    texts = [call_text("12*34"), "<answer>7</answer>"]
    ids = [r.encode(t) + [tool_tok.eos_token_id] for t in texts]
    out = envs.step(texts, model_ids=[np.asarray(x, np.int32) for x in ids])  # as drawn
    assert out.done_B.tolist() == [False, True]
    assert envs.trajectory(1).ids == first.observation_ids[1]  # its last turn ended it
    hf[0] += [as_hf_assistant(texts[0]), tool_msg("408")]
    assert first.observation_ids[0] + ids[0] + out.observation_ids[0] == hf_ids(tool_tok, hf[0])
    assert envs.trajectory(0).ids == hf_ids(tool_tok, hf[0])
    assert out.observations[0] == tool_tok.decode(out.observation_ids[0])
    assert envs.info(0)["tokens"] == len(envs.trajectory(0).ids)
    with pytest.raises(ValueError, match="model_ids"):
        envs.step(["<answer>408</answer>", ""])


def test_observation_messages_and_clear_errors(tool_tok):
    res = [ToolResult("calculator", True, "6"), ToolResult("", False, "error: bad", "parse")]
    assert observation_messages("ignored", res) == [
        {"role": "tool", "name": "calculator", "content": "6"},
        {"role": "tool", "name": "", "content": "error: bad"}]
    assert observation_messages("Try again.") == [{"role": "user", "content": "Try again."}]
    no_template = build_tokenizer(None)
    with pytest.raises(ValueError, match="no chat_template"):
        ChatRenderer(no_template)
    with pytest.raises(TypeError, match="apply_chat_template"):
        ChatRenderer(object())
    r = ChatRenderer(tool_tok)
    traj = r.start("hi")
    with pytest.raises(ValueError, match="new_messages is empty"):
        r.next_turn(traj, [5], [])
    with pytest.raises(ValueError, match=r"new_messages\[0\]"):
        r.next_turn(traj, [5], [{"role": "tool"}])
    drops = build_tokenizer("{% for m in messages %}{% if m.role != 'assistant' %}"
                            "{{ m.content }}{% endif %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="0 times"):
        ChatRenderer(drops).next_turn(ChatRenderer(drops).start("hi"), [5], [tool_msg("1")])
    strict = build_tokenizer("{% for m in messages %}{% if m.role == 'tool' %}"
                             "{{ raise_exception('no tool role') }}{% endif %}"
                             "{{ m.content }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match=r"roles \['user', 'assistant', 'tool'\].*no tool"):
        ChatRenderer(strict).next_turn(ChatRenderer(strict).start("hi"), [5], [tool_msg("1")])
    with pytest.raises(TypeError, match="ChatRenderer"):
        EnvBatch(ArithmeticToolEnv, None, chat=tool_tok)


# transformers' response templates (tokenizer.response_template): the Hermes / Qwen tags
# of TOOL_TEMPLATE, and a Mistral-style `[TOOL_CALLS]` JSON list
HERMES_RESPONSE = {"start_anchor": "<|im_start|>assistant\n", "fields": {
    "content": {"close": "<|im_end|>"},
    "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json",
                   "repeats": True, "transform": {"type": "function", "function": "{content}"}}}}
LIST_RESPONSE = {"start_anchor": "<|im_start|>assistant\n", "fields": {
    "content": {},
    "tool_calls": {"open": "[TOOL_CALLS]", "content": "json", "transform_each": True,
                   "transform": {"type": "function", "function": {
                       "name": "{name}", "arguments": "{arguments}"}}}}}


def test_calls_read_by_the_tokenizers_response_parser():
    tok = build_tokenizer(TOOL_TEMPLATE)
    with pytest.raises(ValueError, match="no response_template"):
        parse_response_tool_calls(tok, "hi")
    tok.response_template = HERMES_RESPONSE
    text = "Let me.\n" + call_text("12*34") + "\n" + call_text("5+1") + "<|im_end|>"
    assert parse_response_tool_calls(tok, text) == parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "12*34"}),
        ToolCall("calculator", {"expression": "5+1"})]
    env = ArithmeticToolEnv()
    env.response_parser = tok
    assert env.tool_calls(text) == parse_tool_calls(text)
    tok.response_template = LIST_RESPONSE
    calls = json.dumps([{"name": "calculator", "arguments": {"expression": "2*3"}},
                        {"name": "bad name", "arguments": {}},
                        {"name": "calculator", "arguments": {"expression": "1"}}])
    got = parse_response_tool_calls(tok, "Sure. [TOOL_CALLS]" + calls, ToolFormat(max_calls=2))
    assert got[0] == ToolCall("calculator", {"expression": "2*3"})
    assert "name" in got[1].message and "1 more tool calls" in got[2].message
    assert parse_tool_calls("[TOOL_CALLS]" + calls) == []  # the tag format does not read it
    for body, message in [('[{"name": "c", "arguments": {"e": NaN}}]', "not JSON"),
                          ('[{"name": "c", "arguments": ' + "[" * 40 + "]" * 40 + "}]", "deeper"),
                          ('[{"name": "c", "arguments": "' + "y" * 5000 + '"}]',
                           "characters long"),
                          ("[{broken", "could not be read")]:
        (err,) = parse_response_tool_calls(tok, "[TOOL_CALLS]" + body)
        assert isinstance(err, ToolCallError) and message in err.message, (body[:40], err)
    for hostile in ["no calls", "", "[TOOL_CALLS]", "[TOOL_CALLS]" * 1000, "\x00\ud800]["]:
        assert all(isinstance(c, ToolCallError) for c in parse_response_tool_calls(tok, hostile))
    assert parse_response_tool_calls(tok, None) == []
