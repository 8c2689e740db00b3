"""`run_seeds(cfg)`: `run.seeds` independent runs of one config trained at once, each
program vmapped over the seeds (`rljax.train.seeds`) — what `run_experiment` calls when
`run.seeds > 1`.

Seed `k` is the run `run.seed + k` would be alone: its own initial weights, data streams
(training, SFT, validation and held-out prompts), sampling keys and optimiser state. The
order is that of `run_experiment`: SFT warm-up (each seed stops at its own validation
target; a stopped seed's state passes through unchanged), held-out evaluation, RL steps
(with a device reward one compiled program: sample, score, learn; with a host reward each
seed's batch scored on the host, then one vmapped learning program), held-out evaluation,
the final stacked state saved, `eval.json`, and the summary whose last line is
`RESULT seeds=... accuracy_before=<mean> accuracy_after=<mean> accuracy_after_min=...
gain_mean=... gain_min=... wall_s=...`.

`metrics.jsonl` holds one line per seed per step, with a `seed` field. The stacked state
is checkpointed every `run.save_every` steps (and at the end), with each seed's held-out
results before RL; `run.resume=true` continues from the latest checkpoint (no warm-up or
first evaluation again; a resumed run's SFT baseline replays the warm-up), and SIGTERM or
Ctrl-C save the step reached first (a warm-up step: `rljax.run.warmup_stop`, which a resume
continues), as `run_experiment` does. One device (several-seed runs are for models that
fit one chip many times over); no plots (they draw one run).
With LoRA adapters each seed trains its own on its own base, and the checkpoints hold
them as a one-seed run's do (`rljax.run.lora_runs.lora_checkpoints`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, TextIO

import jax
import numpy as np
from flax import nnx

from rljax.models.lora import merge_trainable
from rljax.run import builders
from rljax.run.experiment import ExperimentConfig
from rljax.run.lora_runs import base_model, lora_checkpoints
from rljax.run.loop import Seeds, rl_loop
from rljax.run.preemption import StopSignal
from rljax.run.report import Progress, algorithm_label, format_summary, result_line
from rljax.run.run_dir import RunDir
from rljax.run.startup import startup_summary
from rljax.run.warmup_stop import WarmupStop
from rljax.train.batching import encode_pairs
from rljax.train.checkpoint import Checkpointer
from rljax.train.learn.update import TrainState
from rljax.train.rl import RLTrainer
from rljax.train.seeds import SeedRL, SeedSFT, stack_states

__all__ = ["SeedsResult", "run_seeds", "seed_configs"]

_PROGRESS_KEYS = ("reward_mean", "accuracy", "entropy", "response_len_mean")


@dataclasses.dataclass(frozen=True)
class SeedsResult:
    """Per-seed held-out accuracy before / after RL, wall time, the run directory."""

    seeds: tuple[int, ...]
    accuracy_before: tuple[float, ...]
    accuracy_after: tuple[float, ...]
    wall_s: float
    rl_s: float
    run_dir: str
    summary: str
    compiled: dict = dataclasses.field(default_factory=dict)  # program -> times compiled
    # The SFT warm-up's last state (params and optimiser moments stacked over seeds, its
    # `step` each seed's own update count), for a baseline that continues it (its SFT
    # updates donate these buffers); None when the run had no warm-up.
    warm_state: Any = None

    @property
    def result(self) -> dict[str, float]:
        """The RESULT line's values (means over seeds, worst seed, wall time)."""
        before, after = np.array(self.accuracy_before), np.array(self.accuracy_after)
        gain = after - before
        return {"seeds": len(self.seeds), "accuracy_before": before.mean(),
                "accuracy_after": after.mean(), "accuracy_after_min": after.min(),
                "gain_mean": gain.mean(), "gain_min": gain.min(), "wall_s": self.wall_s}


def seed_configs(cfg: ExperimentConfig) -> list[ExperimentConfig]:
    """One config per seed: `run.seed + k`, `run.seeds = 1`."""
    return [dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=cfg.run.seed + k,
                                                              seeds=1))
            for k in range(cfg.run.seeds)]


def run_seeds(cfg: ExperimentConfig, *, out: TextIO | None = None) -> SeedsResult:
    """Train `cfg.run.seeds` seeds of `cfg` at once (see the module docstring)."""
    cfg = cfg.resolved()
    if cfg.run.seeds < 2:
        raise ValueError(f"run_seeds: run.seeds={cfg.run.seeds}; use run_experiment for one seed")
    if cfg.algorithm.needs_value_model or cfg.algorithm.needs_teacher:
        raise ValueError(f"run.seeds={cfg.run.seeds}: several-seed programs have no value "
                         f"model or teacher; algorithm {cfg.algorithm.name!r} needs run.seeds=1")
    if jax.process_count() > 1:
        raise ValueError("run_seeds: several-seed runs use one process and one device; "
                         f"this is process {jax.process_index()} of {jax.process_count()}")
    t0 = time.perf_counter()
    progress_out = out if out is not None else sys.stderr
    seeds = [c.run.seed for c in seed_configs(cfg)]
    builders.build_mesh(cfg)  # mesh sizes that do not fit the devices: an error, not ignored
    # A set-up error (RunDir.__exit__ closes it as failed) leaves no run directory behind.
    with RunDir(cfg.run.dir, cfg, resume=cfg.run.resume, overwrite=cfg.run.overwrite,
                tensorboard=cfg.run.tensorboard, wandb_project=cfg.run.wandb_project) as rd:
        every = cfg.run.save_every or max(cfg.rl.steps, 1)
        with Checkpointer(rd.checkpoint_dir, save_every=every, keep=cfg.run.keep) as ck, \
                StopSignal() as stop:
            ck = lora_checkpoints(cfg, ck)  # LoRA: the adapters; the bases checked, not saved
            run = _SeedRun(cfg, rd, ck, seeds, progress_out)
            run.phases["setup"] = time.perf_counter() - t0
            warm = WarmupStop(rd, stop, cfg.run.resume, progress_out)
            try:
                state, before, warm_state = run.start(warm)
            finally:
                warm.close()
            state, rl_s = run.rl_loop(state, before, stop)
            after = run.evaluate(state.params["policy"], "eval_after")
            ck.save(cfg.rl.steps, state, run.meta("done", before), force=True)  # rl.steps 0
            run.compiled.update(run.rl.compiled())
    res = _finish(cfg, rd, seeds, before, after, rl_s, run.compiled, run.phases, out)
    return dataclasses.replace(res, warm_state=warm_state)


class _SeedRun:
    """One several-seed run's parts: its models, tasks and vmapped trainer; a fresh start
    (warm-up, held-out evaluation) or a resumed one; the RL loop with its checkpoints."""

    def __init__(self, cfg, rd, ck, seeds, out):
        self.cfg, self.rd, self.ck, self.seeds, self.out = cfg, rd, ck, seeds, out
        per = seed_configs(cfg)
        self.tok = tok = builders.build_tokenizer(cfg)
        split = [nnx.split(builders.build_model(c, tok, None)) for c in per]
        self.graphdef, self.params = split[0][0], [p for _, p in split]
        self.tasks = [builders.build_task(c, tok) for c in per]
        # The reward's JAX form where it has one (the whole step one vmapped program), else
        # the host reward: each seed's batch scored on the host, one vmapped learning program.
        reward, accuracy_fn = builders.build_reward(cfg, self.tasks[0])
        verifier = {"accuracy_fn": accuracy_fn}  # the start-up line names the host verifier
        if builders.has_device_reward(cfg):  # its verifier is the task's built-in check
            reward, accuracy_fn, verifier = builders.build_device_reward(cfg, tok), None, {}
        trainer = RLTrainer(self.graphdef, tok, reward, accuracy_fn=accuracy_fn,
                            algorithm=cfg.algorithm, optim=cfg.optim, sampling=cfg.sampling,
                            rl=cfg.rl, prompt_len=cfg.task.max_prompt_tokens,
                            reward_pool=(builders.shared_reward_pool(cfg.reward.workers)
                                         if cfg.reward.workers else None),
                            reward_timeout_s=cfg.reward.timeout_s)
        self.rl, self.compiled = SeedRL(trainer), {}
        self.phases = {"setup": 0.0, "warm-up": 0.0, "evaluations": 0.0}
        for line in startup_summary(cfg, mesh=None, params=self.params[0], task=self.tasks[0],
                                    reward_fns=reward, seeds=len(seeds), paths=trainer.paths,
                                    **verifier):
            print(f"[rljax] {line}", file=out)
        rd.record_resolved("forward_paths", trainer.paths.record())

    def meta(self, phase: str, before: list[dict]) -> dict:
        """A checkpoint's metadata: what a resumed run needs besides the state."""
        return {"phase": phase, "config_hash": self.rd.config_hash, "seeds": self.seeds,
                "eval_before": before}

    def start(self, warm: WarmupStop) -> tuple[TrainState, list[dict], Any]:
        """The latest checkpoint's state and held-out results (``run.resume`` with one), or
        the warm-up (continued from its own checkpoint when one was stopped), the held-out
        evaluation and fresh states; returns ``(state, eval before RL per seed, the
        warm-up's last state or None)``. A checkpoint that does not fit this config raises
        before the run directory is written."""
        cfg, rd, ck = self.cfg, self.rd, self.ck
        if cfg.run.resume and ck.latest_step() is not None:
            state, meta = rd.restore(ck, self.rl.init_state(self.params, self.seeds))
            if meta.get("seeds") != self.seeds:
                raise rd.mismatch(ValueError(
                    f"it holds seeds {meta.get('seeds')}, this config runs {self.seeds}"))
            rd.begin()
            step = int(np.asarray(state.step)[0])
            rd.truncate_metrics(step)
            print(f"[rljax] resumed {rd.path} at step {step} ({len(self.seeds)} seeds)",
                  file=self.out)
            return state, meta["eval_before"], None
        sft = cfg.sft is not None and cfg.sft.steps > 0
        saved = warm.saved_step() if sft else None  # on every process alike
        if rd.resumed and saved is None:
            rd.truncate_metrics(-1, phase=None)  # no checkpoint yet: start over, clean record
        t1 = time.perf_counter()
        params, warm_state = self.params, None
        if sft and cfg.warms_up_base:  # every weight of each base; the adapters wait
            plain, bases, adapters = zip(*(base_model(self.graphdef, p) for p in params))
            bases, warm_state = self._warmup(plain[0], list(bases), warm,
                                             adapters=stack_states(adapters))
            params = [merge_trainable(a, b) for a, b in zip(adapters, bases)]
        elif sft:
            params, warm_state = self._warmup(self.graphdef, params, warm)
        self.phases["warm-up"] = time.perf_counter() - t1
        state = self.rl.init_state(params, self.seeds)
        return state, self.evaluate(state.params["policy"], "eval_before"), warm_state

    def _warmup(self, graphdef, params: list, warm: WarmupStop,
                adapters=None) -> tuple[list, Any]:
        """The vmapped SFT warm-up (stops: the module docstring); returns each seed's policy
        params and the warm-up's last (stacked) state. ``adapters`` (stacked): the LoRA
        adapters set aside while the bases train (`sft.full_parameters`); ``self.rl``
        validates each base with them (at their initialisation they change nothing)."""
        sft = SeedSFT(graphdef, self.cfg.sft)
        state, first, loop = warm.restore(sft.init_state(params, self.seeds))
        active = list(loop.get("active", [True] * len(params)))
        bar = Progress(self.cfg.sft.steps, ("loss",), stream=self.out, desc="sft", start=first)
        done = first
        try:
            for i in range(first, self.cfg.sft.steps if any(active) else first):
                with warm.stop.guard() as held:  # an update donates the state: never cut one
                    state = self._warmup_step(sft, state, active, bar, i, adapters)
                done = i + 1
                warm.after(done, state, {"active": active}, held)
                if not any(active):
                    break
        except KeyboardInterrupt:
            warm.interrupted(done, state, {"active": active})
            raise
        self.compiled["sft_update"] = sft.compiled()
        return [jax.tree.map(lambda x, k=k: x[k], state.params["policy"])
                for k in range(len(params))], state

    def _warmup_step(self, sft, state, active, bar, i, adapters):
        """Warm-up step `i + 1` of every active seed, validation, logs; `active` is updated
        in place (a seed at its validation target stops)."""
        cfg, tasks, seeds = self.cfg, self.tasks, self.seeds
        c, bs = cfg.sft, cfg.sft.batch_size
        batches = [encode_pairs(self.tok, *t.sft(i * bs, bs), cfg.task.max_prompt_tokens,
                                cfg.sampling.max_new_tokens) for t in tasks]
        state, ms = sft.step(state, batches, active)
        if c.stop_accuracy > 0 and (i + 1) % c.stop_every == 0:
            policy = state.params["policy"]
            if adapters is not None:
                policy = merge_trainable(adapters, policy)
            val = self.rl.evaluate(policy, [t.val_prompts for t in tasks],
                                   [t.val_metadata for t in tasks])
            for k, v in enumerate(val):
                ms[k]["val_accuracy"] = v["accuracy"]
                if active[k] and v["accuracy"] >= c.stop_accuracy:
                    active[k] = False
                    print(f"sft: seed {seeds[k]}: validation accuracy {v['accuracy']:.3f} >= "
                          f"sft.stop_accuracy={c.stop_accuracy}; its warm-up stops at step "
                          f"{i + 1}", file=self.out)
        for k, m in enumerate(ms):
            self.rd.log(i + 1, {**{f"sft/{n}": x for n, x in m.items()}, "seed": seeds[k]},
                        phase="sft")
        bar.update(i + 1, {"loss": float(np.mean([m["loss"] for m in ms]))})
        return state

    def rl_loop(self, state, before, stop) -> tuple[TrainState, float]:
        """RL steps from ``state``'s step to ``rl.steps``, each seed's metrics logged
        (``rljax.run.loop.rl_loop``); returns the state and the steps' phase time."""
        t1, ev0 = time.perf_counter(), self.phases["evaluations"]
        run = Seeds(step=lambda st: self.rl.step(st, [t.train for t in self.tasks]),
                    evaluate=self.evaluate, seeds=self.seeds)
        state, rl_s = rl_loop(self.cfg, self.rd, self.ck, state, int(np.asarray(state.step)[0]),
                              run, lambda phase, _: self.meta(phase, before), stop, self.out,
                              _PROGRESS_KEYS)
        self.phases["RL"] = time.perf_counter() - t1 - (self.phases["evaluations"] - ev0)
        return state, rl_s

    def evaluate(self, params_S, name: str | None = None) -> list[dict]:
        """Each seed's greedy results on its task's held-out prompts (written to `name`.json
        when given); its time counts as evaluations."""
        t1 = time.perf_counter()
        res = self.rl.evaluate(params_S, [t.eval_prompts for t in self.tasks],
                               [t.eval_metadata for t in self.tasks])
        if name is not None:
            self.rd.write_json(name, {str(s): r for s, r in zip(self.seeds, res)})
        self.phases["evaluations"] += time.perf_counter() - t1
        return res


def _finish(cfg, rd, seeds, before, after, rl_s, compiled, phases, out) -> SeedsResult:
    wall = rd.clock.wall_s()  # a resumed run's: every process's
    acc_b = tuple(float(b.get("accuracy", 0.0)) for b in before)
    acc_a = tuple(float(a.get("accuracy", 0.0)) for a in after)
    details = {"experiment": cfg.name, "algorithm": algorithm_label(cfg.algorithm),
               "seeds": len(seeds),
               "RL steps": cfg.rl.steps,
               "phases (s)": ", ".join(f"{k} {v:.1f}" for k, v in phases.items())}
    for s, b, a in zip(seeds, acc_b, acc_a):
        details[f"seed {s}"] = f"{b:.4f} -> {a:.4f} ({a - b:+.4f})"
    details["compiled programs"] = ", ".join(f"{k} {v}" for k, v in compiled.items())
    res = SeedsResult(tuple(seeds), acc_b, acc_a, wall, rl_s, str(rd.path), "", compiled)
    text = format_summary(accuracy_before=float(np.mean(acc_b)),
                          accuracy_after=float(np.mean(acc_a)), wall_s=wall, run_dir=rd.path,
                          title=f"rljax: {cfg.name} ({len(seeds)} seeds, one program)",
                          details=details, segments=rd.clock.segments)
    text = text.rsplit("\n", 1)[0] + "\n" + result_line(res.result)
    print(text, file=out if out is not None else sys.stdout, flush=True)
    return dataclasses.replace(res, summary=text)
