"""Your data and your reward (docs/your-task.md): every record field reaches the reward and
the template, split files and their errors, a reward found as `python -m` finds it and
checked before the run directory exists, custom rewards cut at `reward.timeout_s` in the
worker pool, errors with the user's traceback and the prompt's file:line, and the
headline labelled with the function that computed it."""

import json
import logging
import textwrap

import numpy as np
import pytest

from rljax.models import ModelConfig
from rljax.models.tokenizer import build_char_tokenizer
from rljax.rewards import RewardError
from rljax.rewards.imported import ImportedFunction
from rljax.rewards.pooled import PooledBatchReward
from rljax.run import builders
from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig
from rljax.run.overrides import OverrideError, apply_overrides
from rljax.run.report import format_summary
from rljax.run.runner import run_experiment
from rljax.run.user_reward import shared_reward_pool
from rljax.train.config import RLConfig
from rljax.rewards.pooled import score_batch_fn

REWARD = textwrap.dedent('''
    import time

    def score(completions, metadata):
        """Batch reward from an extra field: the completion's length times the weight."""
        return [len(c) * m["weight"] for c, m in zip(completions, metadata)]

    def item(completion, meta):
        return float(meta["weight"])

    def slow(completions, metadata):
        time.sleep(30)  # a reward that hangs

    def slow_item(completion, meta):
        if meta["weight"] > 2:
            time.sleep(30)
        return 1.0

    def broken(completions, metadata):
        return [helper(m) for m in metadata]

    def helper(meta):
        return 1.0 / (meta["weight"] - 3)  # ZeroDivisionError on weight 3

    class Terms:
        """A batch reward that reports two terms (logged as reward/<term>)."""

        def __call__(self, completions, metadata):
            self.last_components = {"weight": [m["weight"] for m in metadata],
                                    "length": [len(c) for c in completions]}
            return [0.0] * len(completions)

    terms = Terms()
''')
ROWS = [{"q": f"{i}+1", "weight": i, "level": "ok" if i < 3 else "hard"} for i in range(1, 6)]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder as a user has it: data/, my_reward.py, run from there (no PYTHONPATH)."""
    (tmp_path / "data").mkdir()
    for name, rows in (("train", ROWS), ("test", ROWS[:2])):
        (tmp_path / "data" / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cfg(**task):
    t = dict(name="jsonl", path="data", prompt_field="q", prompt_template="{level}: {q}=",
             max_prompt_tokens=12)
    t.update(task)
    return ExperimentConfig(
        model=ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1),
        task=TaskConfig(**t), reward=RewardConfig(function="my_reward:score"),
        rl=RLConfig(eval_prompts=2), run=RunConfig(dir="runs/x"))


def test_every_field_reaches_metadata_and_template_answer_optional(work, caplog):
    with caplog.at_level(logging.WARNING):
        task = builders.build_task(_cfg(), build_char_tokenizer())
    texts, meta = task.train(0, 5)
    by_q = {m["q"]: (t, m) for t, m in zip(texts, meta)}
    text, m = by_q["4+1"]
    assert text == "hard: 4+1=" and m["weight"] == 4 and m["source"] == "data/train.jsonl:4"
    assert not task.has_answers and "answer" not in m
    # Per split: records, drops (prompts over 12 tokens: "hard: N+1=" has 10), kept.
    assert task.splits["train"] == dict(file="data/train.jsonl", records=5, kept=5, dropped=0,
                                        longest=10, limit=12)
    short = builders.build_task(_cfg(max_prompt_tokens=9), build_char_tokenizer())
    assert short.splits["train"]["dropped"] == 3 and short.splits["test"]["dropped"] == 0
    warned = [r.getMessage() for r in caplog.records if "over 9 tokens" in r.getMessage()]
    assert warned == ["split 'train': 3/5 prompts over 9 tokens (longest 10): 3 dropped, "
                      "0 truncated, 2 kept"]
    # A reward that checks answers needs them, and says where one is missing.
    cfg = apply_overrides(_cfg(), ["reward.function=none", "reward.kind=accuracy"])
    with pytest.raises(ValueError, match=r"data/train.jsonl:1: no field 'answer' "
                       r"\(task.answer_field\).*reward.kind='accuracy'"):
        builders.build_task(cfg, build_char_tokenizer())


def test_split_files_and_what_their_errors_say(work):
    tok = build_char_tokenizer()
    one = _cfg(path="data/train.jsonl")  # one file, eval_split "test" by default
    with pytest.raises(ValueError, match="is one file, so task.eval_split='test' names no "
                       "split of it: set task.eval_split to a file of held-out prompts"):
        builders.check_inputs(one)
    held = builders.build_task(_cfg(path="data/train.jsonl", eval_split="data/test.jsonl"), tok)
    assert [m["source"] for m in held.eval_metadata] == ["data/test.jsonl:1", "data/test.jsonl:2"]
    same = builders.build_task(_cfg(path="data/train.jsonl", eval_split="train"), tok)
    assert same.eval_metadata[0]["source"] == "data/train.jsonl:1" and len(same.splits) == 1
    with pytest.raises(FileNotFoundError, match=r"task.eval_split='dev': no file data/dev.jsonl "
                       r"\(the folder data holds \['test.jsonl', 'train.jsonl'\]\)"):
        builders.check_inputs(_cfg(eval_split="dev"))
    with pytest.raises(FileNotFoundError, match="task.path='nowhere' does not exist"):
        builders.check_inputs(_cfg(path="nowhere"))
    (work / "data" / "test.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"data/test.jsonl: no records \(the file is empty\)"):
        builders.build_task(_cfg(), tok)


def test_reward_function_implies_custom_and_refuses_conflicts():
    assert RewardConfig(function="m:f").kind == "custom"
    cfg = apply_overrides(_cfg(), ["reward.function=none", "reward.kind=accuracy"])
    assert apply_overrides(cfg, ["reward.function=my_reward:score"]).reward.kind == "custom"
    with pytest.raises(OverrideError, match=r"kind='format'.*'custom' when function is set"):
        apply_overrides(cfg, ["reward.function=my_reward:score", "reward.kind=format"])


def test_reward_found_from_the_current_directory_before_the_run_dir(work):
    reward, verifier = builders.build_reward(_cfg(), builders.build_task(_cfg(), build_char_tokenizer()))
    assert verifier is None  # no answers: nothing to verify
    assert reward.name == "my_reward:score" and reward.fn.search_dir == str(work)
    for function, match in (("my_rewrd:score", r"no module 'my_rewrd' in the current directory"),
                            ("my_reward:scor", r"has no callable 'scor'; its callables: .*'score'")):
        cfg = apply_overrides(_cfg(), [f"reward.function={function}"])
        with pytest.raises((ImportError, ValueError), match=match):
            run_experiment(cfg)
        assert not (work / "runs").exists()  # refused before anything was written
    (work / "bad_import.py").write_text("import os\nVALUE = os.environ['NO_SUCH_VAR_46']\n")
    with pytest.raises(ImportError, match=r"(?s)importing 'bad_import' failed.*bad_import.py\", "
                       r"line 2.*KeyError: 'NO_SUCH_VAR_46'"):
        ImportedFunction.of("bad_import:VALUE", "reward.function")


def test_custom_rewards_in_the_pool_time_out_and_name_the_prompt(work, caplog):
    meta = [{**r, "source": f"data/train.jsonl:{i + 1}"} for i, r in enumerate(ROWS)]
    texts = ["ab"] * len(meta)
    pool = lambda: shared_reward_pool(2)  # noqa: E731
    fn = ImportedFunction.of("my_reward:score")
    ok = PooledBatchReward(fn, pool, timeout_s=5.0)
    np.testing.assert_allclose(score_batch_fn(ok, texts, meta, 1), [2, 4, 6, 8, 10])
    assert ok.last_components == {}
    terms = PooledBatchReward(ImportedFunction.of("my_reward:terms"), pool, timeout_s=5.0)
    score_batch_fn(terms, texts, meta, 1)  # the worker's term values come back with it
    np.testing.assert_array_equal(terms.last_components["weight"], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(terms.last_components["length"], [2] * 5)
    hang = PooledBatchReward(ImportedFunction.of("my_reward:slow"), pool, timeout_s=0.5)
    with caplog.at_level(logging.WARNING):
        np.testing.assert_array_equal(score_batch_fn(hang, texts[:2], meta[:2], 1), [0, 0])
    assert hang.timeouts == 1 and any(
        "data/train.jsonl:1, data/train.jsonl:2" in r.getMessage() for r in caplog.records)
    broken = PooledBatchReward(ImportedFunction.of("my_reward:broken"), pool, timeout_s=5.0)
    with pytest.raises(RewardError, match=r"(?s)at the prompt at data/train.jsonl:3, batch "
                       r"index 2.*my_reward.py\", line \d+, in helper.*ZeroDivisionError") as e:
        score_batch_fn(broken, texts, meta, 1)
    assert e.value.index == 2
    # An item reward: one call per completion, the slow one cut, the rest scored.
    cfg = apply_overrides(_cfg(), ["reward.function=my_reward:slow_item",
                                   "reward.function_form=item", "reward.timeout_s=0.5"])
    item, _ = builders.build_reward(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        np.testing.assert_array_equal(item(texts, meta), [1, 1, 0, 0, 0])
    assert any("data/train.jsonl:3" in r.getMessage() for r in caplog.records)


def test_summary_names_what_computed_the_headline():
    text = format_summary(accuracy_before=0.1, accuracy_after=0.5, wall_s=3.0,
                          measured_by="rljax.rewards.MathAccuracy(mode='auto')")
    assert "accuracy by     : rljax.rewards.MathAccuracy(mode='auto')" in text
    assert text.splitlines()[-1] == "RESULT accuracy_before=0.1000 accuracy_after=0.5000 wall_s=3.0"
    text = format_summary(accuracy_before=2.5, accuracy_after=7.0, wall_s=3.0, metric="reward",
                          measured_by="my_reward:score (held-out mean; no verifier)")
    assert text.splitlines()[-1] == "RESULT reward_before=2.5000 reward_after=7.0000 wall_s=3.0"
    assert "reward by       : my_reward:score" in text
