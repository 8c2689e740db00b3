"""Experiment files: a small Python file under `experiments/` with a function
`config() -> ExperimentConfig` (and optionally `smoke(cfg) -> ExperimentConfig`, the
settings `--set smoke=true` switches to: two steps on CPU with a tiny model).
`load_experiment("arithmetic_grpo", ["optim.lr=1e-5"])` imports the file with importlib,
calls `config()`, applies the typed overrides (see `rljax.run.overrides`) and, when
`smoke` is set, the file's `smoke` function and no end-of-run plots (the overrides are
applied again after it, so the command line always wins). A `recipe` set (`--set recipe=NAME`) calls the file's
`recipe(cfg)` first (named TPU recipes, `rljax.run.recipes`), so `smoke` shrinks the
recipe. Nothing is `exec`'d from strings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys
from collections.abc import Sequence

from rljax.run.experiment import ExperimentConfig
from rljax.run.overrides import apply_overrides

__all__ = ["available_experiments", "experiment_module", "experiments_dir", "load_experiment"]


def experiments_dir() -> pathlib.Path:
    """`./experiments` when it exists, else the one next to the installed package."""
    here = pathlib.Path.cwd() / "experiments"
    if here.is_dir():
        return here
    return pathlib.Path(__file__).resolve().parents[2] / "experiments"


def available_experiments(directory: pathlib.Path | None = None) -> list[str]:
    """Names of the experiment files (`*.py` defining `def config(`) in `directory`."""
    directory = directory or experiments_dir()
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.py")
                  if not p.name.startswith("_") and "def config(" in p.read_text())


def _resolve(name_or_path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(name_or_path)
    if path.suffix == ".py" and path.is_file():
        return path.resolve()
    candidate = experiments_dir() / f"{path.stem if path.suffix == '.py' else name_or_path}.py"
    if candidate.is_file():
        return candidate.resolve()
    raise FileNotFoundError(
        f"no experiment {str(name_or_path)!r}: not a .py file, and not in {experiments_dir()}; "
        f"available experiments: {available_experiments() or 'none'}")


def _import_file(path: pathlib.Path):
    mod_name = f"rljax_experiment_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import experiment file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses defined in the file need their module
    spec.loader.exec_module(module)
    return module


def experiment_module(name_or_path: str | pathlib.Path):
    """The experiment file's module, imported afresh (its `RECIPES`, helpers); same
    lookup as `load_experiment`."""
    return _import_file(_resolve(name_or_path))


def load_experiment(name_or_path: str | pathlib.Path,
                    overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Import an experiment file, call its `config()`, apply `overrides` (and `smoke`).

    `name_or_path` is a file path ending in `.py` or the name of a file in
    `experiments/`. Raises FileNotFoundError (listing the available experiments) when
    there is no such file, TypeError when `config()` is missing or returns something
    else, and `OverrideError` for bad overrides.
    """
    path = _resolve(name_or_path)
    module = _import_file(path)
    if not callable(getattr(module, "config", None)):
        raise TypeError(f"experiment file {path} must define config() -> ExperimentConfig")

    def call(hook: str, *args) -> ExperimentConfig:  # the file's function, then the overrides
        cfg = getattr(module, hook)(*args)
        if not isinstance(cfg, ExperimentConfig):
            raise TypeError(f"{path}: {hook}() returned {type(cfg).__name__}, not ExperimentConfig")
        return apply_overrides(cfg, overrides)

    cfg = call("config")
    if cfg.recipe is not None:
        if not callable(getattr(module, "recipe", None)):
            raise TypeError(f"recipe={cfg.recipe!r}: experiment file {path} has no recipe(cfg) "
                            "hook (it offers no named recipes)")
        cfg = call("recipe", cfg)
    if cfg.smoke:
        if callable(getattr(module, "smoke", None)):
            cfg = call("smoke", cfg)
        # A two-step check draws no end-of-run plots (about 5 s of matplotlib);
        # `rljax plot RUN` draws them, and `--set run.plots=true` keeps them.
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, plots=False))
        cfg = apply_overrides(cfg, overrides)
    return cfg
