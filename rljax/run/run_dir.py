"""A run directory: resolved config, per-step metrics, TensorBoard events, plots, summary.

Layout of `RunDir(path, config)`:

    path/config.json        the resolved config (`config_to_dict`) and its hash
    path/metrics.jsonl      one JSON object per step, flushed as written
    path/tb/                tensorboardX event files (scalars)
    path/checkpoints/       orbax checkpoints (see `rljax.train.checkpoint`)
    path/plots/*.png        `RunDir.plot()` (see `rljax.run.plots`)
    path/<name>.json        evaluation results and other records (`write_json`)

A directory that already holds a run is refused unless `resume=True` (continue it; the
config may differ, e.g. more steps, and the difference is reported) or `overwrite=True`
(delete it and start afresh). A non-empty directory that is not a run directory is never
deleted. The hash ignores the run-control fields `run.dir`, `run.resume`, `run.overwrite`.

Paths go through `etils.epath` (orbax's path library), so `path` may be a bucket
(`gs://...`). On several processes only process 0 (`primary=True`) owns these files;
every process writes its own checkpoint shards through orbax.

The console side of a run (progress line, end-of-run screen, RESULT line) is
`rljax.run.report`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from rljax.run import plots as _plots
from rljax.train.config_io import config_to_dict, jsonable

__all__ = ["RunDir", "RunDirError", "config_to_dict", "config_hash", "read_metrics"]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
DEFAULT_HASH_EXCLUDE = ("run.dir", "run.resume", "run.overwrite", "run.profile_steps")


class RunDirError(ValueError):
    """The run directory cannot be used as asked (holds another run, not a run dir...)."""


def _drop(d: dict[str, Any], dotted: str) -> None:
    *head, last = dotted.split(".")
    for part in head:
        d = d.get(part)
        if not isinstance(d, dict):
            return
    d.pop(last, None)


def config_hash(config: Any, exclude: tuple[str, ...] = DEFAULT_HASH_EXCLUDE) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of `config` minus `exclude` keys."""
    d = config_to_dict(config)
    for key in exclude:
        _drop(d, key)
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_path(path: str | os.PathLike) -> epath.Path:
    """`path` as an `epath.Path`: a local path made absolute, a URI (`gs://...`) as is."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def is_local(path: epath.Path) -> bool:
    """True for a path on this machine's file system (not a bucket URI)."""
    return "://" not in os.fspath(path)


def _write_atomic(path: epath.Path, text: str) -> None:
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # readers see the old file or the new one, never half of one


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The records of a run's `metrics.jsonl` (a run dir or the file itself).

    A torn last line (a run killed mid-write) is skipped; a bad line elsewhere is an error
    naming the file and line.
    """
    path = run_path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}")
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON object: {e}") from None
    return out


class RunDir:
    """One run's directory (see the module docstring for its layout and refusal rules).

    Args:
      path: the directory (created if absent).
      config: the resolved config (dataclass or dict), written to `config.json`.
      resume: continue the run already in `path` (its metrics are kept).
      overwrite: delete the run already in `path` first.
      tensorboard: write tensorboardX event files under `tb/`.
      wandb_project: also log to Weights & Biases under this project (needs `wandb`).
      hash_exclude: config keys left out of the hash.
      primary: False on the non-first processes of a multi-host run: they apply no refusal
        rule and write nothing (the first process owns the directory's files; checkpoints
        are written by every process through orbax). On several processes all of them
        wait here for process 0's verdict: an `overwrite` has cleared the directory before
        any process goes on, and a refusal stops every process.
    """

    def __init__(self, path: str | pathlib.Path, config: Any, *, resume: bool = False,
                 overwrite: bool = False, tensorboard: bool = True,
                 wandb_project: str | None = None,
                 hash_exclude: tuple[str, ...] = DEFAULT_HASH_EXCLUDE, primary: bool = True):
        if resume and overwrite:
            raise RunDirError("resume and overwrite are exclusive: choose one")
        self.path = run_path(path)
        self.config = config_to_dict(config)
        self.config_hash = config_hash(config, hash_exclude)
        self.primary = primary
        self._lines: list[str] | None = None  # a bucket's metrics (no appends there)
        if not primary:
            self.resumed, self._tb, self._wandb = resume, None, None
            self._metrics = open(os.devnull, "a", encoding="utf-8")
            if not _primary_verdict(True):
                raise RunDirError(f"process 0 refused the run directory {self.path} "
                                  "(its error says why)")
            return
        try:
            self.resumed = self._prepare(resume, overwrite)
        except BaseException:
            _primary_verdict(False)  # the other processes stop too, instead of hanging
            raise
        _primary_verdict(True)  # after any overwrite: the directory is clear for all
        self.path.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.path / CONFIG_FILE, json.dumps(
            {"config_hash": self.config_hash, "config": self.config}, indent=2, sort_keys=True))
        self._metrics = self._open_metrics()
        self._tb = self._open_tensorboard() if tensorboard else None
        self._wandb = self._open_wandb(wandb_project) if wandb_project else None

    # -- set-up ---------------------------------------------------------------------------
    def _prepare(self, resume: bool, overwrite: bool) -> bool:
        """Apply the refusal rules; returns whether an existing run is being continued."""
        if not self.path.exists() or not any(self.path.iterdir()):
            return False
        cfg_file = self.path / CONFIG_FILE
        if not cfg_file.exists():
            raise RunDirError(
                f"{self.path} is not empty and holds no run ({CONFIG_FILE} missing); "
                "choose another run directory (run.dir=PATH)")
        old_hash = json.loads(cfg_file.read_text()).get("config_hash")
        if overwrite:
            self.path.rmtree()
            return False
        if resume:
            if old_hash != self.config_hash:
                print(f"[rljax] resuming {self.path} with a changed config "
                      f"(hash {old_hash} -> {self.config_hash})", file=sys.stderr)
            return True
        what = "this run" if old_hash == self.config_hash else (
            f"a different run (config hash {old_hash}, this config {self.config_hash})")
        raise RunDirError(
            f"{self.path} already holds {what}; set run.resume=true to continue it, "
            "run.overwrite=true to replace it, or choose another run.dir")

    def _open_metrics(self):
        """The metrics file opened for appending; on a bucket (no appends) its lines are
        kept here and the whole file is rewritten at each log."""
        path = self.path / METRICS_FILE
        if is_local(path):
            return open(path, "a", encoding="utf-8")
        self._lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        return _Lines(self._lines, path)

    def _open_tensorboard(self):
        # Imported here: tensorboardX imports torch when torch is installed (~1.1 s).
        from tensorboardX import SummaryWriter

        return SummaryWriter(logdir=str(self.path / "tb"), flush_secs=10)

    def _open_wandb(self, project: str):
        try:
            import wandb  # optional: only runs that set wandb_project need it
        except ImportError:
            raise RunDirError(
                "wandb logging was asked for (wandb_project) but wandb is not installed; "
                "pip install wandb or leave it unset") from None
        return wandb.init(project=project, config=self.config, dir=str(self.path),
                          name=self.path.name, resume="allow")

    # -- paths ----------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> epath.Path:
        """Where the run's orbax checkpoints go."""
        return self.path / "checkpoints"

    @property
    def plots_dir(self) -> epath.Path:
        """Where `plot()` writes PNGs."""
        return self.path / "plots"

    # -- writing --------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, Any], *, phase: str = "rl") -> None:
        """Append one `metrics.jsonl` line (flushed) and the scalars to TensorBoard/wandb.

        `phase` ("sft", "rl", "eval", ...) is stored in the line, so phases that count
        steps separately stay apart (and `truncate_metrics` cuts only one phase).
        """
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        record = {"step": step, "phase": phase,
                  **{str(k): jsonable(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(record, sort_keys=False) + "\n")
        self._metrics.flush()
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if phase in _plots.OWN_STEP_PHASES:  # counts its own steps: keep its curves apart
            pre = f"{phase}/"
            scalars = {(k if k.startswith(pre) else pre + k): v for k, v in scalars.items()}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def truncate_metrics(self, after_step: int, phase: str | None = "rl") -> None:
        """Drop `phase`'s metric lines (every phase's when None) with step > `after_step`
        (resuming from that checkpoint), so the file reads as one uninterrupted run."""
        if not self.primary:
            return
        self._metrics.close()
        path = self.path / METRICS_FILE
        keep = [r for r in read_metrics(path)
                if (phase is not None and r.get("phase", "rl") != phase)
                or r.get("step", -1) <= after_step]
        _write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))
        self._metrics = self._open_metrics()

    def write_json(self, name: str, obj: Any) -> epath.Path:
        """Write `obj` to `path/name.json` atomically (e.g. evaluation results)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"name must be a plain file stem, got {name!r}")
        out = self.path / f"{name}.json"
        if not self.primary:
            return out
        _write_atomic(out, json.dumps(jsonable(obj), indent=2))
        return out

    def metrics(self) -> list[dict[str, Any]]:
        """All records logged so far (including before a resume)."""
        if not self.primary:
            return []
        if not self._metrics.closed:
            self._metrics.flush()
        return read_metrics(self.path)

    def plot(self) -> list[epath.Path]:
        """Draw the PNG plots of the metrics so far into `plots/`."""
        if not self.primary:
            return []
        return _plots.plot_metrics(self.metrics(), self.plots_dir)

    def close(self) -> None:
        """Flush and close the metric writers (idempotent)."""
        if not self._metrics.closed:
            self._metrics.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _primary_verdict(ok: bool) -> bool:
    """Process 0's `ok` on every process (a barrier: none passes before process 0 has
    applied the refusal rules and cleared an overwritten directory)."""
    if jax.process_count() == 1:
        return ok
    multihost_utils.sync_global_devices("rljax.run_dir.prepared")
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


class _Lines:
    """A write-only text sink for `metrics.jsonl` on a bucket: each write adds to the
    kept lines and `flush` rewrites the file (buckets have no appends)."""

    def __init__(self, lines: list[str], path: epath.Path):
        self.lines, self.path, self.closed = lines, path, False

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        _write_atomic(self.path, "".join(self.lines))

    def close(self) -> None:
        self.closed = True
