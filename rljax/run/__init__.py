"""rljax.run: the run layer (layer 7), above the trainer core `rljax.train`.

Everything the command line does is one Python call here:
- `ExperimentConfig` (with `TaskConfig`, `RewardConfig`, `RunConfig`) and
  `load_experiment(name_or_path, overrides)`: an experiment file's `config()` with typed
  `--set` overrides (`apply_overrides`, `OverrideError`) on top; `load_run_config(run_dir)`;
- `run_experiment(cfg) -> RunResult`: builds the task, reward, model and trainer
  (`rljax.run.builders`), trains, evaluates and writes the run directory;
- `RunDir` (config.json, metrics.jsonl, TensorBoard events, plots, summary),
  `read_metrics`, `format_summary`, `result_line`, `plot_metrics`;
- `rljax.run.artifacts`: sample, evaluate and export a finished run;
- `load_teacher(path, tokenizer, mesh)`: on-policy distillation's teacher from a run
  directory or Hugging Face folder, checked to share the student's tokenizer;
- `EnvConfig` (`rljax.run.environment`): the `env` section, `rljax train` on multi-turn
  episodes of a user's environment class (guide: docs/environments.md);
- `Preempted`: what `run_experiment` raises after a SIGTERM, once the step every process
  stopped at is saved (`rljax.run.preemption`);
- the procedural tasks' verifiers, composed from `rljax.data` and `rljax.rewards`
  (`rljax.run.tasks`): `check_arithmetic`, `ArithmeticReward`, `CountdownReward`;
- your data and your reward (guide: docs/your-task.md): `rljax.run.task_files` (which file
  each split reads, every record field kept, the length filter's counts per split) and
  `rljax.run.user_reward` (`reward.function` in the reward worker pool under
  `reward.timeout_s`; `Verifier`, the named check behind the reported accuracy).
"""

import importlib

# Names load their module on first use (PEP 562), so importing a light submodule such as
# rljax.run.tasks (which a reward worker process unpickles) does not load JAX, orbax and
# matplotlib with the runner.
_HOME = {
    "ExperimentConfig": "experiment", "RewardConfig": "experiment", "RunConfig": "experiment",
    "TaskConfig": "experiment", "load_experiment": "experiment_files",
    "load_run_config": "experiment", "OverrideError": "overrides",
    "apply_overrides": "overrides", "plot_metrics": "plots", "RunDir": "run_dir",
    "RunDirError": "run_dir", "format_summary": "report", "read_metrics": "run_dir",
    "result_line": "report", "RunResult": "runner", "run_experiment": "runner",
    "ArithmeticReward": "tasks", "CountdownReward": "tasks", "check_arithmetic": "tasks",
    "Preempted": "preemption", "load_teacher": "teacher", "EnvConfig": "environment",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'rljax.run' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rljax.run.{_HOME[name]}"), name)

