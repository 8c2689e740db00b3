"""Procedural tasks: arithmetic and Countdown generators (rljax.data), checkers and rewards
(rljax.run.tasks)."""

import numpy as np
import pytest

from rljax import data as D
from rljax.run import tasks as T
from rljax.rewards import score_batch


def test_arithmetic_plain_format_and_determinism():
    task = D.ArithmeticTask(digits=3, ops=("+",))
    probs = task.generate(50, seed=7)
    assert probs == task.generate(50, seed=7)
    assert probs != task.generate(50, seed=8)
    for p in probs:
        assert 100 <= p.a <= 999 and 100 <= p.b <= 999
        assert p.prompt == f"{p.a}+{p.b}=" and p.answer == str(p.a + p.b)
        assert T.check_arithmetic(p.answer, p.answer)
        assert T.check_arithmetic(f" {p.answer}\nmore text", p.answer)
        assert not T.check_arithmetic(p.answer + "0", p.answer)
        assert not T.check_arithmetic(str(int(p.answer) + 1), p.answer)


@pytest.mark.parametrize("digits", [1, 2, 5])
def test_arithmetic_all_ops_word_style(digits):
    task = D.ArithmeticTask(digits=digits, ops=("+", "-", "*", "/"), style="word")
    probs = task.generate(80, seed=0)
    assert {p.op for p in probs} == {"+", "-", "*", "/"}
    for p in probs:
        ops = {"+": lambda: p.a + p.b, "-": lambda: p.a - p.b, "*": lambda: p.a * p.b,
               "/": lambda: p.a // p.b}
        want = ops[p.op]()
        assert p.answer == str(want) and int(p.answer) >= 0
        if p.op == "/":
            assert p.a % p.b == 0
        # the worked solution passes its own checker, a wrong answer does not
        assert T.check_arithmetic(p.solution, p.answer, style="word")
        assert p.solution.endswith(f"#### {p.answer}")
        assert not T.check_arithmetic(f"#### {int(p.answer) + 1}", p.answer, style="word")


def test_arithmetic_reward_and_bad_config():
    probs = D.ArithmeticTask(digits=2).generate(4, seed=1)
    comps = [p.answer for p in probs[:2]] + ["nope", "-1"]
    out = score_batch(T.ArithmeticReward(), comps, [p.to_record() for p in probs])
    np.testing.assert_array_equal(out.rewards, [1, 1, 0, 0])
    for bad in (dict(digits=0), dict(digits=19), dict(ops=("%",)), dict(ops=()),
                dict(style="latex")):
        with pytest.raises(ValueError, match="ArithmeticTask"):
            D.ArithmeticTask(**bad)


def test_countdown_generated_problems_are_solvable():
    for n in (2, 3, 4, 6):
        task = D.CountdownTask(num_numbers=n, max_number=50, max_target=500)
        probs = task.generate(40, seed=n)
        assert probs == task.generate(40, seed=n)
        for p in probs:
            assert len(p["numbers"]) == n and 1 <= p["target"] <= 500
            assert all(1 <= x <= 50 for x in p["numbers"])
            assert D.check_countdown(p["solution"], p["numbers"], p["target"], use_all=True)


CHECKS = [
    ("(1 + 2) * 3", [1, 2, 3], 9, True),
    ("(1 + 2) * 3 = 9", [1, 2, 3], 9, True),
    ("3 × (2 + 1)", [1, 2, 3], 9, True),
    ("6 / 4 * 2", [2, 4, 6], 3, True),       # exact rationals: 1.5 * 2
    ("6 / 4", [4, 6], 1, False),             # 1.5 is not 1 (no integer division)
    ("3 * 3", [1, 2, 3], 9, False),          # 3 used twice
    ("1 + 2 + 3 + 4", [1, 2, 3], 10, False),  # 4 not given
    ("-1 + 10", [1, 10], 9, False),          # no unary minus
    ("10 - 1", [1, 10], 9, True),
    ("(1 + 2", [1, 2], 3, False), ("1 / 0", [1, 0], 1, False), ("", [1], 1, False),
    ("__import__('os').system('x')", [1], 1, False), ("1e3", [1, 3], 1000, False),
    ("2 ** 3", [2, 3], 8, False), ("(" * 40 + "1" + ")" * 40, [1], 1, False),
    ("(" * 20 + "1" + ")" * 20, [1], 1, True),
]


@pytest.mark.parametrize("eq,nums,target,want", CHECKS)
def test_countdown_checker(eq, nums, target, want):
    assert D.check_countdown(eq, nums, target) is want


def test_countdown_use_all_and_reward():
    assert D.check_countdown("1 + 2", [1, 2, 3], 3)
    assert not D.check_countdown("1 + 2", [1, 2, 3], 3, use_all=True)
    fn = T.CountdownReward()
    meta = {"numbers": [1, 2, 3], "target": 9}
    assert fn("<think>try</think><answer>(1 + 2) * 3</answer>", meta) == 1.0
    assert fn("<think>try</think><answer>1 + 2 * 3</answer>", meta) == pytest.approx(0.1)
    assert fn("(1 + 2) * 3", meta) == 0.0
    assert fn("x" * 1_000_000 + "<answer>(1+2)*3</answer>", meta) == 1.0
    assert fn("<answer>" + "(" * 100_000 + "</answer>", meta) == 0.0
    with pytest.raises(KeyError, match="target"):
        fn("<answer>1</answer>", {"numbers": [1]})
    with pytest.raises(ValueError, match="num_numbers"):
        D.CountdownTask(num_numbers=1)
