"""`run_experiment(cfg)`: one whole run from an `ExperimentConfig` — the call behind
`rljax train`.

Order: run directory (refusal rules) -> tokenizer, mesh, policy (and on-policy
distillation's teacher, `rljax.run.teacher`) -> optional SFT warm-up ->
PPO value model (its backbone copied from the warmed-up policy) -> held-out evaluation ->
RL steps (metrics, progress line,
checkpoints every `run.save_every` steps, JAX profiler traces of `run.profile_steps`) ->
held-out evaluation -> final checkpoint, plots, `eval.json`, and the one-screen summary
ending in the `RESULT` line.

With `run.resume=true` the latest checkpoint of the run directory is restored (the whole
`TrainState`: parameters, optimiser moments, step, PRNG key, data position, KL
coefficient) and the loop continues from its step; metric lines after that step are
dropped first, so `metrics.jsonl` reads as one uninterrupted run. The restore is checked
against this config's state before the run directory is written (`RunDir.begin`); one
that does not fit raises `RunDirError` naming the changed fields. Ctrl-C saves the
current state (waiting for the write) before the KeyboardInterrupt propagates. SIGTERM
(a TPU maintenance event or spot reclaim) stops every process after the same step
(`rljax.run.preemption`), saves that step, waits for the write and raises `Preempted`.
During the SFT warm-up both stop at the next warm-up step with a checkpoint of their own,
which a resume continues (`rljax.run.warmup_stop`). Before the first step the run prints
its start-up summary (`rljax.run.startup`); a mesh that does not fit the devices is an
error before the run directory is made.

On several processes (`jax.distributed`) every process runs this same function: all of
them save and restore checkpoints (each writes its own shards), and only process 0 writes
the run directory's files and prints progress and the summary.
"""

from __future__ import annotations

import dataclasses
import io
import sys
from typing import TextIO

import jax
from etils import epath
from flax import nnx

from rljax.models import ValueModel
from rljax.models.lora import merge_trainable
from rljax.run import builders
from rljax.run.environment import build_multiturn, encode_sft
from rljax.run.experiment import ExperimentConfig
from rljax.run.lora_runs import base_model, lora_checkpoints
from rljax.run.loop import Seeds, rl_loop
from rljax.run.preemption import StopSignal
from rljax.run.report import Progress, algorithm_label, format_summary
from rljax.run.run_dir import RunDir, is_local
from rljax.run.run_writers import write_folder
from rljax.run.seed_runs import SeedsResult, run_seeds
from rljax.run.startup import startup_summary
from rljax.run.teacher import load_teacher
from rljax.run.warmup_stop import WarmupStop
from rljax.sharding import shard_params
from rljax.train.async_driver import inflight_meta, inflight_target
from rljax.train.checkpoint import Checkpointer
from rljax.train.rl import RLTrainer
from rljax.train.sft import SFTTrainer

__all__ = ["RunResult", "run_experiment"]

_PROGRESS_KEYS = ("reward_mean", "accuracy", "kl_ref", "entropy", "response_len_mean")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a run reports: held-out accuracy before/after RL (the held-out reward mean when
    the reward has no verifier), wall time, where it lives."""

    accuracy_before: float
    accuracy_after: float
    wall_s: float
    run_dir: str
    steps: int
    summary: str
    seeds: SeedsResult | None = None  # per-seed figures of a `run.seeds > 1` run


class _Silent(io.TextIOBase):
    """Where the other processes' progress and summary go: nowhere."""

    def write(self, text: str) -> int:
        return len(text)


def _save_tokenizer(tokenizer, dest: epath.Path) -> None:
    """`save_pretrained` into the run directory (through a local folder for a bucket).

    Locally it writes a sibling folder and renames it into place, so a run killed while
    saving leaves no half-written `tokenizer/` (which a resumed run would keep: it only
    saves when the folder is absent)."""
    if not is_local(dest):
        write_folder(dest, lambda folder: tokenizer.save_pretrained(str(folder)))
        return
    tmp = dest.parent / f"{dest.name}.partial"
    if tmp.exists():  # a previous attempt was killed while writing it
        tmp.rmtree()
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(dest)


def _sft_warmup(cfg, graphdef, params, task, tokenizer, mesh, rd, trainer, out: TextIO,
                warm: WarmupStop, adapters=None):
    """SFT steps until `sft.steps`, or until a `stop_loss` / `stop_accuracy` target (SIGTERM
    and Ctrl-C: the module docstring). ``adapters``: a LoRA policy's, set aside while its
    base trains (`sft.full_parameters`); the validation runs the base with them."""
    c = cfg.sft
    sft = SFTTrainer(graphdef, c, mesh=mesh)
    state, first, loop = warm.restore(sft.init_state(params, seed=cfg.run.seed))
    bar = Progress(c.steps, ("loss", "val_accuracy"), stream=out, desc="sft", start=first)
    done = first  # the last 20 losses; whether a validation check has scored above 0
    progress = {"recent": list(loop.get("recent", [])), "seen": bool(loop.get("seen", False))}
    try:
        for i in range(first, 0 if loop.get("done") else c.steps):
            with warm.stop.guard() as held:  # an update donates the state: never cut one
                state, stop = _sft_step(cfg, sft, state, task, tokenizer, trainer, rd, bar,
                                        i, progress, adapters)
            done = i + 1
            warm.after(done, state, {**progress, "done": bool(stop)}, held)
            if stop:
                print(f"sft: {stop}; warm-up stops at step {i + 1}", file=out)
                break
    except KeyboardInterrupt:
        warm.interrupted(done, state, progress)
        raise
    return state.params["policy"]


def _sft_step(cfg, sft, state, task, tokenizer, trainer, rd, bar, i, progress, adapters):
    """Warm-up step `i + 1`: update, optional validation, log; returns `(state, why the
    warm-up stops or None)`. `progress` (`recent`: the last 20 losses; `seen`: a check
    scored above 0, `sft.stop_dense`) is updated in place."""
    c, bs, recent = cfg.sft, cfg.sft.batch_size, progress["recent"]
    state, m = sft.step(state, encode_sft(cfg, tokenizer, *task.sft(i * bs, bs)))
    stop = None
    due = (i + 1) % c.stop_every == 0 or (c.stop_dense and progress["seen"])
    if c.stop_accuracy > 0 and due:
        policy = state.params["policy"]
        if adapters is not None:  # at their initialisation: they change nothing
            policy = merge_trainable(adapters, policy)
        val = trainer.evaluate(policy, task.val_prompts, task.val_metadata)
        m = {**m, "val_accuracy": _headline(val)}  # an environment's: its mean return
        progress["seen"] = progress["seen"] or m["val_accuracy"] > 0
        if m["val_accuracy"] >= c.stop_accuracy:
            stop = (f"validation accuracy {m['val_accuracy']:.3f} >= "
                    f"sft.stop_accuracy={c.stop_accuracy}")
    recent[:] = (recent + [float(m["loss"])])[-20:]
    if len(recent) == 20 and sum(recent) / 20 < c.stop_loss:
        stop = f"mean loss of the last 20 steps {sum(recent) / 20:.3f} < sft.stop_loss={c.stop_loss}"
    rd.log(i + 1, {f"sft/{k}": v for k, v in m.items()}, phase="sft")
    bar.update(i + 1, m)
    return state, stop


def _value_model(cfg, model, mesh):
    """`(graphdef, params)` of a PPO value model whose backbone copies `model`'s, or
    `(None, None)` for other algorithms."""
    if not cfg.algorithm.needs_value_model:
        return None, None
    graphdef, state = nnx.split(ValueModel.from_policy(model, rngs=nnx.Rngs(cfg.run.seed + 1)))
    return graphdef, state if mesh is None else shard_params(state, mesh)


def _evaluate(trainer, params, task, rd, name: str, step: int) -> dict:
    res = trainer.evaluate(params, task.eval_prompts, task.eval_metadata)
    rd.write_json(name, res)
    rd.log(step, {f"eval/{k}": v for k, v in res.items()}, phase="eval")
    return res


def _meta(cfg, rd, state, phase: str, acc_before: float) -> dict:
    meta = {"phase": phase, "config_hash": rd.config_hash, "data_pos": int(state.data_pos),
            "accuracy_before": acc_before, "seed": cfg.run.seed}
    if state.inflight:  # an asynchronous run's batches in flight: a resume's target
        meta["inflight"] = inflight_meta(state)
    return meta


def run_experiment(cfg: ExperimentConfig, *, out: TextIO | None = None) -> RunResult:
    """Run `cfg` end to end (see the module docstring: SIGTERM raises `Preempted`); prints
    progress and the summary to `out` (default stderr for progress, stdout for the summary)
    and returns a `RunResult`."""
    if not isinstance(cfg, ExperimentConfig):
        raise TypeError(f"run_experiment: cfg must be an ExperimentConfig, got {type(cfg).__name__}")
    cfg = cfg.resolved()  # the algorithm's preset filled in: what runs is what is saved
    builders.check_inputs(cfg)  # the reward imports, the data files exist: before any write
    if cfg.run.seeds > 1:  # several seeds in one program: rljax.run.seed_runs
        res = run_seeds(cfg, out=out)
        return RunResult(res.result["accuracy_before"], res.result["accuracy_after"],
                         res.wall_s, res.run_dir, cfg.rl.steps, res.summary, seeds=res)
    primary = jax.process_index() == 0
    if not primary:
        out = _Silent()
    progress_out = out if out is not None else sys.stderr
    mesh = builders.build_mesh(cfg)  # a mesh that does not fit the devices: before any write
    # A set-up error (RunDir.__exit__ closes it as failed) leaves no run directory behind.
    with RunDir(cfg.run.dir, cfg, resume=cfg.run.resume, overwrite=cfg.run.overwrite,
                tensorboard=cfg.run.tensorboard, wandb_project=cfg.run.wandb_project,
                primary=primary) as rd:
        every = cfg.run.save_every or max(cfg.rl.steps, 1)
        with Checkpointer(rd.checkpoint_dir, save_every=every, keep=cfg.run.keep) as ck, \
                StopSignal() as stop:
            # Every process reports its first RL step (the latest checkpoint's when resuming)
            # to JAX now, so that a SIGTERM during the setup below stops the run after that
            # step (JAX ignores earlier notices).
            stop.reached((ck.latest_step() if cfg.run.resume else None) or 0)
            warm = WarmupStop(rd, stop, cfg.run.resume, progress_out)
            try:
                acc_before, after, verifier = _train(cfg, rd, ck, mesh, warm, stop,
                                                     progress_out)
            finally:
                warm.close()
        if cfg.run.plots:
            rd.plot()
    return _finish(cfg, rd, acc_before, after, out, verifier)


def _train(cfg, rd, ck, mesh, warm, stop, out):
    """Build everything, RL-train, evaluate, save the final state; `(acc_before, after,
    verifier)`: the headline before RL, the final evaluation, and the verifier's name
    (None when the reward has no verifier: the headline is then the reward mean)."""
    tokenizer = builders.build_tokenizer(cfg)
    if rd.primary and not (rd.path / "tokenizer").exists():
        _save_tokenizer(tokenizer, rd.path / "tokenizer")
    model = builders.build_model(cfg, tokenizer, mesh)
    graphdef, params = nnx.split(model)
    ck = lora_checkpoints(cfg, ck)  # LoRA: the adapters; the base checked, not saved
    value_gd, value_params = _value_model(cfg, model, mesh)
    task = builders.build_task(cfg, tokenizer)
    reward_fns, accuracy_fn = builders.build_reward(cfg, task)
    teacher = None if cfg.teacher is None else load_teacher(cfg.teacher, tokenizer, mesh,
                                                            dtype=cfg.compute_dtype)
    trainer = RLTrainer(graphdef, tokenizer, reward_fns, algorithm=cfg.algorithm,
                        optim=cfg.optim, sampling=cfg.sampling, rl=cfg.rl,
                        prompt_len=cfg.task.max_prompt_tokens, value_graphdef=value_gd,
                        accuracy_fn=accuracy_fn, mesh=mesh, teacher=teacher,
                        reward_pool=(builders.shared_reward_pool(cfg.reward.workers)
                                     if cfg.reward.workers and cfg.env is None else None),
                        reward_timeout_s=cfg.reward.timeout_s,
                        multiturn=build_multiturn(cfg, tokenizer))
    for line in startup_summary(cfg, mesh=mesh, params=params, task=task,
                                reward_fns=reward_fns, accuracy_fn=accuracy_fn,
                                paths=trainer.paths):
        print(f"[rljax] {line}", file=out)
    rd.record_resolved("forward_paths", trainer.paths.record())
    state, acc_before = _start(cfg, rd, ck, trainer, graphdef, params, value_params,
                               task, tokenizer, mesh, out, warm)
    if task.splits and rd.primary:  # per split: records read, dropped by length, kept
        rd.write_json("data", task.splits)  # after a resume's restore has been checked
    state = _rl_loop(cfg, rd, ck, trainer, state, task, acc_before, out, stop)
    after = _evaluate(trainer, state.params["policy"], task, rd, "eval_after", int(state.step))
    ck.save(int(state.step), state, _meta(cfg, rd, state, "done", acc_before),
            force=True)  # a no-op after the loop's last step; saves step 0 when rl.steps is 0
    return acc_before, after, getattr(accuracy_fn, "name", None)


def _headline(res: dict) -> float:
    """An evaluation's headline: accuracy when there is a verifier, else the reward mean."""
    return float(res.get("accuracy", res.get("reward_mean", 0.0)))


def _start(cfg, rd, ck, trainer, graphdef, params, value_params, task, tokenizer, mesh, out,
           warm):
    """Restore the latest checkpoint (resume) or warm up, evaluate and build a fresh state."""
    if cfg.run.resume and ck.latest_step() is not None:
        fresh = trainer.init_state(params, seed=cfg.run.seed, value_params=value_params)
        saved = ck.read_meta().get("inflight")
        if saved:  # the in-flight batches' arrays, shaped as their record says
            fresh = dataclasses.replace(fresh, inflight=inflight_target(saved, mesh))
        state, meta = rd.restore(ck, fresh)
        rd.begin()
        rd.truncate_metrics(int(meta["step"]))
        print(f"[rljax] resumed {rd.path} at step {meta['step']}", file=out)
        return state, float(meta["accuracy_before"])
    sft = cfg.sft is not None and cfg.sft.steps > 0
    saved = warm.saved_step() if sft else None  # on every process alike
    if rd.resumed and saved is None:
        rd.truncate_metrics(-1, phase=None)  # no checkpoint yet: start over, clean record
    if sft and cfg.warms_up_base:  # every weight of the base; the adapters wait
        plain, base, adapters = base_model(graphdef, params)
        params = merge_trainable(adapters, _sft_warmup(
            cfg, plain, base, task, tokenizer, mesh, rd, trainer, out, warm, adapters))
    elif sft:
        params = _sft_warmup(cfg, graphdef, params, task, tokenizer, mesh, rd, trainer, out,
                             warm)
    if sft and value_params is not None:  # the critic starts from the warmed-up policy
        _, value_params = _value_model(cfg, nnx.merge(graphdef, params), mesh)
    before = _evaluate(trainer, params, task, rd, "eval_before", 0)
    return trainer.init_state(params, seed=cfg.run.seed, value_params=value_params), \
        _headline(before)


def _rl_loop(cfg, rd, ck, trainer, state, task, acc_before, out, stop):
    run = Seeds(step=lambda st: _one(trainer.step(st, task.train)),
                evaluate=lambda p: [trainer.evaluate(p, task.eval_prompts, task.eval_metadata)])
    return rl_loop(cfg, rd, ck, state, int(state.step), run,
                   lambda phase, st: _meta(cfg, rd, st, phase, acc_before), stop, out,
                   _PROGRESS_KEYS)[0]


def _one(step_out: tuple) -> tuple:
    """``(state, metrics)`` -> ``(state, [metrics])``: a one-seed run's step."""
    state, metrics = step_out
    return state, [metrics]


def _finish(cfg, rd, acc_before, after: dict, out, verifier=None) -> RunResult:
    wall = rd.clock.wall_s()  # a resumed run's: every process's
    acc_after = _headline(after)
    metric = "accuracy" if "accuracy" in after else "reward"
    scored = (f"{cfg.env.env} episode return" if cfg.env is not None
              else cfg.reward.function or cfg.reward.kind)
    by = verifier if metric == "accuracy" else f"{scored} (held-out mean; no verifier)"
    rows = [r for r in rd.metrics() if r.get("phase") == "rl" and "rollout_tok_s" in r]
    details = {"experiment": cfg.name, "algorithm": algorithm_label(cfg.algorithm),
               "RL steps": cfg.rl.steps, "reward after": after.get("reward_mean", float("nan"))}
    if rows:
        details["rollout tok/s"] = sum(r["rollout_tok_s"] for r in rows) / len(rows)
    text = format_summary(accuracy_before=acc_before, accuracy_after=acc_after, wall_s=wall,
                          run_dir=rd.path, title=f"rljax: {cfg.name}", details=details,
                          metric=metric, measured_by=by, segments=rd.clock.segments)
    print(text, file=out if out is not None else sys.stdout, flush=True)
    return RunResult(acc_before, acc_after, wall, str(rd.path), cfg.rl.steps, text)

