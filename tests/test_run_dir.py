"""RunDir: config + hash, metrics.jsonl, TensorBoard, plots, refusal rules, progress, summary."""

import dataclasses
import io
import json
import math

import pytest

from rljax.run.plots import metric_series, plot_metrics
from rljax.run import run_clock
from rljax.run.report import Progress, algorithm_label, format_summary
from rljax.run.run_dir import RunDir, RunDirError, config_hash, config_to_dict, read_metrics


@dataclasses.dataclass(frozen=True)
class Run:
    dir: str = "runs/a"
    seed: int = 0
    resume: bool = False
    overwrite: bool = False


@dataclasses.dataclass(frozen=True)
class Cfg:
    lr: float = 1e-3
    clip: float = math.inf
    stops: tuple[str, ...] = ("</answer>",)
    run: Run = Run()


def _records(n=6):
    return [{"step": s, "reward_mean": 0.1 * s, "accuracy": s / 10, "kl": 0.01 * s,
             "entropy": 1.0 - 0.1 * s, "response_length_mean": 10 + s,
             "zero_variance_fraction": 0.5, "rollout_tokens_per_s": 1000.0 + s,
             "note": "text"} for s in range(n)]


def test_config_json_and_hash(tmp_path):
    d = config_to_dict(Cfg())
    assert d == {"lr": 1e-3, "clip": "inf", "stops": ["</answer>"],
                 "run": {"dir": "runs/a", "seed": 0, "resume": False, "overwrite": False}}
    # Run-control fields do not change the hash; anything else does.
    assert config_hash(Cfg()) == config_hash(Cfg(run=Run(dir="elsewhere", resume=True)))
    assert config_hash(Cfg()) != config_hash(Cfg(run=Run(seed=1)))
    assert config_hash(Cfg()) != config_hash(Cfg(lr=2e-3))
    with pytest.raises(TypeError, match="config"):
        config_to_dict(3)


def test_metrics_tensorboard_plots(tmp_path):
    path = tmp_path / "run"
    with RunDir(path, Cfg()) as rd:
        for rec in _records():
            rd.log(rec["step"], {k: v for k, v in rec.items() if k != "step"})
        # flushed as written: readable while the run is still open
        assert len(read_metrics(path)) == 6
        pngs = rd.plot()
        rd.write_json("eval_final", {"accuracy": 0.5})
    saved = json.loads((path / "config.json").read_text())
    assert saved["config_hash"] == config_hash(Cfg()) and saved["config"]["lr"] == 1e-3
    assert read_metrics(path)[3]["kl"] == pytest.approx(0.03)
    assert list((path / "tb").glob("events.out.tfevents.*"))
    names = sorted(p.name for p in pngs)
    assert names == sorted(["reward.png", "accuracy.png", "kl.png", "entropy.png",
                            "response_length.png", "zero_variance.png", "throughput.png",
                            "overview.png"])
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((path / "eval_final.json").read_text()) == {"accuracy": 0.5}


def test_refuses_other_runs_unless_resume_or_overwrite(tmp_path):
    path = tmp_path / "run"
    with RunDir(path, Cfg()) as rd:
        rd.log(5, {"sft/loss": 2.0}, phase="sft")  # SFT counts its own steps
        rd.log(0, {"reward": 1.0})
        rd.log(1, {"reward": 2.0})
        rd.log(2, {"reward": 3.0})
    with pytest.raises(RunDirError, match="a different run .*run.resume=true"):
        RunDir(path, Cfg(lr=5.0))
    with pytest.raises(RunDirError, match="already holds this run"):
        RunDir(path, Cfg())
    with pytest.raises(RunDirError, match="exclusive"):
        RunDir(path, Cfg(), resume=True, overwrite=True)
    with RunDir(path, Cfg(), resume=True) as rd:
        assert rd.resumed
        rd.truncate_metrics(after_step=1)  # resumed from the step-1 checkpoint
        rd.log(2, {"reward": 30.0})
        assert [r.get("reward") for r in rd.metrics()] == [None, 1.0, 2.0, 30.0]
        assert rd.metrics()[0] == {"step": 5, "phase": "sft", "sft/loss": 2.0}
    with RunDir(path, Cfg(lr=5.0), overwrite=True) as rd:
        assert not rd.resumed and rd.metrics() == []
    other = tmp_path / "not_a_run"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(RunDirError, match="holds no run"):
            RunDir(other, Cfg(), **kw)
    assert (other / "precious.txt").exists()


def test_torn_last_line_is_skipped_but_other_bad_lines_fail(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew')
    assert [r["step"] for r in read_metrics(f)] == [0, 1]
    f.write_text('{"step": 0}\nnope\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(f)


def test_plots_pick_only_present_families(tmp_path):
    recs = [{"step": s, "reward": float(s)} for s in range(3)] + [{"step": 3, "eval/accuracy": 0.4}]
    series = metric_series(recs)
    assert series["eval/accuracy"] == ([3], [0.4])
    names = sorted(p.name for p in plot_metrics(recs, tmp_path))
    assert names == ["accuracy.png", "overview.png", "reward.png"]
    assert plot_metrics([{"step": 0, "note": "x"}], tmp_path / "none") == []


def test_plots_keep_sft_steps_apart_and_skip_timings(tmp_path):
    # SFT counts its own steps: its accuracy must not share an axis with RL's.
    recs = ([{"step": s, "phase": "sft", "sft/val_accuracy": 0.1 * s, "sft/entropy": 2.0}
             for s in range(1, 4)]
            + [{"step": s, "phase": "rl", "accuracy": 0.5, "time_reward": 0.01}
               for s in range(1, 3)]
            + [{"step": 0, "phase": "eval", "eval/accuracy": 0.4}])
    names = sorted(p.name for p in plot_metrics(recs, tmp_path))
    # time_reward is a timing: it makes no reward panel of its own.
    assert names == ["accuracy.png", "overview.png", "sft_accuracy.png", "sft_entropy.png"]


def test_multi_turn_episode_metrics_are_plotted(tmp_path):
    recs = [{"step": s, "phase": "rl", "env/turns": 2.0 + s, "env/tool_calls": 1.0,
             "env/tool_s": 0.1 * s, "env/env_s": 0.01, "env/tool_tokens_mean": 12.0}
            for s in range(1, 4)] + [{"step": 3, "phase": "eval", "eval/env/return": 0.5}]
    names = sorted(p.name for p in plot_metrics(recs, tmp_path))
    assert names == ["env.png", "env_time.png", "overview.png", "response_length.png"]
    from rljax.run.plots import PANELS

    belongs = {stem: fn for stem, _, fn in PANELS}
    assert belongs["env"]("eval/env/return") and belongs["env"]("env/turns [seed 1]")
    assert not belongs["env"]("env/tool_s") and belongs["env_time"]("env/tool_s [seed 1]")
    assert belongs["response_length"]("env/tool_tokens_max")


def test_progress_line():
    buf = io.StringIO()
    bar = Progress(4, ("reward", "accuracy"), stream=buf, min_interval_s=0.0, desc="rl")
    bar.update(1, {"reward": 0.123456, "accuracy": 0.5, "other": 1})
    bar.update(4, {"reward": 0.9, "accuracy": 0.75})
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("rl [1/4  25%] reward=0.1235 accuracy=0.5 |")
    assert "other" not in lines[0] and lines[1].startswith("rl [4/4 100%] reward=0.9")
    with pytest.raises(ValueError, match="total"):
        Progress(0)


def test_summary_last_line():
    text = format_summary(accuracy_before=0.25, accuracy_after=0.8125, wall_s=173.04,
                          run_dir="/tmp/r", details={"tokens/s": 5123.4})
    lines = text.splitlines()
    assert lines[-1] == "RESULT accuracy_before=0.2500 accuracy_after=0.8125 wall_s=173.0"
    assert len(lines) <= 24 and any("/tmp/r" in ln for ln in lines)
    with pytest.raises(ValueError, match="accuracy_after must be a fraction"):
        format_summary(accuracy_before=0.2, accuracy_after=81.0, wall_s=1.0)
    with pytest.raises(ValueError, match="wall_s"):
        format_summary(accuracy_before=0.2, accuracy_after=0.3, wall_s=-1)


def test_summary_shows_each_line_once_and_names_the_objective():
    from rljax.train.config import AlgorithmConfig

    text = format_summary(accuracy_before=0.5, accuracy_after=0.75, wall_s=3.0, metric="reward",
                          details={"reward after": 0.75, "algorithm": "grpo"})
    assert text.count("reward after") == 1
    assert "processes" not in text  # one process ran it
    assert algorithm_label(AlgorithmConfig(name="grpo")) == "grpo"
    label = algorithm_label(AlgorithmConfig(name="grpo", objective="my_obj:loss"))
    assert label == "objective my_obj:loss (grpo preset's other settings)"


class _Clock:
    """Stands for `time` in `rljax.run.run_clock`: `perf_counter` reads `now`."""
    now = 100.0

    @classmethod
    def perf_counter(cls):
        return cls.now


def test_wall_time_sums_every_process_of_a_resumed_run(tmp_path, monkeypatch):
    monkeypatch.setattr(run_clock, "time", _Clock)
    path = tmp_path / "r"
    with RunDir(path, Cfg()) as rd:  # the first process: 30 s, the last 10 after its last line
        _Clock.now += 20.0
        rd.log(1, {"loss": 1.0})
        _Clock.now += 10.0
    assert json.loads((path / "wall_time.json").read_text()) == {"segments_s": [30.0]}
    _Clock.now += 500.0  # between the processes: counts for neither
    with RunDir(path, Cfg(), resume=True) as rd:
        assert rd.clock.segments == 2
        _Clock.now += 5.0
        assert rd.clock.wall_s() == 35.0
        rd.begin()
        rd.log(2, {"loss": 0.5})
    assert json.loads((path / "wall_time.json").read_text()) == {"segments_s": [30.0, 5.0]}
    text = format_summary(accuracy_before=0.5, accuracy_after=0.75, wall_s=35.0, segments=2)
    assert "35.0 s (0m35s), the sum of the 2 processes that ran it (resumed)" in text
    with RunDir(path, Cfg(), overwrite=True) as rd:  # a new run: counts from zero
        assert rd.clock.segments == 1 and rd.clock.wall_s() == 0.0


def test_non_primary_process_writes_nothing(tmp_path):
    with RunDir(tmp_path / "r", Cfg(), primary=False) as rd:
        rd.log(1, {"reward": 1.0})
        rd.write_json("eval", {"a": 1})
        assert rd.plot() == [] and rd.metrics() == []
    assert not (tmp_path / "r").exists()


def test_seeds_get_a_curve_each_and_duplicates_are_drawn_once(tmp_path):
    recs = [{"step": s, "phase": "rl", "seed": k, "reward_mean": 0.1 * s * (k + 1),
             "reward/accuracy": 0.1 * s * (k + 1), "loss": 1.0 - 0.1 * s, "grad_norm": 2.0,
             "lr": 1e-3, "clip_frac_high": 0.01} for s in range(1, 4) for k in (0, 1)]
    series = metric_series(recs)
    assert series["reward_mean [seed 1]"] == ([1, 2, 3], [0.2, 0.4, pytest.approx(0.6)])
    assert "seed" not in series
    from rljax.run.plots import _distinct

    keys = sorted(k for k in series if "reward" in k)
    assert [label for _, label in _distinct(keys, series)] == [
        "reward/accuracy [seed 0], reward_mean [seed 0] (identical)",
        "reward/accuracy [seed 1], reward_mean [seed 1] (identical)"]
    names = {p.name for p in plot_metrics(recs, tmp_path)}
    assert {"loss.png", "grad_norm.png", "lr.png", "clip_fraction.png"} <= names


def _scalar_tags(folder) -> set[str]:
    """Scalar tags of the event files directly in `folder` (TFRecord framing: length,
    its CRC, the Event proto, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for path in folder.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + n])
            tags |= {v.tag for v in event.summary.value}
            pos += 12 + n + 4
    return tags


def test_tensorboard_tags_name_the_phase_and_seeds_get_runs_of_their_own(tmp_path):
    with RunDir(tmp_path / "r", Cfg()) as rd:
        rd.log(1, {"sft/loss": 2.0}, phase="sft")
        rd.log(1, {"loss": 1.0, "eval/accuracy": 0.5})
        for k in (0, 1):
            rd.log(2, {"loss": float(k), "seed": k})
    tags = {run: _scalar_tags(tmp_path / "r" / "tb" / run) for run in ("", "seed_0", "seed_1")}
    assert tags[""] == {"sft/loss", "rl/loss", "eval/accuracy"}
    assert tags["seed_0"] == tags["seed_1"] == {"rl/loss"}


def test_eta_leaves_out_the_compiling_first_step(monkeypatch):
    import rljax.run.report as report

    clock = iter([0.0, 100.0, 100.0, 101.0, 101.0, 102.0, 102.0])
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(clock))
    buf = io.StringIO()
    bar = Progress(10, stream=buf, min_interval_s=0.0, start=0)
    bar.update(1, {})  # compiled for 100 s
    bar.update(2, {})
    bar.update(3, {})
    first, second, third = buf.getvalue().splitlines()
    assert "first step (compiling) eta --" in first
    assert second.endswith("1.00s/step eta 0m08s") and third.endswith("1.00s/step eta 0m07s")


def test_a_new_run_that_fails_before_logging_leaves_no_directory(tmp_path):
    """A set-up error (close(failed=True) before any metric line or checkpoint) removes the
    new run's directory; a run that logged, a resumed run and a directory that existed
    before are kept (an existing one emptied of what the failed run wrote)."""
    with pytest.raises(RuntimeError), RunDir(tmp_path / "new", {"lr": 1.0}):
        raise RuntimeError("set-up failed")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError), RunDir(tmp_path / "empty", {"lr": 1.0}):
        raise RuntimeError("set-up failed")
    assert (tmp_path / "empty").is_dir() and not list((tmp_path / "empty").iterdir())
    with pytest.raises(RuntimeError), RunDir(tmp_path / "warm", {"lr": 1.0}) as rd:
        (rd.path / "sft_checkpoints" / "1").mkdir(parents=True)  # a warm-up step saved
        raise RuntimeError("stopped before a metric line")
    assert (tmp_path / "warm" / "sft_checkpoints" / "1").is_dir()
    with pytest.raises(RuntimeError), RunDir(tmp_path / "logged", {"lr": 1.0}) as rd:
        rd.log(0, {"eval/accuracy": 0.5}, phase="eval")
        raise RuntimeError("failed at step 1")
    assert (tmp_path / "logged" / "config.json").exists()
    with pytest.raises(RuntimeError), RunDir(tmp_path / "logged", {"lr": 1.0}, resume=True):
        raise RuntimeError("the restore failed")
    assert read_metrics(tmp_path / "logged")[0]["eval/accuracy"] == 0.5



def test_orbax_reasons_keep_what_differs_and_drop_its_advice():
    from rljax.run.checkpoint_fit import orbax_reason

    err = ValueError("Requested shape: (48, 32) is not compatible with the stored shape: "
                     "(64, 32). Truncating/padding is disabled. To enable it, set `strict="
                     "False` in `ArrayRestoreArgs` for any array in v0 API.")
    assert orbax_reason(err) == ("Requested shape: (48, 32) is not compatible with the "
                                 "stored shape: (64, 32)")
    assert orbax_reason(ValueError("tree structures do not match:\n  a: b")) == \
        "tree structures do not match"
    assert orbax_reason(KeyError()) == "KeyError"
