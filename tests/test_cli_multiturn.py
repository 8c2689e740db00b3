"""`rljax train` on multi-turn episodes (issue 56, item 5): docs/environments.md's two files
as written (a user's environment class, an experiment whose `env` section names it) and
the run has what a
single-turn run has: SFT warm-up, run directory, metrics with the episode metrics,
TensorBoard, checkpoints, exact resume after Ctrl-C (the resumed run's metrics equal the
uninterrupted run's), `rljax eval` (greedy and sampled episodes), `sample` and `export`."""

import json
import re
import pathlib

import pytest

from _train_common import check_run_files, ctrl_c_at_step
from rljax.cli import main
from rljax.run.run_dir import read_metrics
from rljax.train.checkpoint import Checkpointer

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def guide_file(name: str) -> str:
    """The guide's code block that starts with the comment `# name`, as written."""
    blocks = [b.split("```", 1)[0] for b in GUIDE.read_text().split("```python\n")[1:]]
    return next(b for b in blocks if b.startswith(f"# {name}\n"))


_VOLATILE = re.compile(r"^time_|_tok_s(_per_chip)?$|flops|mfu|^env/(env|tool)_s$")


def _steady(row: dict) -> dict:
    return {k: v for k, v in row.items() if not _VOLATILE.search(k)}


def _rl_rows(run_dir):
    return [_steady(r) for r in read_metrics(run_dir) if r["phase"] == "rl"]


@pytest.fixture
def exp(tmp_path, monkeypatch):
    """docs/environments.md's two files, as written, in the working directory."""
    for name in ("my_env.py", "my_experiment.py"):
        (tmp_path / name).write_text(guide_file(name))
    monkeypatch.chdir(tmp_path)
    return "my_experiment.py"


def test_train_episodes_resume_eval_sample_export(exp, tmp_path, capsys, monkeypatch):
    # 1. A run that never stops (a checkpoint every step), after a 3-step warm-up whose
    # validation (greedy episodes' mean return) is checked at step 2, then every step
    # once it scored above 0 (sft.stop_dense).
    args = ["train", exp, "--set", "run.save_every=1"] + [
        x for kv in ("sft.steps=3", "sft.batch_size=8", "sft.stop_accuracy=1.0",
                     "sft.stop_every=2", "sft.stop_dense=true", "sft.stop_prompts=8")
        for x in ("--set", kv)]
    assert main(args + ["--set", "run.dir=runs/a"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"RESULT reward_before=\d\.\d{4} reward_after=\d\.\d{4}", out)
    assert "my_env:TwoTries episode return" in out
    a = tmp_path / "runs/a"
    check_run_files(a)
    rows_a = _rl_rows(a)
    assert [r["step"] for r in rows_a] == [1, 2]
    assert rows_a[0]["reward_std"] > 0 and rows_a[1]["grad_norm"] > 0
    assert rows_a[0]["env/turns"] > 1 and rows_a[0]["env/tool_tokens_mean"] > 0
    assert rows_a[0]["response_len_max"] <= 2 * 4  # the model's tokens: 2 turns of 4
    checks = [(r["step"], r["sft/val_accuracy"]) for r in read_metrics(a)
              if r["phase"] == "sft" and "sft/val_accuracy" in r]
    assert [st for st, _ in checks] == [2, 3] and checks[0][1] > 0, checks
    before = json.loads((a / "eval_before.json").read_text())
    assert before["n"] == 8 and "env/turns" in before and 0 <= before["reward_mean"]

    # 2. Ctrl-C during step 2: step 1 is saved; the resumed run equals the first.
    assert ctrl_c_at_step(monkeypatch, args + ["--set", "run.dir=runs/b"]) == 130
    b = tmp_path / "runs/b"
    with Checkpointer(b / "checkpoints") as ck:
        assert ck.latest_step() == 1
    assert main(args + ["--set", "run.dir=runs/b", "--set", "run.resume=true"]) == 0
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
    assert main(["eval", "runs/a", "--pass-threshold", "0.5"]) == 2  # episodes: no pass@k
    assert "an environment run's eval" in capsys.readouterr().err
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


def test_env_section_round_trips_through_config_json():
    """What a run directory saves of an `env` section (its options, tools and limits) is
    what a resume, `rljax eval` or `export` reads back."""
    from rljax.run.experiment import ExperimentConfig
    from rljax.run.experiment_files import load_experiment
    from rljax.train.config.dicts import config_from_dict, config_to_dict

    cfg = load_experiment("arithmetic_tool", ["env.tools=()", "env.limits.max_turns=2"])
    assert cfg.env.options == (("instruction", "{question}\n"),) and cfg.env.tools == ()
    saved = json.loads(json.dumps(config_to_dict(cfg)))
    assert config_from_dict(ExperimentConfig, saved) == cfg
