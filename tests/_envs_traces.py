"""SFT warm-up on multi-turn tool-use traces (``rljax.envs.tool_use_trace``,
``rljax.train.encode_traces``, the SFT loss's loss mask); collected through
tests/test_envs.py, which imports these tests."""

import numpy as np
import pytest

from rljax.data import ArithmeticTask
from rljax.envs import (ArithmeticToolEnv, ToolCall, ToolRegistry, ToolResult,
                        arithmetic_tool_rows, format_tool_results, parse_tool_calls,
                        tool_use_trace)


class _ByteTokenizer:
    """Byte ids folded into the tiny decoder's vocabulary; EOS is 1."""

    eos_token_id, pad_token_id = 1, 0

    def encode(self, text, add_special_tokens=False):
        from _train_common import VOCAB
        return [2 + b % (VOCAB - 2) for b in text.encode()]


def test_tool_use_trace_is_an_episode_the_environment_scores_correct():
    row = arithmetic_tool_rows(ArithmeticTask(digits=4, ops=("*",)), 1, seed=3)[0]
    prompt, segments = tool_use_trace(row)
    assert prompt == ArithmeticToolEnv().reset(row)
    (call_text, c), (obs, o), (answer, a) = segments
    assert (c, o, a) == (True, False, True)
    assert parse_tool_calls(call_text) == [ToolCall("calculator", {"expression": row["prompt"][:-1]})]
    assert obs == format_tool_results([ToolResult("calculator", True, row["answer"])])
    assert answer == f"<answer>{row['answer']}</answer>"
    with pytest.raises(ValueError, match="not a calculator expression"):
        tool_use_trace({"prompt": "twelve times three=", "answer": "36"})
    with pytest.raises(ValueError, match="offers no calculator"):
        tool_use_trace(row, ArithmeticToolEnv(tools=ToolRegistry()))
    short = ArithmeticToolEnv(instruction="{question}\n")
    assert tool_use_trace(row, short)[0] == row["prompt"][:-1] + ".\n"
    with pytest.raises(ValueError, match="with {question}"):
        ArithmeticToolEnv(instruction="Solve it.")


def test_encode_traces_masks_observations_and_sft_trains_only_the_model_turns():
    import jax
    from _train_common import tiny_model
    from rljax.train import encode_traces
    from rljax.train.config import SFTConfig
    from rljax.train.learn.logprobs import policy_logprobs
    from rljax.train.sft import sft_loss

    tok = _ByteTokenizer()
    rows = arithmetic_tool_rows(ArithmeticTask(digits=2, ops=("*",)), 2, seed=0)
    prompts, traces = zip(*[tool_use_trace(r) for r in rows])
    batch = encode_traces(tok, ["12*34=", "5*6="], traces, 8, 160)
    for i, trace in enumerate(traces):
        ids = [t for text, _ in trace for t in tok.encode(text)] + [1]
        trained = [float(k) for text, k in trace for _ in tok.encode(text)] + [1.0]
        np.testing.assert_array_equal(batch["completion_BxT"][i, :len(ids)], ids)  # no re-tokenising
        np.testing.assert_array_equal(batch["loss_mask_BxT"][i, :len(ids)], trained)
        assert batch["completion_mask_BxT"][i].sum() == len(ids)
        assert not batch["loss_mask_BxT"][i, len(ids):].any()
    assert 0 < batch["loss_mask_BxT"].sum() < batch["completion_mask_BxT"].sum()
    short = encode_traces(tok, ["1="], [traces[0]], 4, 10)  # truncated: loses its EOS
    assert short["loss_mask_BxT"].tolist() == [[1.0] * 10]
    with pytest.raises(ValueError, match="segment 0 is 'text'"):
        encode_traces(tok, ["1="], [["text"]], 4, 10)

    gd, st = tiny_model()
    cfg = SFTConfig()
    params = {"policy": st}
    arrays = {k: jax.numpy.asarray(v) for k, v in batch.items()}
    loss, count, _ = sft_loss(gd, params, arrays, chunk=cfg.logp_chunk)
    logp, _ = policy_logprobs(gd, st, arrays, chunk=cfg.logp_chunk)
    m = batch["loss_mask_BxT"]
    assert float(count) == m.sum()
    np.testing.assert_allclose(float(loss), -float(np.sum(np.asarray(logp) * m)), rtol=1e-6)
    # The observation's ids are attended to: changing one changes the trained tokens' loss.
    obs_at = int(np.argmax((batch["completion_mask_BxT"][0] > 0) & (m[0] == 0)))
    changed = dict(arrays, completion_BxT=arrays["completion_BxT"].at[0, obs_at].add(1))
    assert float(sft_loss(gd, params, changed, chunk=cfg.logp_chunk)[0]) != float(loss)
