"""Any answer type (issue 59, item 3): `string_equal` beside `math_equal`, the verifier
chosen from a task's answers (or `reward.verifier`), `none` as None in `task.answer_field`,
and the start-up WARNING of a verifier that credits no worked answer."""

import json

import pytest

from rljax import rewards as R
from rljax.models import ModelConfig
from rljax.models.tokenizer import build_char_tokenizer
from rljax.run import builders
from rljax.run.experiment import ExperimentConfig, RunConfig, TaskConfig
from rljax.run.overrides import OverrideError, apply_overrides
from rljax.run.startup import verifier_warning
from rljax.train.config import RLConfig, SFTConfig

STRING_EQUAL = [("abcd", "abcd"), ("  ABCD ", "abcd"), ("abcd.", "abcd"), ('"abcd"', "abcd"),
                ("(B)", "B"), ("New   York", "new york"), ("Stra\u00dfe", "STRASSE"),
                ("\uff41bc", "abc"), ("it's", "It's"), ("42", 42), ("U.S.A.", "u.s.a")]
STRING_DIFFERENT = [("abdc", "abcd"), ("3.5", "35"), ("a-b", "ab"), ("its", "it's"),
                    ("USA", "U.S.A."), ("New York City", "new york"), ("", ""), (".", "..."),
                    (None, "a"), (b"abcd", "abcd"), ("a" * 1001, "a" * 1001)]


@pytest.mark.parametrize("pred, ref", STRING_EQUAL)
def test_string_equal(pred, ref):
    assert R.string_equal(pred, ref)


@pytest.mark.parametrize("pred, ref", STRING_DIFFERENT)
def test_string_different(pred, ref):
    assert not R.string_equal(pred, ref)


def test_string_accuracy_takes_a_marked_answer_or_the_whole_completion():
    acc, meta = R.StringAccuracy(), {"answer": "abcd"}
    assert acc("abcd", meta) == acc(" ABCD.\n", meta) == acc("so \\boxed{abcd}", meta) == 1.0
    assert acc("I sorted them: abcd", meta) == 0.0  # no marked answer: the whole text
    assert acc("the answer is abcd", meta) == 1.0
    assert R.StringAccuracy(mode="boxed")("abcd", meta) == 0.0  # "boxed" finds none
    with pytest.raises(ValueError, match="mode"):
        R.StringAccuracy(mode="whole")
    with pytest.raises(TypeError, match="reference"):
        R.string_equal("a", None)


def test_the_verifier_follows_the_answers():
    assert R.answer_verifier(["abcd", "xyz"]) == "string"
    assert R.answer_verifier(["abcd", "\\frac{1}{2}"]) == "math"  # MATH mixes both
    assert R.answer_verifier([3, "x"]) == "math" and R.answer_verifier([]) == "string"
    assert [R.is_number(a) for a in ("1,234", "50\\%", "4 2", "x+1", True)] == [
        True, True, False, False, False]


ROWS = [{"word": w, "answer": "".join(sorted(w))} for w in ("dcba", "cab", "zyx", "ba")]


@pytest.fixture
def data(tmp_path):
    def write(rows):
        for split in ("train", "test"):
            (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path)
    return write


MODEL = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1)


def _cfg(path, *sets):
    cfg = ExperimentConfig(
        model=MODEL, task=TaskConfig(name="jsonl", path=path, prompt_field="word", prompt_template="{word}=",
                        sft_template="{answer}", max_prompt_tokens=16),
        rl=RLConfig(eval_prompts=4), run=RunConfig(dir="runs/x"), sft=SFTConfig(steps=2))
    return apply_overrides(cfg, list(sets))


def _verifier(cfg):
    task = builders.build_task(cfg, build_char_tokenizer())
    _, accuracy_fn = builders.build_reward(cfg, task)
    return task, accuracy_fn


def test_string_answers_get_the_string_verifier(data):
    cfg = _cfg(data(ROWS))
    task, acc = _verifier(cfg)
    assert task.verifier == "string" and "StringAccuracy" in acc.name
    assert "reward.verifier='auto' -> 'string'" in acc.name
    assert acc("abcd", {"answer": "abcd"}) and not acc("dcba", {"answer": "abcd"})
    assert verifier_warning(cfg, task, acc) == []
    numeric = _cfg(data([{"word": "ab", "answer": "1,234"}]))
    task, acc = _verifier(numeric)
    assert task.verifier == "math" and "MathAccuracy" in acc.name
    assert acc("\\boxed{1234}", {"answer": "1,234"})


def test_a_verifier_that_credits_no_worked_answer_is_a_startup_warning(data):
    cfg = _cfg(data(ROWS), "reward.verifier=math")  # math on words: no boxed answer found
    task, acc = _verifier(cfg)
    assert task.verifier == "math"
    (line,) = verifier_warning(cfg, task, acc)
    assert line.startswith("WARNING: the verifier ") and "scores 0 on all 8 worked" in line
    assert "reward.verifier" in line
    no_sft = _cfg(data(ROWS), "reward.verifier=math", "sft=none")
    assert "on all 4 worked" in verifier_warning(no_sft, *_verifier(no_sft))[0]
    untemplated = _cfg(data(ROWS), "reward.verifier=math", "task.sft_template={solution}")
    assert verifier_warning(untemplated, *_verifier(untemplated)) == []  # nothing to check


def test_none_is_none_in_answer_field(data):
    path = data(ROWS)
    cfg = _cfg(path, "task.answer_field=none", "reward.function=my_reward:score")
    assert cfg.task.answer_field is None
    task = builders.build_task(cfg, build_char_tokenizer())
    # The file's own "answer" field stays in the metadata; it is not a reference answer.
    assert not task.has_answers and task.eval_metadata[0]["answer"] == "abcd"
    with pytest.raises(OverrideError, match=r"answer_field.*reward.kind='accuracy'"):
        _cfg(path, "task.answer_field=none")
    assert _cfg(path, "task.answer_field='none'").task.answer_field == "none"  # quoted: text
    with pytest.raises(OverrideError, match=r"verifier.*'auto' for task 'arithmetic'"):
        apply_overrides(ExperimentConfig(model=MODEL),
                        ["reward.verifier=string"])
    with pytest.raises(OverrideError, match="verifier.*one of"):
        _cfg(path, "reward.verifier=exact")
