"""IFEval-style constraints and the R1-Zero format reward: positive and negative cases."""

import pytest

from rljax import rewards as R

CASES = [
    # (constraint, satisfying text, violating text)
    (R.WordCount(min_words=3), "one two three", "one two"),
    (R.WordCount(max_words=2), "one two", "one two three"),
    (R.WordCount(2, 3), "a b c", "a b c d"),
    (R.IncludeKeywords(("paris", "eiffel tower")), "Paris has the Eiffel  tower? no: Eiffel Tower.",
     "Parisian eiffel"),
    (R.ForbiddenKeywords(("bad",)), "this is badminton", "that was Bad."),
    (R.NoCommas(), "no commas here.", "one, two"),
    (R.AllLowercase(), "all lower 123.", "Not lower"),
    (R.BulletCount(2), "intro\n* one\n  - two\nend", "* one\n* two\n* three"),
    (R.EndsWith("Is there anything else?"), "Done. Is there anything else?  \n",
     "Is there anything else? Yes."),
    (R.ValidJson(), '```json\n{"a": [1, 2, {"b": null}]}\n```', '{"a": 1,}'),
    (R.AllOf((R.NoCommas(), R.AllLowercase())), "fine text", "Fine text"),
    (R.AnyOf((R.NoCommas(), R.AllLowercase())), "Fine text", "Fine, text"),
]


@pytest.mark.parametrize("c,good,bad", CASES)
def test_positive_and_negative(c, good, bad):
    assert c.check(good), (c, good)
    assert not c.check(bad), (c, bad)
    assert isinstance(c.description, str) and c.description


def test_edge_cases():
    assert not R.AllLowercase().check("123")  # no letters at all
    assert not R.ValidJson().check("[" * 100 + "]" * 100)  # deeper than the bound
    assert R.ValidJson().check("[" * 10 + "]" * 10)
    assert not R.ValidJson(max_chars=10).check('{"a": "0123456789"}')
    assert not R.WordCount(max_words=5).check(None)
    assert R.BulletCount(0).check("no bullets")


def test_from_dict_and_bad_specs():
    c = R.constraint_from_dict({"type": "all_of", "constraints": [
        {"type": "word_count", "max_words": 4}, {"type": "include_keywords",
                                                  "keywords": ["cat"]}]})
    assert c.check("the cat sat") and not c.check("the dog sat")
    with pytest.raises(ValueError, match="unknown constraint type 'shout'"):
        R.constraint_from_dict({"type": "shout"})
    with pytest.raises(ValueError, match="unknown fields \\['words'\\]"):
        R.constraint_from_dict({"type": "word_count", "words": 3})
    with pytest.raises(ValueError, match="min_words"):
        R.WordCount(min_words=-1)
    with pytest.raises(ValueError, match="keywords"):
        R.IncludeKeywords("cat")
    with pytest.raises(ValueError, match="BulletCount.count"):
        R.BulletCount(-2)
    with pytest.raises(TypeError, match="no check"):
        R.AllOf(("not a constraint",))


def test_constraint_reward_from_metadata():
    fn = R.ConstraintReward()
    meta = {"constraints": [{"type": "no_commas"}, R.EndsWith("bye")]}
    assert fn("ok bye", meta) == 1.0 and fn("ok, bye", meta) == 0.0
    with pytest.raises(KeyError, match="constraints"):
        fn("x", {"answer": 1})


FMT_GOOD = [
    "<think>2+2 is 4</think><answer>4</answer>",
    "  <think>\nreason\n</think>\n<answer> 4 </answer>\n",
]
FMT_BAD = [
    "<think>r</think>", "<answer>4</answer>", "<think></think><answer>4</answer>",
    "<think>r</think><answer>4</answer> extra", "<think>r</think>x<answer>4</answer>",
    "pre <think>r</think><answer>4</answer>", "<answer>4</answer><think>r</think>",
    "<think>r</think><answer>4</answer><answer>5</answer>",
    "<think>r<think>r</think><answer>4</answer>", "<think>r</think><answer> </answer>",
]


def test_format_reward():
    for t in FMT_GOOD:
        assert R.format_reward(t) == 1.0, t
    for t in FMT_BAD:
        assert R.format_reward(t) == 0.0, t
    in_prompt = R.TagFormat(think_in_prompt=True)
    assert R.follows_format("reason</think><answer>4</answer>", in_prompt)
    assert not R.follows_format("<think>reason</think><answer>4</answer>", in_prompt)
    custom = R.TagFormat("<r>", "</r>", "<a>", "</a>", allow_trailing=True)
    assert R.follows_format("<r>x</r><a>1</a><|eos|>", custom)
    assert R.tagged_answer("<think>a</think><answer> 7 </answer>") == "7"
    with pytest.raises(ValueError, match="distinct"):
        R.TagFormat(answer_open="<think>")
    with pytest.raises(ValueError, match="think_close"):
        R.TagFormat(think_close="")


def test_accuracy_plus_format_and_tulu_scaling():
    fn = R.accuracy_plus_format(format_weight=0.1)
    meta = {"answer": "12"}
    assert fn("<think>3*4</think><answer>12</answer>", meta) == pytest.approx(1.1)
    assert fn("<think>3*4</think><answer>\\boxed{12}</answer>", meta) == pytest.approx(1.1)
    assert fn("<think>3*4</think><answer>13</answer>", meta) == pytest.approx(0.1)
    assert fn("<answer>12</answer> trailing", meta) == pytest.approx(1.0)
    assert fn("\\boxed{12}", meta) == 0.0  # the answer must be inside the tags
    tulu = R.Verified(R.MathAccuracy())
    assert tulu("\\boxed{12}", meta) == 10.0 and tulu("\\boxed{11}", meta) == 0.0
    with pytest.raises(ValueError, match="mode"):
        R.MathAccuracy(mode="first_number")
    with pytest.raises(ValueError, match="terms"):
        R.WeightedSum(((float("nan"), R.FormatReward()),))
