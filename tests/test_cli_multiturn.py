"""`rljax train` on multi-turn episodes (issue 56, item 5): an experiment's `env` section
names a user's environment class (a file in the working directory) and the run has what a
single-turn run has: SFT warm-up, run directory, metrics with the episode metrics,
TensorBoard, checkpoints, exact resume after Ctrl-C (the resumed run's metrics equal the
uninterrupted run's), `rljax eval` (greedy and sampled episodes), `sample` and `export`."""

import json
import re
import textwrap

import pytest

from _train_common import check_run_files, ctrl_c_at_step
from rljax.cli import main
from rljax.run.run_dir import read_metrics
from rljax.train.checkpoint import Checkpointer

ENV = textwrap.dedent('''
    from rljax.envs import StepResult


    class Echo:
        """Two turns: the first is answered with "ok" and the answer; the second earns 1.0
        if it holds the answer's first digit. The first turn's length earns a little, so
        returns vary within a group from the first step."""

        stop_strings = ("=",)

        def reset(self, metadata):
            self.answer, self.turn = str(metadata["answer"]), 0
            return metadata["prompt"]

        def step(self, model_text, tool_results=()):
            self.turn += 1
            if self.turn == 2:
                return StepResult("", float(self.answer[0] in model_text), True)
            return StepResult("ok" + self.answer, 0.1 * len(model_text))
''')

EXPERIMENT = textwrap.dedent('''
    def config():
        from rljax.envs import EnvLimits
        from rljax.models import ModelConfig
        from rljax.run.environment import EnvConfig
        from rljax.run.experiment import ExperimentConfig, RunConfig, TaskConfig
        from rljax.train.config import (OptimConfig, RLConfig, SamplingConfig, SFTConfig,
                                        algorithm_preset)

        limits = EnvLimits(max_turns=2, max_obs_tokens=4, max_total_tokens=24)
        tiny = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, max_position_embeddings=32)
        return ExperimentConfig(
            name="tiny_env", model=tiny, optim=OptimConfig(lr=3e-3),
            task=TaskConfig(name="arithmetic", difficulty=1, max_prompt_tokens=8),
            env=EnvConfig(env="my_env:Echo", limits=limits, obs_multiple=4),
            algorithm=algorithm_preset("grpo", group_size=2, kl_coef=0.0),
            sampling=SamplingConfig(max_new_tokens=4), sft=SFTConfig(steps=1, batch_size=8),
            rl=RLConfig(steps=2, prompts_per_step=4, eval_prompts=8, logp_chunk=8),
            run=RunConfig(dir="runs/a", save_every=1, plots=False))
''')


_VOLATILE = re.compile(r"^time_|_tok_s(_per_chip)?$|flops|mfu|^env/(env|tool)_s$")


def _steady(row: dict) -> dict:
    return {k: v for k, v in row.items() if not _VOLATILE.search(k)}


def _rl_rows(run_dir):
    return [_steady(r) for r in read_metrics(run_dir) if r["phase"] == "rl"]


@pytest.fixture
def exp(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(ENV)
    (tmp_path / "tiny_env.py").write_text(EXPERIMENT)
    monkeypatch.chdir(tmp_path)
    return str(tmp_path / "tiny_env.py")


def test_train_episodes_resume_eval_sample_export(exp, tmp_path, capsys, monkeypatch):
    # 1. A run that never stops.
    assert main(["train", exp]) == 0
    out = capsys.readouterr().out
    assert re.search(r"RESULT reward_before=\d\.\d{4} reward_after=\d\.\d{4}", out)
    assert "my_env:Echo episode return" in out
    a = tmp_path / "runs/a"
    check_run_files(a)
    rows_a = _rl_rows(a)
    assert [r["step"] for r in rows_a] == [1, 2]
    assert rows_a[0]["reward_std"] > 0 and rows_a[1]["grad_norm"] > 0
    assert rows_a[0]["env/turns"] > 1 and rows_a[0]["env/tool_tokens_mean"] > 0
    assert rows_a[0]["response_len_max"] <= 2 * 4  # the model's tokens: 2 turns of 4
    before = json.loads((a / "eval_before.json").read_text())
    assert before["n"] == 8 and "env/turns" in before and 0 <= before["reward_mean"]

    # 2. Ctrl-C during step 2: step 1 is saved; the resumed run equals the first.
    assert ctrl_c_at_step(monkeypatch, ["train", exp, "--set", "run.dir=runs/b"]) == 130
    b = tmp_path / "runs/b"
    with Checkpointer(b / "checkpoints") as ck:
        assert ck.latest_step() == 1
    assert main(["train", exp, "--set", "run.dir=runs/b", "--set", "run.resume=true"]) == 0
    assert _rl_rows(b) == rows_a
    for name in ("eval_before.json", "eval_after.json"):  # all but the seconds
        got, want = (_steady(json.loads((d / name).read_text())) for d in (a, b))
        assert got == want
    capsys.readouterr()

    # 3. eval (greedy episodes, and 2 sampled per prompt), sample, export.
    assert main(["eval", "runs/a", "--k", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    after = json.loads((a / "eval_after.json").read_text())
    assert res["reward_mean"] == pytest.approx(after["reward_mean"])
    assert res["n"] == 8 and res["k"] == 2 and "best@2_reward_mean" in res
    assert main(["sample", "runs/a", "--prompt", "1+2="]) == 0
    assert "=== prompt: '1+2=' sample 0" in capsys.readouterr().out
    assert main(["export", "runs/a", "exported"]) == 0
    assert (tmp_path / "exported" / "config.json").is_file()


def test_env_section_refusals(exp, capsys):
    """What an environment run cannot take is refused before anything runs, naming it."""
    assert main(["train", exp, "--set", "run.dir=runs/r", "--set", "env.env=my_env:Nope"]) == 2
    assert "Nope" in capsys.readouterr().err
    assert main(["train", exp, "--set", "run.dir=runs/r", "--set", "reward.kind=format"]) == 2
    assert "episode returns are the rewards" in capsys.readouterr().err
