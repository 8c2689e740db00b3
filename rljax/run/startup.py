"""The start-up summary a run prints before its first step: where it runs (backend,
devices, processes, mesh), what it trains (parameter count), on what (prompts per split),
what scores it (the reward, and the verifier behind the accuracy shown) and which forward
paths its programs take (``rljax.train.programs.paths.ForwardPaths``: a default that fell back
says why); last, a WARNING when the verifier gives no credit to any worked answer
(`verifier_warning`).

`startup_summary(cfg, ...)` returns the lines; `run_experiment` and `run_seeds` print them
once (process 0), before the first step.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from rljax.models.lora import count_pairs, split_trainable
from rljax.run.experiment import ExperimentConfig

__all__ = ["parameter_count", "startup_summary", "verifier_warning"]

#: Worked answers of each kind (warm-up, held-out) the start-up check scores.
CHECKED_ANSWERS = 64


def parameter_count(params: Any) -> int:
    """Number of scalars in a parameter pytree (arrays or `jax.ShapeDtypeStruct`s)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params) if hasattr(x, "shape"))


def _where(mesh, seeds: int) -> str:
    n, procs = jax.device_count(), jax.process_count()
    head = (f"{jax.default_backend()}: {n} device{'s' if n > 1 else ''} "
            f"({jax.devices()[0].device_kind}), {procs} process{'es' if procs > 1 else ''}")
    if seeds > 1:
        return head + f"; the {seeds} seeds' program runs on device 0 (no mesh)"
    if mesh is None:
        return head + "; no mesh (one device)"
    axes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return head + f"; mesh {axes}"


def _verifier(cfg: ExperimentConfig) -> str:
    """The function behind the accuracy metric (`rljax.run.builders.build_reward`)."""
    t, r = cfg.task, cfg.reward
    if t.name == "arithmetic":
        return f"rljax.run.tasks.ArithmeticReward(style={t.style!r})"
    if t.name == "countdown":
        return "rljax.run.tasks.CountdownReward"
    return f"rljax.rewards answer check (reward.verifier={r.verifier!r}, mode={r.answer_mode!r})"


def _reward(cfg: ExperimentConfig, reward_fns: Any) -> str:
    """The reward as called: what, where, under what time limit."""
    r, e = cfg.reward, cfg.env
    if e is not None:
        return (f"episode returns ({e.return_mode}) of {e.env}: up to {e.limits.max_turns} "
                f"turns, tools in {e.tool_workers} worker process(es), "
                f"{e.limits.tool_timeout_s:g} s a call")
    if r.kind == "custom":
        where = (f"in {r.workers} reward worker processes, {r.timeout_s:g} s a call"
                 if r.workers else "in the training process, no time limit")
        return f"{r.function} (reward.kind='custom', {r.function_form} form, {where})"
    if r.kind == "reward_model":
        return f"reward model {r.model_path}"
    terms = getattr(reward_fns, "terms", None)
    if terms:
        return " + ".join(f"{w:g} x {getattr(fn, 'name', type(fn).__name__)}"
                          for w, fn in terms) + f" (reward.kind={r.kind!r})"
    return f"{type(reward_fns).__name__} (reward.kind={r.kind!r})"


def _sizes(cfg: ExperimentConfig, task: Any) -> str:
    t = cfg.task
    train = getattr(task, "train_size", None)
    parts = [f"train ({t.split}) " + ("procedural, unlimited" if train is None
                                      else f"{train} prompts"),
             f"held-out ({t.eval_split}) {len(task.eval_prompts)}"]
    if task.val_prompts:
        parts.append(f"validation {len(task.val_prompts)}")
    return ", ".join(parts)


_FROM_CONFIG = object()


def _accuracy(cfg: ExperimentConfig, accuracy_fn: Any) -> str:
    if accuracy_fn is _FROM_CONFIG:
        return f"{_verifier(cfg)} (task {cfg.task.name!r})"
    if accuracy_fn is None:
        return "none: the reward has no verifier (no reference answers); the held-out " \
               "reward mean is the headline"
    return f"{getattr(accuracy_fn, 'name', accuracy_fn)} (task {cfg.task.name!r})"


def startup_summary(cfg: ExperimentConfig, *, mesh, params: Any, task: Any,
                    reward_fns: Any, seeds: int = 1,
                    accuracy_fn: Any = _FROM_CONFIG, paths: Any = None) -> list[str]:
    """The summary's lines (see the module docstring); `task` is a
    `rljax.run.builders.TaskData` (a several-seed run: seed 0's), `params` the policy's,
    `accuracy_fn` the run's verifier (its `name` is shown; None: no verifier; left out:
    the task's built-in check), `paths` the trainer's resolved forward paths
    (`RLTrainer.paths`; None: no line), then the length filter's counts per split of a
    file task."""
    n = parameter_count(params)
    per = f" per seed, {seeds} seeds in one program" if seeds > 1 else ""
    origin = f"from {cfg.hf_path}" if cfg.hf_path else "random init"
    return [f"backend {_where(mesh, seeds)}",
            f"policy: {n:,} parameters{per} ({origin})",
            f"prompts: {_sizes(cfg, task)}",
            f"reward: {_reward(cfg, reward_fns)}",
            f"accuracy shown: {_accuracy(cfg, accuracy_fn)}",
            *([] if paths is None else [f"forward paths: {paths.line()}"]),
            *_lora(cfg, params),
            *getattr(task, "describe", lambda: [])(),
            *verifier_warning(cfg, task, accuracy_fn)]


def _lora(cfg: ExperimentConfig, params: Any) -> list[str]:
    """The adapters' line of a LoRA run (none without adapters)."""
    if not cfg.lora.enabled:
        return []
    adapters = split_trainable(params)[0]
    n, total = parameter_count(adapters), parameter_count(params)
    lo = cfg.lora
    return [f"lora: rank={lo.rank} alpha={lo.alpha:g} targets={','.join(lo.targets)}: "
            f"{count_pairs(params)} adapter pairs, {n:,} trained parameters "
            f"({100 * n / max(total, 1):.2f}%); base frozen, KL reference = base + adapters "
            "at the start of RL"]


def verifier_warning(cfg: ExperimentConfig, task: Any, accuracy_fn: Any) -> list[str]:
    """One WARNING line when `accuracy_fn` scores 0 on every worked answer it is shown,
    else none: `task.sft_template` filled from the warm-up's records (when the run warms
    up) and from the held-out records the pre-RL evaluation scores, `CHECKED_ANSWERS` of
    each (records the template does not fit are skipped). A verifier that gives none of
    them credit cannot reward this task: the wrong `reward.verifier`, `answer_mode` or
    `task.answer_field`."""
    if accuracy_fn is None or accuracy_fn is _FROM_CONFIG:
        return []
    records = list(getattr(task, "eval_metadata", [])[:CHECKED_ANSWERS])
    warm_up = getattr(task, "sft_records", None)
    if cfg.sft is not None and cfg.sft.steps > 0 and warm_up is not None:
        records += warm_up(0, min(CHECKED_ANSWERS, getattr(task, "train_size", None)
                                  or CHECKED_ANSWERS))  # one epoch at most
    scores = []
    for r in records:
        try:
            scores.append(bool(accuracy_fn(cfg.task.sft_template.format(**r), r)))
        except (KeyError, IndexError, ValueError, TypeError):
            continue  # the template does not fit this record: nothing to check
    if not scores or any(scores):
        return []
    name = getattr(accuracy_fn, "name", accuracy_fn)
    return [f"WARNING: the verifier {name} scores 0 on all {len(scores)} worked answers "
            f"(task.sft_template={cfg.task.sft_template!r} of warm-up and held-out records): "
            "it cannot give credit on this task, so accuracy and the accuracy reward stay "
            "0. Check reward.verifier ('math' or 'string'), reward.answer_mode and "
            "task.answer_field"]
