"""The arithmetic device reward equals the host verifier on every completion."""

import itertools

import jax
import numpy as np
import pytest

from rljax.models.tokenizer import build_char_tokenizer
from rljax.rewards.device import CharTable
from rljax.run.tasks import ArithmeticDeviceReward, check_arithmetic
from rljax.train.batching import decode_completions

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
ANSWERS = ["46", "0", "198", "-12", "5", "100", "-7", "30"]


def _host(tokens, mask, answers, style):
    texts = decode_completions(TOK, tokens, mask, EOS)
    return np.array([check_arithmetic(t, a, style=style) for t, a in zip(texts, answers)])


def _device(reward, tokens, mask, answers):
    task = reward.task_arrays([{"answer": a} for a in answers])
    out = jax.jit(reward.__call__)(tokens, mask.astype(np.float32), task)
    return np.asarray(out) > 0


def _ids(chars):
    return [TOK.encode(c, add_special_tokens=False)[0] for c in chars] + [EOS, 0, 1]


@pytest.mark.parametrize("style", ["plain", "reversed"])
def test_every_completion_of_the_relevant_tokens(style):
    """All 4-token completions over digits, signs, spaces, a letter and the specials,
    each with every answer and every completion length: device == host."""
    reward = ArithmeticDeviceReward.from_tokenizer(TOK, 100, EOS, style=style)
    ids = _ids("0124689 \n+-a.")
    combos = np.array(list(itertools.product(ids, repeat=4)), np.int32)
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5, len(combos))
    mask = (np.arange(4)[None] < lengths[:, None])
    answers = [ANSWERS[i] for i in rng.integers(0, len(ANSWERS), len(combos))]
    want = _host(combos, mask, answers, style)
    got = _device(reward, combos, mask, answers)
    assert want.sum() > 100  # the set holds many correct answers, not only failures
    np.testing.assert_array_equal(got, want)


def test_random_completions_over_the_whole_vocabulary_and_long_texts():
    """Random 80-token completions (past the host's 64-character window) and short ones
    built around the answer: device == host."""
    reward = ArithmeticDeviceReward.from_tokenizer(TOK, 100, EOS)
    rng = np.random.default_rng(1)
    n = 4000
    answers = [str(int(x)) for x in rng.integers(-999, 10**6, n)]
    tokens = rng.integers(0, 100, (n, 80)).astype(np.int32)
    for i in range(0, n, 2):  # half the rows: whitespace, the answer, then noise
        pre = " " * int(rng.integers(0, 70)) + ("+" if rng.random() < 0.2 else "")
        ids = TOK.encode(pre + answers[i], add_special_tokens=False)[:80]
        tokens[i, :len(ids)] = ids
    mask = np.arange(80)[None] < rng.integers(0, 81, n)[:, None]
    want = _host(tokens, mask, answers, "plain")
    assert 0 < want.sum() < n
    np.testing.assert_array_equal(_device(reward, tokens, mask, answers), want)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="style"):
        ArithmeticDeviceReward.from_tokenizer(TOK, 100, EOS, style="word")
    reward = ArithmeticDeviceReward.from_tokenizer(TOK, 100, EOS)
    with pytest.raises(ValueError, match="answer '4.5'"):
        reward.task_arrays([{"answer": "4.5"}])
    with pytest.raises(KeyError, match="no 'answer'"):
        reward.task_arrays([{"x": 1}])


def test_byte_level_tokenizers_are_refused():
    class Merging:
        def decode(self, ids):
            return " ".join(str(i) for i in ids)

    with pytest.raises(ValueError, match="character tokenizer"):
        CharTable.from_tokenizer(Merging(), 5)


def test_rewards_built_alike_are_one_key():
    """A frozen value: rewards built alike compare and hash equal (trainers share their
    compiled programs, which JAX keys by the reward); other settings give another key."""
    a, b = (ArithmeticDeviceReward.from_tokenizer(TOK, 100, EOS) for _ in range(2))
    assert a is not b and a == b and hash(a) == hash(b)
    assert a != ArithmeticDeviceReward.from_tokenizer(TOK, 100, EOS, scale=2.0)
    assert a != ArithmeticDeviceReward.from_tokenizer(TOK, 101, EOS)  # another table
