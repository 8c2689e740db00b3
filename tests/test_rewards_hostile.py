"""Hostile model output: no exception escapes, no code runs, every call is bounded.

Each call runs under a SIGALRM hang guard of a few seconds (a guard against hangs, not a
speed assertion).
"""

import contextlib
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rljax import data as D
from rljax.run import tasks as T
from rljax import rewards as R
from rljax.rewards._latex import normalize_answer

GUARD_S = 5


@contextlib.contextmanager
def hang_guard(seconds=GUARD_S):
    def fire(*_):
        raise TimeoutError(f"call did not return within {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


ITEM_FNS = [
    R.MathAccuracy(), R.MathAccuracy(mode="last_number", strip_units=True),
    R.accuracy_plus_format(), R.FormatReward(), R.Verified(R.MathAccuracy()),
    R.ConstraintReward((R.WordCount(1, 50), R.IncludeKeywords(("a",)),
                        R.ForbiddenKeywords(("b",)), R.NoCommas(), R.AllLowercase(),
                        R.BulletCount(2), R.EndsWith("done"), R.ValidJson())),
    T.CountdownReward(), T.ArithmeticReward(), T.ArithmeticReward(style="word"),
]
META = {"answer": "42", "numbers": [1, 2, 3, 40], "target": 42}


def score_everything(text: str) -> None:
    """Every entry point that reads model output; all must return normally."""
    with hang_guard():
        answers = [R.extract_answer(text, mode=m) for m in R.EXTRACT_MODES]
        for a in answers + [text]:
            for ref in ("42", "\\frac{1}{2}", "-\\infty", "50\\%"):
                assert isinstance(R.math_equal(a, ref), bool)
                assert isinstance(R.math_equal(a, ref, strip_units=True), bool)
        assert isinstance(R.follows_format(text), bool)
        R.tagged_answer(text)
        for fn in ITEM_FNS:
            v = fn(text, META)
            assert isinstance(v, float)
        D.evaluate_equation(text)
        out = R.score_batch(ITEM_FNS, [text], [META])
        assert out.rewards.shape == (1,)


def marker_payloads(marker):
    m = str(marker)
    return [
        f"__import__('os').system('touch {m}')",
        f"\\boxed{{__import__('os').system('touch {m}')}}",
        f"#### __import__('os').system('touch {m}')",
        f"The answer is open('{m}', 'w').write('x')",
        f"<think>x</think><answer>exec(\"open('{m}','w')\")</answer>",
        f"\\boxed{{eval(\"open('{m}','w')\")}}",
        f"{{\"a\": \"__import__('os').system('touch {m}')\"}}",
    ]


HOSTILE = [
    "1e999999", "\\boxed{1e999999}", "\\boxed{2^2^2^2^2^2}", "2^2^2^2^2^2^2^2^2",
    "\\boxed{9^{9^{9^{9}}}}", "\\boxed{10^{10^{10}}}", "(" * 10_000 + "1" + ")" * 10_000,
    "\\boxed{" + "{" * 100_000, "}" * 100_000 + "\\boxed{1}", "\\frac" * 50_000,
    "\\boxed{" + "\\frac{1}{" * 5_000 + "2" + "}" * 5_000 + "}",
    "\\boxed{" + "1" * 999 + "}", "#### " + "9" * 1_000_000, "9" * 1_000_000,
    "-" * 1_000_000 + "1", "1," * 500_000, "\\boxed" * 200_000,
    "the answer is " * 100_000, "<think>" * 100_000 + "</answer>" * 100_000,
    "[" * 500_000 + "]" * 500_000, "{\"a\":" * 100_000, "\\text{" * 200_000,
    "a" * 1_000_000, "\u2212" * 1_000_000, "\\boxed{1/0}", "\\frac{1}{0}", "0^{-1}",
    "\\boxed{" + "1/" * 400 + "1}", "\\boxed{" + "9^" * 300 + "9}", "\x00\ud800\uffff",
    "\\left(" * 100_000, "$" * 1_000_000, "1.", ".", "e5", "1e", "1e-999999", "%%%",
]


@pytest.mark.parametrize("i", range(len(HOSTILE)))
def test_hostile_inputs(i):
    score_everything(HOSTILE[i])


def test_payloads_do_not_execute(tmp_path):
    marker = tmp_path / "PWNED"
    for p in marker_payloads(marker):
        score_everything(p)
        score_everything(p * 1000)
    assert not marker.exists()


FRAGMENTS = ["\\boxed{", "\\boxed ", "\\fbox{", "}", "{", "\\frac", "\\dfrac", "^", "^{",
             "1", "9", "0", ".", ",", "-", "\u2212", "+", "*", "/", "%", "\\%", "e", "E",
             "\\infty", "####", "the answer is", "\\text{", "\\left(", "\\right)", "(",
             ")", "$", "\\$", " ", "\n", "<think>", "</think>", "<answer>", "</answer>",
             "__import__('os')", "x=", "cm", "\\circ", "[", "]", "\"", "\\", "999999"]

hostile_text = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(FRAGMENTS), max_size=200).map("".join),
    st.tuples(st.sampled_from(FRAGMENTS), st.integers(1, 200_000)).map(lambda t: t[0] * t[1]),
)


@settings(deadline=None, max_examples=150, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_text)
def test_property_no_exception_escapes(text):
    score_everything(text)


@settings(deadline=None, max_examples=150, derandomize=True)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join),
       st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join))
def test_property_math_equal_symmetric_and_total(a, b):
    with hang_guard():
        ab, ba = R.math_equal(a, b), R.math_equal(b, a)
    assert ab == ba
    if not R.math_equal(a, a):
        # only inputs that normalise to nothing fail reflexivity
        assert normalize_answer(a) == "", a


def test_bounded_scan_still_finds_a_real_answer_after_megabytes():
    with hang_guard():
        long = "step. " * 200_000 + "So the answer is \\boxed{42}."
        assert R.MathAccuracy()(long, {"answer": "42"}) == 1.0
        assert R.extract_answer("9" * 1_000_000 + " #### 7") == "7"
        assert R.extract_answer("9" * 1_000_000, mode="last_number") is None  # too long
