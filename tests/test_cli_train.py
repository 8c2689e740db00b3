"""`rljax train` end to end on a tiny model: RESULT line, run directory contents, refusal
of an occupied run directory, Ctrl-C leaving a valid checkpoint, resume, and a resumed
run reproducing the metrics of a run that never stopped, `--profile-steps` and per-chip
throughput."""

import json
import re
import textwrap

import jax
import pytest

from _train_common import check_run_files, ctrl_c_at_step
from rljax.cli import main
from rljax.train.checkpoint import Checkpointer
from rljax.run.run_dir import read_metrics

# rljax is imported inside config(): a reward worker that imports this file for
# digit_reward then loads numpy only, not JAX.
EXPERIMENT = textwrap.dedent('''
    import numpy as np

    def digit_reward(completions, metadata):
        """Fraction of digits in each completion: varies within groups from step 1."""
        return np.array([sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions])

    def config():
        from rljax.models import ModelConfig
        from rljax.train.config import (AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig,
                                        SFTConfig)
        from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig

        return ExperimentConfig(
            name="tiny",
            model=ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=32),
            task=TaskConfig(name="arithmetic", difficulty=1, max_prompt_tokens=8),
            reward=RewardConfig(kind="custom", function="rljax_experiment_tiny:digit_reward"),
            algorithm=AlgorithmConfig(name="grpo", group_size=4),
            optim=OptimConfig(lr=3e-3),
            sampling=SamplingConfig(max_new_tokens=4),
            sft=SFTConfig(steps=1, batch_size=8),
            rl=RLConfig(steps=2, prompts_per_step=4, eval_prompts=8, logp_chunk=8),
            run=RunConfig(dir="runs/tiny", save_every=1, plots=False),
        )
''')

_VOLATILE = re.compile(r"^time_|_tok_s(_per_chip)?$|flops|mfu")


def _rl_rows(run_dir):
    return [{k: v for k, v in r.items() if not _VOLATILE.search(k)}
            for r in read_metrics(run_dir) if r["phase"] == "rl"]


@pytest.fixture
def exp(tmp_path, monkeypatch):
    (tmp_path / "tiny.py").write_text(EXPERIMENT)
    monkeypatch.chdir(tmp_path)
    return str(tmp_path / "tiny.py")


def test_train_interrupt_resume_reproduce(exp, tmp_path, capsys, monkeypatch):
    # 1. A run that never stops (its step 2 traced with the JAX profiler).
    assert main(["train", exp, "--set", "run.dir=runs/a", "--profile-steps", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"RESULT accuracy_before=[01]\.\d{4} accuracy_after=[01]\.\d{4} "
                        r"wall_s=\d+\.\d", out[-1]), out[-1]
    a = tmp_path / "runs/a"
    check_run_files(a)
    rows_a = _rl_rows(a)
    assert [r["step"] for r in rows_a] == [1, 2] and rows_a[0]["reward_std"] > 0
    assert rows_a[1]["grad_norm"] > 0
    assert len(list((a / "profile").glob("**/*.xplane.pb"))) == 1
    with Checkpointer(a / "checkpoints") as ck:  # save_every 1: the last step's is the final
        assert [ck.read_meta(s)["phase"] for s in (1, 2)] == ["rl", "done"]
    row = [r for r in read_metrics(a) if r["phase"] == "rl"][1]
    n = jax.device_count()  # the default mesh spans every device
    assert row["step"] == 2 and row["model_flops_s"] > 0 and "mfu" not in row  # CPU
    assert row["rollout_tok_s_per_chip"] == pytest.approx(row["rollout_tok_s"] / n)
    assert row["train_tok_s_per_chip"] == pytest.approx(row["train_tok_s"] / n)

    # 2. The same directory again is refused (it holds a run) unless resumed/overwritten.
    assert main(["train", exp, "--set", "run.dir=runs/a"]) == 2
    assert "already holds this run" in capsys.readouterr().err

    # 3. Ctrl-C during step 2: the step-1 state is saved and restorable.
    assert ctrl_c_at_step(monkeypatch, ["train", exp, "--set", "run.dir=runs/b"]) == 130
    b = tmp_path / "runs/b"
    with Checkpointer(b / "checkpoints") as ck:
        assert ck.latest_step() == 1
        meta = ck.read_meta()
        assert meta["step"] == 1 and meta["data_pos"] == 4
    assert "run.resume=true" in capsys.readouterr().err

    # 4. Resume finishes the run; its metrics equal the uninterrupted run's.
    assert main(["train", exp, "--set", "run.dir=runs/b", "--set", "run.resume=true"]) == 0
    rows_b = _rl_rows(b)
    assert [r["step"] for r in rows_b] == [1, 2]
    assert rows_b == rows_a
    before_a = json.loads((a / "eval_before.json").read_text())
    assert before_a == json.loads((b / "eval_before.json").read_text())
    assert json.loads((a / "eval_after.json").read_text()) == \
        json.loads((b / "eval_after.json").read_text())


def test_sft_stop_loss_ends_the_warm_up_early(exp, tmp_path, capsys):
    # Any loss is below 100: the warm-up stops as soon as 20 steps give a mean.
    assert main(["train", exp, "--set", "run.dir=runs/s", "--set", "sft.steps=60",
                 "--set", "sft.stop_loss=100", "--set", "rl.steps=0"]) == 0
    sft_rows = [r for r in read_metrics(tmp_path / "runs/s") if r["phase"] == "sft"]
    assert len(sft_rows) == 20
    capsys.readouterr()
    # A negative target is refused, naming the field.
    assert main(["train", exp, "--set", "run.dir=runs/t", "--set", "sft.stop_loss=-1"]) == 2
    assert "stop_loss" in capsys.readouterr().err


def test_sft_stop_accuracy_checks_real_greedy_accuracy_on_validation_prompts(exp, tmp_path):
    # A target the tiny model cannot reach: every step runs, checked every 2 steps.
    assert main(["train", exp, "--set", "run.dir=runs/v", "--set", "sft.steps=4",
                 "--set", "sft.stop_accuracy=1.0", "--set", "sft.stop_every=2",
                 "--set", "sft.stop_prompts=8", "--set", "rl.steps=0"]) == 0
    sft_rows = [r for r in read_metrics(tmp_path / "runs/v") if r["phase"] == "sft"]
    assert [r["step"] for r in sft_rows] == [1, 2, 3, 4]
    checked = [r["sft/val_accuracy"] for r in sft_rows if "sft/val_accuracy" in r]
    assert len(checked) == 2 and all(0.0 <= a < 1.0 for a in checked)
