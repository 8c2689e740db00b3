"""score_batch: composition, error attribution, and time limits in a worker pool."""

import math
import os
import signal
import threading
import time

import numpy as np
import pytest

from rljax import rewards as R


def hangs_on_flag(completion, meta):
    """Module-level (so it pickles into a worker): sleeps far past any limit if asked."""
    if meta.get("hang"):
        time.sleep(60)
    return float(len(completion))


def raises_on_flag(completion, meta):
    if meta.get("boom"):
        raise RuntimeError("checker bug")
    return 1.0


def noisy(completion, meta):
    print("debug output that must not corrupt the result stream " * 50)
    return 2.0


def nan_on_flag(completion, meta):
    return math.nan if meta.get("nan") else 0.5


class LengthBatch:
    """A batch reward (like a learned reward model): called once with all completions."""

    is_batch_reward = True
    name = "length_batch"

    def __call__(self, completions, metadata):
        return np.array([len(c) for c in completions], np.float32)


class InfBatch(LengthBatch):
    def __call__(self, completions, metadata):
        return np.array([0.0, np.inf], np.float32)


COMPLETIONS = ["<think>a</think><answer>4</answer>", "<think>a</think><answer>5</answer>",
               "\\boxed{4}", "nothing"]
META = [{"answer": "4"}] * 4


def test_in_process_components_and_weights():
    fns = [R.MathAccuracy(answer_tags=R.TagFormat()), R.FormatReward(), LengthBatch()]
    out = R.score_batch(fns, COMPLETIONS, META, weights=[1.0, 0.5, 0.0])
    np.testing.assert_array_equal(out.components["math_accuracy"], [1, 0, 0, 0])
    np.testing.assert_array_equal(out.components["format"], [1, 1, 0, 0])
    np.testing.assert_array_equal(out.components["length_batch"], [len(c) for c in COMPLETIONS])
    np.testing.assert_allclose(out.rewards, [1.5, 0.5, 0.0, 0.0])
    assert out.rewards.dtype == np.float32 and out.timeouts == ()
    assert isinstance(LengthBatch(), R.BatchReward)
    batch_fn = R.batched(R.MathAccuracy())
    assert isinstance(batch_fn, R.RewardFn)
    np.testing.assert_array_equal(batch_fn(COMPLETIONS, META), [0, 0, 1, 0])


def test_duplicate_names_are_disambiguated():
    out = R.score_batch([R.FormatReward(), R.FormatReward()], COMPLETIONS[:1], META[:1])
    assert set(out.components) == {"format", "format_1"}


def test_errors_name_function_and_index():
    meta = [{}, {}, {"boom": 1}, {}]
    with pytest.raises(R.RewardError, match=r"'raises_on_flag' raised RuntimeError: checker "
                       r"bug at batch index 2 \(prompt index 1\)") as e:
        R.score_batch(raises_on_flag, COMPLETIONS, meta, group_size=2)
    assert e.value.index == 2 and e.value.fn == "raises_on_flag"
    with pytest.raises(R.RewardError, match="'nan_on_flag' returned non-finite nan at batch "
                       "index 3"):
        R.score_batch(nan_on_flag, COMPLETIONS, [{}, {}, {}, {"nan": 1}])
    with pytest.raises(R.RewardError, match="math_accuracy.*KeyError.*'answer'.*index 0"):
        R.score_batch(R.MathAccuracy(), COMPLETIONS, [{"solution": "4"}] * 4)
    with pytest.raises(R.RewardError, match=r"'length_batch' returned non-finite inf at "
                       r"batch index 1"):
        R.score_batch(InfBatch(), ["a", "b"], [{}, {}])
    with pytest.raises(R.RewardError, match="'x' \\(not a number\\)"):
        R.score_batch(lambda c, m: "x", ["a"], [{}])


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 completions but 1 metadata"):
        R.score_batch(R.FormatReward(), ["a", "b"], [{}])
    with pytest.raises(TypeError, match=r"completions\[1\] is bytes"):
        R.score_batch(R.FormatReward(), ["a", b"b"], [{}, {}])
    with pytest.raises(ValueError, match="weights"):
        R.score_batch([R.FormatReward()], ["a"], [{}], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="timeout_s needs a worker pool"):
        R.score_batch(R.FormatReward(), ["a"], [{}], timeout_s=1.0)
    with pytest.raises(TypeError, match="callable"):
        R.score_batch([], ["a"], [{}])
    with pytest.raises(ValueError, match="workers"):
        R.RewardPool(0)


def test_pool_abandons_hung_call_and_keeps_going():
    comps = ["aa", "bbb", "c", "dddd", "ee"]
    meta = [{}, {"hang": 1}, {}, {}, {}]
    with R.RewardPool(2) as pool:
        t0 = time.monotonic()
        out = R.score_batch([hangs_on_flag, R.FormatReward()], comps, meta, pool=pool,
                            timeout_s=1.0, group_size=1)
        assert time.monotonic() - t0 < 30  # hang guard: the 60 s sleep was abandoned
        np.testing.assert_array_equal(out.components["hangs_on_flag"], [2, 0, 1, 4, 2])
        assert [(t.index, t.fn) for t in out.timeouts] == [(1, "hangs_on_flag")]
        # the replaced worker serves the next batch; errors still name the index
        again = R.score_batch(hangs_on_flag, comps[:2], [{}, {}], pool=pool, timeout_s=5.0)
        np.testing.assert_array_equal(again.rewards, [2, 3])
        with pytest.raises(R.RewardError, match="exceeded 0.5s at batch index 1"):
            R.score_batch(hangs_on_flag, comps[:2], meta[:2], pool=pool, timeout_s=0.5,
                          timeout_reward=None)
        with pytest.raises(R.RewardError, match="raises_on_flag.*RuntimeError.*index 0"):
            R.score_batch(raises_on_flag, ["a"], [{"boom": 1}], pool=pool)
        with pytest.raises(R.RewardError, match="cannot send the call"):
            R.score_batch(lambda c, m: 1.0, ["a"], [{}], pool=pool)


def test_pool_survives_prints_and_a_dead_worker():
    with R.RewardPool(1) as pool:
        out = R.score_batch(noisy, ["a", "b"], [{}, {}], pool=pool)
        np.testing.assert_array_equal(out.rewards, [2, 2])
        pool._workers[0].proc.kill()  # dies while idle, e.g. killed by the OOM killer
        pool._workers[0].proc.wait()
        out = R.score_batch(noisy, ["a"], [{}], pool=pool, timeout_s=30.0)
        np.testing.assert_array_equal(out.rewards, [2])
    with pytest.raises(RuntimeError, match="closed"):
        pool.run([(noisy, "a", {})], None)


def sleeps_then_scores(completion, meta):
    time.sleep(meta.get("sleep", 0.0))
    return float(len(completion))


def test_workers_ignore_ctrl_c_from_their_start():
    """A terminal's Ctrl-C reaches every process of the group: a worker ignores it, also
    one that arrives while the worker is still starting (SIGINT blocked until ignored)."""
    with R.RewardPool(1) as pool:
        os.kill(pool._workers[0].proc.pid, signal.SIGINT)  # during its start-up
        out = R.score_batch(sleeps_then_scores, ["ab"], [{"sleep": 0.5}], pool=pool,
                            timeout_s=30.0)
        np.testing.assert_array_equal(out.rewards, [2])
        w = pool._workers[0]
        status = open(f"/proc/{w.proc.pid}/status").read()
        ignored = int(status.split("SigIgn:")[1].split()[0], 16)
        assert ignored & (1 << (signal.SIGINT - 1))  # ignored, not merely blocked
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # here
        tasks = [(sleeps_then_scores, "abc", {"sleep": 0.3})]
        threading.Timer(0.1, os.kill, (w.proc.pid, signal.SIGINT)).start()  # during a call
        assert pool.run(tasks, 30.0) == [("ok", 3.0)] and pool._workers[0] is w


def test_temporary_pool_from_workers_argument():
    out = R.score_batch([R.MathAccuracy(), hangs_on_flag], ["\\boxed{4}", "x"],
                        [{"answer": "4"}, {"answer": "4", "hang": 1}], workers=2,
                        timeout_s=2.0)
    np.testing.assert_array_equal(out.components["math_accuracy"], [1, 0])
    assert [t.index for t in out.timeouts] == [1]
