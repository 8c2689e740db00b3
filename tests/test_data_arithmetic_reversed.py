"""The "reversed" arithmetic style: answer digits least-significant first, and a checker
that accepts exactly that form."""

import numpy as np
import pytest

import rljax.data as D
from rljax.run import tasks as T


def test_reversed_style_targets_and_checker_agree():
    task = D.ArithmeticTask(digits=3, ops=("+", "-"), style="reversed", nonnegative=False)
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = task.sample(rng)
        value = {"+": p.a + p.b, "-": p.a - p.b}[p.op]
        assert p.prompt == f"{p.a}{p.op}{p.b}=" and p.answer == str(value)
        assert p.solution == ("-" if value < 0 else "") + str(abs(value))[::-1]
        assert T.check_arithmetic(p.solution + "\n", p.answer, style="reversed")
        reward = T.ArithmeticReward(style="reversed")
        assert reward(p.solution, {"answer": p.answer}) == 1.0
        if p.solution != p.answer:  # the plain form is wrong in this style
            assert not T.check_arithmetic(p.answer, p.answer, style="reversed")


def test_reversed_checker_needs_written_out_zeros():
    assert T.check_arithmetic("003", "300", style="reversed")
    assert not T.check_arithmetic("03", "300", style="reversed")
    assert not T.check_arithmetic("3", "300", style="reversed")
    assert T.check_arithmetic("-21", "-12", style="reversed")
    assert not T.check_arithmetic("x975", "579", style="reversed")


def test_unknown_style_is_rejected_by_name():
    with pytest.raises(ValueError, match="style"):
        D.ArithmeticTask(style="backwards")
