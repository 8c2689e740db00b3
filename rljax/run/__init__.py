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
- the procedural tasks' verifiers, composed from `rljax.data` and `rljax.rewards`
  (`rljax.run.tasks`): `check_arithmetic`, `ArithmeticReward`, `CountdownReward`.
"""

from rljax.run.experiment import (ExperimentConfig, RewardConfig, RunConfig, TaskConfig,
                                  load_experiment, load_run_config)
from rljax.run.overrides import OverrideError, apply_overrides
from rljax.run.plots import plot_metrics
from rljax.run.run_dir import RunDir, RunDirError, format_summary, read_metrics, result_line
from rljax.run.runner import RunResult, run_experiment
from rljax.run.tasks import ArithmeticReward, CountdownReward, check_arithmetic

__all__ = [
    "ArithmeticReward", "CountdownReward", "ExperimentConfig", "OverrideError",
    "RewardConfig", "RunConfig", "RunDir", "RunDirError", "RunResult", "TaskConfig",
    "apply_overrides", "check_arithmetic", "format_summary", "load_experiment",
    "load_run_config", "plot_metrics", "read_metrics", "result_line", "run_experiment",
]
