"""Resumable shuffled iterator, length policy, chat prompts, difficulty tracking."""

import json
import logging

import numpy as np
import pytest

from rljax import data as D


def test_iterator_deterministic_and_epoch_permutations():
    src = list(range(10))
    a, b = D.ShuffledIterator(src, seed=3), D.ShuffledIterator(src, seed=3)
    seq_a = a.next_batch(35)
    assert seq_a == b.next_batch(35)
    assert seq_a != D.ShuffledIterator(src, seed=4).next_batch(35)
    for e in range(3):  # every epoch is a permutation of the whole source
        assert sorted(seq_a[10 * e:10 * e + 10]) == src
    assert seq_a[:10] != seq_a[10:20]  # a fresh order each epoch
    assert a.epoch == 3
    assert D.ShuffledIterator(src, seed=3, shuffle=False).next_batch(12) == src + [0, 1]


@pytest.mark.parametrize("cut", [0, 4, 10, 17, 23])
def test_iterator_resume_matches_uninterrupted(cut):
    src = [f"p{i}" for i in range(7)]
    ref = D.ShuffledIterator(src, seed=11).next_batch(40)
    it = D.ShuffledIterator(src, seed=11)
    first = it.next_batch(cut)
    saved = json.loads(json.dumps(it.state().to_dict()))  # through a checkpoint file
    fresh = D.ShuffledIterator(src, seed=0)
    fresh.restore(saved)
    assert first + fresh.next_batch(40 - cut) == ref
    fresh2 = D.ShuffledIterator(src, seed=0)
    fresh2.restore(D.IteratorState.from_dict(saved))
    assert [next(fresh2) for _ in range(3)] == ref[cut:cut + 3]


def test_iterator_bad_input():
    with pytest.raises(ValueError, match="empty"):
        D.ShuffledIterator([], seed=0)
    with pytest.raises(ValueError, match="seed"):
        D.ShuffledIterator([1], seed=-1)
    with pytest.raises(TypeError, match="len"):
        D.ShuffledIterator(iter([1, 2]), seed=0)
    it = D.ShuffledIterator([1, 2, 3], seed=0)
    with pytest.raises(ValueError, match="saved for a source of 5 items, this source has 3"):
        it.restore(D.IteratorState(seed=0, epoch=0, position=1, size=5))
    with pytest.raises(ValueError, match="missing keys \\['size'\\]"):
        D.IteratorState.from_dict({"seed": 0, "epoch": 0, "position": 0})


def test_length_filter_counts_and_reports(caplog):
    recs = [{"prompt_ids": list(range(n)), "source": f"f:{i}"} for i, n in
            enumerate([3, 9, 5, 12, 1])]
    with caplog.at_level(logging.WARNING):
        kept, rep = D.filter_by_length(recs, D.LengthPolicy(max_tokens=5))
    assert [len(r["prompt_ids"]) for r in kept] == [3, 5, 1]
    assert (rep.total, rep.kept, rep.over_limit, rep.dropped, rep.max_length) == \
        (5, 3, 2, (1, 3), 12)
    assert "2/5 prompts over 5 tokens" in caplog.text and "2 dropped" in str(rep)
    kept, rep = D.filter_by_length(recs, D.LengthPolicy(5, action="truncate_left"))
    assert len(kept) == 5 and rep.truncated == (1, 3)
    assert kept[1]["prompt_ids"] == [4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match=r"prompt 1 \(f:1\) has 9 tokens > max_tokens=5"):
        D.filter_by_length(recs, D.LengthPolicy(5, action="error"))
    kept, rep = D.filter_by_length([{"t": "abcdef"}, {"t": "ab"}], D.LengthPolicy(3),
                                   length_fn=lambda r: len(r["t"]))
    assert rep.dropped == (0,) and kept == [{"t": "ab"}]
    with pytest.raises(ValueError, match="action must be one of"):
        D.LengthPolicy(5, action="skip")
    with pytest.raises(ValueError, match="no 'prompt_ids' field"):
        D.filter_by_length([{"x": 1}], D.LengthPolicy(5))


class TemplateTokenizer:
    """Duck-typed tokenizer: anything with apply_chat_template works."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert tokenize is False
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


def test_chat_prompts_duck_typed():
    tok = TemplateTokenizer()
    assert D.build_chat_prompt(tok, "2+2?", system="Be brief.", assistant_prefix="<think>") \
        == "<|system|>Be brief.<|end|><|user|>2+2?<|end|><|assistant|><think>"
    recs = D.build_chat_prompts([{"prompt": "hi", "answer": "1"}], tok)
    assert recs[0]["prompt_text"] == "<|user|>hi<|end|><|assistant|>" and recs[0]["answer"] == "1"
    with pytest.raises(TypeError, match="apply_chat_template"):
        D.build_chat_prompt(object(), "hi")
    with pytest.raises(ValueError, match="record 0 .* no 'prompt' field"):
        D.build_chat_prompts([{"question": "hi"}], tok)


def test_chat_prompt_with_a_real_hf_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "hi": 1}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    assert D.build_chat_prompt(tok, "hi") == "<user>hi\n<assistant>"


def test_mixed_group_prob_matches_the_seed():
    # seed: groups of 8 -> 0 (never solved), 0.99 (half), 0.34 (95%)
    assert D.mixed_group_prob(0.0, 8) == 0.0
    assert round(D.mixed_group_prob(0.5, 8), 2) == 0.99
    assert round(D.mixed_group_prob(0.95, 8), 2) == 0.34
    np.testing.assert_allclose(D.mixed_group_prob(np.array([0.0, 1.0]), 4), [0.0, 0.0])
    with pytest.raises(ValueError, match="group_size"):
        D.mixed_group_prob(0.5, 0)


def test_difficulty_tracker_skips_no_signal_prompts_then_rechecks():
    tr = D.DifficultyTracker(group_size=8, ema=0.5, min_mixed_prob=0.5, max_skips=2)
    assert tr.pass_rate("new") is None and not tr.should_skip("new")
    tr.update_batch(["easy", "edge", "hard"],
                    np.concatenate([np.ones(8), [1, 0] * 4, np.zeros(8)]))
    assert tr.pass_rate("easy") == 1.0 and tr.pass_rate("edge") == 0.5
    assert tr.mixed_prob("edge") == pytest.approx(1 - 2 * 0.5 ** 8)
    assert tr.select(["easy", "edge", "hard", "new"]) == (["edge", "new"], ["easy", "hard"])
    assert tr.should_skip("hard")  # second consecutive skip
    assert not tr.should_skip("hard")  # max_skips reached: let through to re-measure
    tr.update("hard", [1, 1, 1, 1, 0, 0, 0, 0])
    assert tr.pass_rate("hard") == pytest.approx(0.25)  # EMA: 0.5*0 + 0.5*0.5
    snap = json.loads(json.dumps(tr.state_dict()))
    tr2 = D.DifficultyTracker(group_size=8, min_mixed_prob=0.5)
    tr2.load_state_dict(snap)
    assert tr2.pass_rate("hard") == tr.pass_rate("hard")
    assert not D.DifficultyTracker(group_size=8).should_skip("easy")  # threshold 0: never
    with pytest.raises(ValueError, match="rewards for 'x'"):
        tr.update("x", [np.nan])
    with pytest.raises(ValueError, match="ema"):
        D.DifficultyTracker(group_size=8, ema=0.0)
