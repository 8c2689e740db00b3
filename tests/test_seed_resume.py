"""A several-seed run (the demo's smoke config: 2 seeds in one program) stopped by SIGTERM
saves the step it reached and resumes to the run it would have been: the same steps'
metrics, the same final weights and held-out results as the run left alone.

The smoke model answers no sum right after its 2-step warm-up, so the task's verifier
would give every completion 0 and every update would be zero: the runs here are scored by
a custom device reward (`reward.function` naming a `DeviceReward` instance) that varies
within each group from the first step (the share of even token ids), so that each RL step
changes the weights."""

import io
import json
import os
import signal

import jax
import numpy as np
import pytest

from rljax.models import build_char_tokenizer
from rljax.rewards.device import DeviceReward
from rljax.run import builders
from rljax.run.experiment_files import load_experiment
from rljax.run.preemption import Preempted
from rljax.run.runner import run_experiment
from rljax.run.run_dir import read_metrics
from rljax.train.checkpoint import Checkpointer
from rljax.train.config import RLConfig
from rljax.train.programs import CompileLog
from rljax.train.seeds import SeedRL

STEPS, STOP_AT = 4, 2


class EvenShare(DeviceReward):
    """The share of a completion's tokens with an even id."""

    def task_arrays(self, metadata):
        return {"n": np.ones(len(metadata), np.float32)}

    def __call__(self, tokens_BxT, mask_BxT, task):
        even = (tokens_BxT % 2 == 0) * mask_BxT
        return task["n"] * even.sum(axis=1) / jax.numpy.maximum(mask_BxT.sum(axis=1), 1.0)


EVEN_SHARE = EvenShare()


def host_reward(completions, metadata):
    return np.zeros(len(completions), np.float32)


def _config(run_dir, *extra, reward="EVEN_SHARE"):
    return load_experiment("arithmetic_grpo", [
        "smoke=true", f"run.dir={run_dir}", "run.plots=false", "run.tensorboard=false",
        f"rl.steps={STEPS}", "run.save_every=3", "model.num_layers=1", "reward.kind=custom",
        f"reward.function={__name__}:{reward}", *extra])


def _final(run_dir):
    with Checkpointer(os.path.join(run_dir, "checkpoints")) as ck:
        state, meta = ck.restore_raw()
    return state, meta


def _rl_rows(run_dir):
    rows = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
            if r.get("phase", "rl") == "rl"]
    return {(r["step"], r["seed"]): r for r in rows}, len(rows)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("seed_resume")
    ref_dir, cut_dir = str(base / "ref"), str(base / "cut")
    # The reference also evaluates every 2 steps: evaluating must not change the training.
    ref = run_experiment(_config(ref_dir, f"rl.eval_every={STOP_AT}"), out=io.StringIO())
    # The second RL step gets SIGTERM: the run stops after it (save_every=3 would not
    # have saved step 2), saves it and raises Preempted.
    orig, calls = SeedRL.step, []

    def step(self, state, sources):
        calls.append(1)
        if len(calls) == STOP_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        return orig(self, state, sources)

    with CompileLog() as log:
        with pytest.MonkeyPatch.context() as mp, pytest.raises(Preempted) as stopped:
            mp.setattr(SeedRL, "step", step)
            run_experiment(_config(cut_dir), out=io.StringIO())
        saved = _final(cut_dir)
        out = io.StringIO()
        resumed = run_experiment(_config(cut_dir, "run.overwrite=false", "run.resume=true"),
                                 out=out)
    return ref, ref_dir, stopped.value, saved, resumed, cut_dir, out.getvalue(), log


def test_sigterm_saves_the_step_reached(runs):
    _, _, stopped, (state, meta), _, _, _, _ = runs
    assert stopped.step == STOP_AT and meta["phase"] == "preempted"
    assert np.asarray(state["step"]).tolist() == [STOP_AT, STOP_AT]
    assert len(meta["eval_before"]) == 2 and meta["seeds"] == [0, 1]


def test_resumed_run_equals_the_uninterrupted_one(runs):
    ref, ref_dir, _, _, resumed, cut_dir, text, _ = runs
    assert f"resumed {cut_dir} at step {STOP_AT}" in text
    assert resumed.seeds.warm_state is None  # no warm-up ran again
    ev = lambda d, name: _json(d, name)  # noqa: E731
    assert ev(cut_dir, "eval_before") == ev(ref_dir, "eval_before")
    for a, b in zip(ev(cut_dir, "eval_after").values(), ev(ref_dir, "eval_after").values()):
        np.testing.assert_allclose(a["reward_mean"], b["reward_mean"], rtol=1e-6)
    (a, meta_a), (b, meta_b) = _final(ref_dir), _final(cut_dir)
    assert meta_a["phase"] == meta_b["phase"] == "done"
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(a["data_pos"], b["data_pos"])
    rows_a, n_a = _rl_rows(ref_dir)
    rows_b, n_b = _rl_rows(cut_dir)
    assert n_a == n_b == STEPS * 2  # each step of each seed logged once
    for k, r in rows_a.items():
        for name in ("reward_mean", "loss", "response_len_mean"):
            np.testing.assert_allclose(rows_b[k][name], r[name], rtol=1e-5, err_msg=f"{k} {name}")
    assert rows_a[(1, 0)]["reward_std"] > 0  # the rewards vary: the updates are real
    ref_init = _json(ref_dir, "eval_before")
    assert ref_init != _json(ref_dir, "eval_after")  # and they moved the held-out reward


def test_eval_every_logs_each_seeds_held_out_results(runs):
    _, ref_dir, _, _, _, cut_dir, _, _ = runs
    rows, _ = _rl_rows(ref_dir)
    evaluated = sorted(k for k, r in rows.items() if "eval/reward_mean" in r)
    assert evaluated == [(STOP_AT, 0), (STOP_AT, 1)]  # step 2 of 4; the last is eval_after
    assert not any("eval/reward_mean" in r for r in _rl_rows(cut_dir)[0].values())
    after = _json(ref_dir, "eval_after")
    assert [rows[(STOP_AT, s)]["eval/reward_mean"] for s in (0, 1)] != \
        [after[str(s)]["reward_mean"] for s in (0, 1)]  # measured then, not copied


def test_eval_due_every_n_steps_but_the_last():
    assert [s for s in range(1, 11) if RLConfig(steps=10, eval_every=3).eval_due(s)] == [3, 6, 9]
    assert [s for s in range(1, 11) if RLConfig(steps=9, eval_every=3).eval_due(s)] == [3, 6]
    assert not any(RLConfig(steps=10, eval_every=0).eval_due(s) for s in range(1, 11))


def _json(run_dir, name):
    with open(os.path.join(run_dir, f"{name}.json")) as f:
        return json.load(f)


def test_several_seeds_with_a_host_reward(tmp_path):
    """A host reward has no device form; a several-seed run then scores each seed's batch
    on the host and learns all seeds in one vmapped program (SeedRL's host path)."""
    cfg = _config(str(tmp_path / "host"), reward="host_reward")
    assert not builders.has_device_reward(cfg)
    with pytest.raises(ValueError, match="host reward.*DeviceReward instance"):
        builders.build_device_reward(cfg, build_char_tokenizer())
    res = run_experiment(cfg, out=io.StringIO())
    rows, n = _rl_rows(res.run_dir)
    assert n == 2 * STEPS and {s for _, s in rows} == {cfg.run.seed, cfg.run.seed + 1}
    assert all(np.isfinite(r["loss"]) for r in rows.values())


def test_later_runs_reuse_the_first_runs_programs(runs):
    """The stopped and the resumed run build new trainers with the reference run's model
    and configs: they reuse its compiled programs (rljax.train.programs)."""
    from rljax.train.programs.step import seeds_step
    from rljax.train.programs.device import seeds_evaluate
    from rljax.train.seeds import seeds_sft_update

    later = runs[-1]
    # CompileLog names a program jit(<its function's name>): these are the three programs.
    programs = {f"jit({f.__name__})" for f in (seeds_step, seeds_sft_update, seeds_evaluate)}
    assert programs == {"jit(seeds_step)", "jit(seeds_sft_update)", "jit(seeds_evaluate)"}
    assert not programs & set(later.by_name()), later.summary()
    assert runs[4].seeds.compiled == {"rl_step": 1, "evaluate": 1}  # each compiled once
