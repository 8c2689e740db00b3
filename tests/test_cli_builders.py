"""builders: ExperimentConfig sections -> prompt sources and reward functions."""

import dataclasses
import json

import numpy as np
import pytest

from rljax.models import ModelConfig
from rljax.models.tokenizer import build_char_tokenizer
from rljax.run.builders import build_reward, build_task
from rljax.train.config import SFTConfig
from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig
from rljax.run.smoke import write_gsm8k_like

TOK = build_char_tokenizer()
MODEL = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1)


def _cfg(**kw):
    return ExperimentConfig(model=MODEL, **kw)


def test_procedural_sources_are_positional_and_held_out_is_separate():
    cfg = _cfg(task=TaskConfig(name="countdown", difficulty=2, max_number=10,
                               prompt_template="{numbers} {target} ", assistant_prefix="<think>",
                               sft_template="{solution}</think><answer>{solution}</answer>"))
    task = build_task(cfg, TOK)
    p, m = task.train(10, 4)
    p2, m2 = task.train(12, 2)  # position-addressed: a resumed run reads the same prompts
    assert p[2:] == p2 and m[2:] == m2
    assert p[0] == f"{m[0]['numbers']} {m[0]['target']} <think>"
    assert task.train(10, 4)[0] != build_task(dataclasses.replace(cfg, run=RunConfig(seed=1)),
                                              TOK).train(10, 4)[0]
    train_set = {q for q in task.train(0, 200)[0]}
    assert len(task.eval_prompts) == cfg.rl.eval_prompts
    prompts, targets = task.sft(0, 3)
    assert targets[0].endswith("</answer>") and "</think><answer>" in targets[0]
    assert prompts != task.train(0, 3)[0]  # RL reads its own stream: fresh prompts
    assert len(train_set) > 20


def test_rl_prompts_are_fresh_and_heldout_never_trained_on():
    # 1-digit addition has only 100 problems, so the streams would collide without care.
    cfg = _cfg(task=TaskConfig(name="arithmetic", difficulty=1, max_prompt_tokens=8))
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, eval_prompts=60))
    task = build_task(cfg, TOK)
    held = set(task.eval_prompts)
    assert len(held) > 30
    rl_prompts, rl_meta = task.train(0, 300)
    sft_prompts, sft_targets = task.sft(0, 300)
    assert not held & set(rl_prompts) and not held & set(sft_prompts)
    assert rl_prompts != sft_prompts  # not the warm-up's worked examples again
    assert set(rl_prompts) | set(sft_prompts) | held <= {f"{a}+{b}=" for a in range(10)
                                                          for b in range(10)}
    assert task.train(0, 300) == (rl_prompts, rl_meta)  # still positional (resume)
    assert task.train(5, 3)[0] == rl_prompts[5:8]
    assert sft_targets[0] == str(sum(map(int, sft_prompts[0][:-1].split("+"))))


def test_gsm8k_files_shuffled_by_epoch_and_long_prompts_dropped(tmp_path):
    data = write_gsm8k_like(tmp_path / "gsm8k", n_train=10, n_test=6)
    with open(data / "test.jsonl", "a") as fh:  # one over-long held-out prompt
        fh.write(json.dumps({"question": "x" * 500, "answer": "so #### 1"}) + "\n")
    cfg = _cfg(task=TaskConfig(name="gsm8k", path=str(data), max_prompt_tokens=200))
    task = build_task(cfg, TOK)
    assert len(task.eval_prompts) == 6  # the long one was dropped (and reported)
    first_epoch = task.train(0, 10)[1]
    assert sorted(r["question"] if "question" in r else r["prompt"] for r in first_epoch) == \
        sorted(r["prompt"] for r in task.train(10, 10)[1])  # next epoch: same records
    assert all("answer" in r and "####" not in r["answer"] for r in first_epoch)
    # The SFT warm-up reads the same records in its own order (RL does not start on them).
    sft_prompts = task.sft(0, 10)[0]
    rl_prompts = task.train(0, 10)[0]
    assert sorted(sft_prompts) == sorted(rl_prompts) and sft_prompts != rl_prompts
    assert task.sft(3, 4)[0] == sft_prompts[3:7]  # positional, so a resume reads on
    with pytest.raises(ValueError, match="task.prompt_template"):
        build_task(dataclasses.replace(cfg, task=dataclasses.replace(
            cfg.task, prompt_template="{nope}")), TOK)


def test_validation_prompts_only_for_an_accuracy_stop_and_never_held_out(tmp_path):
    cfg = _cfg(task=TaskConfig(name="arithmetic", difficulty=1, max_prompt_tokens=8),
               sft=SFTConfig(steps=5, stop_accuracy=0.5, stop_prompts=40))
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, eval_prompts=50))
    task = build_task(cfg, TOK)
    assert len(task.val_prompts) == 40 == len(task.val_metadata)
    assert not set(task.val_prompts) & set(task.eval_prompts)  # 100 problems, none shared
    assert build_task(cfg, TOK).val_prompts == task.val_prompts  # seeded, repeatable
    assert task.eval_prompts == build_task(
        dataclasses.replace(cfg, sft=SFTConfig(steps=5)), TOK).eval_prompts  # unchanged
    assert build_task(dataclasses.replace(cfg, sft=SFTConfig(steps=5)), TOK).val_prompts == []
    # File tasks: the validation prompts follow the held-out slice of the evaluation split.
    data = write_gsm8k_like(tmp_path / "gsm8k", n_train=10, n_test=8)
    fcfg = _cfg(task=TaskConfig(name="gsm8k", path=str(data), max_prompt_tokens=200),
                sft=SFTConfig(steps=5, stop_accuracy=0.5, stop_prompts=3))
    fcfg = dataclasses.replace(fcfg, rl=dataclasses.replace(fcfg.rl, eval_prompts=5))
    ftask = build_task(fcfg, TOK)
    assert len(ftask.eval_prompts) == 5 and len(ftask.val_prompts) == 3
    assert not set(ftask.val_prompts) & set(ftask.eval_prompts)
    with pytest.raises(ValueError, match="sft.stop_prompts=4: .* needs 4 more"):
        build_task(dataclasses.replace(fcfg, sft=SFTConfig(steps=5, stop_accuracy=0.5,
                                                             stop_prompts=4)), TOK)


@pytest.mark.parametrize("field, value", [("stop_accuracy", 1.5), ("stop_accuracy", -0.1),
                                          ("stop_every", 0), ("stop_prompts", 2.5)])
def test_bad_accuracy_stop_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SFTConfig.{field}"):
        SFTConfig(**{field: value})


def test_rewards_compose_and_report_components():
    cfg = _cfg(task=TaskConfig(name="countdown", difficulty=2, assistant_prefix="<think>"),
               reward=RewardConfig(kind="accuracy+format", format_weight=0.5))
    fn, accuracy_fn = build_reward(cfg)
    meta = {"numbers": [7, 4], "target": 28}
    outs = ["7 * 4</think><answer>7 * 4</answer>", "x</think><answer>7 + 4</answer>", "7*4"]
    r = fn(outs, [meta] * 3)
    np.testing.assert_allclose(r, [1.5, 0.5, 0.0])
    assert fn.last == pytest.approx({"reward/accuracy": 1 / 3, "reward/format": 2 / 3})
    assert [accuracy_fn(o, meta) for o in outs] == [True, False, False]
    math_fn, math_acc = build_reward(_cfg(task=TaskConfig(name="gsm8k", path="/x"),
                                          reward=RewardConfig(correct_reward=10.0)))
    np.testing.assert_allclose(math_fn(["so #### 1,000", "#### 7"], [{"answer": "1000"}] * 2),
                               [10.0, 0.0])
