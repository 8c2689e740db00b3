"""A run directory: resolved config, per-step metrics, TensorBoard events, plots, summary.

Layout of `RunDir(path, config)`:

    path/config.json        the resolved config (`config_to_dict`), its hash, and what
                            the run decided from it (`record_resolved`)
    path/metrics.jsonl      one JSON object per step, flushed as written
    path/tb/                tensorboardX event files (scalars)
    path/checkpoints/       orbax checkpoints (see `rljax.train.checkpoint`)
    path/plots/*.png        `RunDir.plot()` (see `rljax.run.plots`)
    path/<name>.json        evaluation results and other records (`write_json`)
    path/wall_time.json     the seconds of each process that ran the run
                            (`rljax.run.run_clock`; `RunDir.clock.wall_s()` sums them)

A directory that already holds a run is refused unless `resume=True` (continue it; the
config may differ, e.g. more steps, and the fields that differ are named) or
`overwrite=True` (delete it and start afresh). `resume=True` on a directory that holds no
run is refused too (a misspelt path would silently start a new run); `resume="auto"`
continues a run if there is one and starts one otherwise (what a preemptible job wants). A
non-empty directory that is not a run directory is never deleted. The hash ignores the
run-control fields `run.dir`, `run.resume`, `run.overwrite`, `run.profile_steps`.

A resumed directory is not written until `begin()` (the runner calls it once the
checkpoint has been restored into this config's state): a resume that fails, e.g. on a
changed model size, leaves the run as it was. A local run directory is locked for the
process that uses it (`rljax.run.run_lock`: a second process is refused with the owner's
pid and host; a lock left by a killed process is taken over); `close()` releases it.

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
from rljax.run.checkpoint_fit import orbax_reason, shape_changes
from rljax.run.run_clock import RunClock
from rljax.run.run_lock import LOCK_FILE, RunLock, RunLockedError
from rljax.run.run_writers import (METRICS_FILE, BucketLines, TensorBoardRuns, is_local,
                                   read_metrics, run_path)
from rljax.run.run_writers import write_atomic as _write_atomic
from rljax.train.config.dicts import config_to_dict, jsonable

__all__ = ["RunDir", "RunDirError", "config_diff", "config_to_dict", "config_hash",
           "read_metrics"]

CONFIG_FILE = "config.json"
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


def config_diff(old: dict[str, Any], new: dict[str, Any],
                exclude: tuple[str, ...] = DEFAULT_HASH_EXCLUDE, prefix: str = "") -> list[str]:
    """The fields in which two config dicts (`config_to_dict`) differ, as
    `"a.b: old -> new"` lines (dotted paths; `exclude` keys left out)."""
    out = []
    for key in sorted(set(old) | set(new)):
        name = f"{prefix}{key}"
        if name in exclude:
            continue
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, exclude, name + ".")
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def config_hash(config: Any, exclude: tuple[str, ...] = DEFAULT_HASH_EXCLUDE) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of `config` minus `exclude` keys."""
    d = config_to_dict(config)
    for key in exclude:
        _drop(d, key)
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class RunDir:
    """One run's directory (see the module docstring for its layout and refusal rules).

    Args:
      path: the directory (created if absent).
      config: the resolved config (dataclass or dict), written to `config.json`.
      resume, overwrite: continue (its metrics are kept) or delete the run already in
        `path`, as the module docstring says.
      tensorboard: write tensorboardX event files under `tb/`.
      wandb_project: also log to Weights & Biases under this project (needs `wandb`).
      hash_exclude: config keys left out of the hash.
      primary: False on the non-first processes of a multi-host run: they apply no refusal
        rule and write nothing (module docstring). On several processes all of them wait
        here for process 0's verdict: an `overwrite` has cleared the directory before any
        process goes on, and a refusal stops every process.

    `clock` (`rljax.run.run_clock.RunClock`) is the run's wall time over every process
    that ran it; each metrics line and `close()` record this process's share.
    """

    def __init__(self, path: str | pathlib.Path, config: Any, *, resume: bool | str = False,
                 overwrite: bool = False, tensorboard: bool = True,
                 wandb_project: str | None = None,
                 hash_exclude: tuple[str, ...] = DEFAULT_HASH_EXCLUDE, primary: bool = True):
        if resume not in (True, False, "auto"):
            raise RunDirError(f"resume={resume!r} is invalid; allowed: True, False, 'auto'")
        if resume and overwrite:
            raise RunDirError("resume and overwrite are exclusive: choose one")
        self.path = run_path(path)
        self.config = config_to_dict(config)
        self.config_hash = config_hash(config, hash_exclude)
        self.primary = primary
        self.changed: list[str] = []  # the config fields a resume changes
        self.resolved: dict[str, Any] = {}  # config.json's "resolved" (record_resolved)
        self._lock: RunLock | None = None
        self._made = self._logged = False  # made the directory; wrote a metric line
        self._tb = self._wandb = self._metrics = None
        self._writers = (tensorboard, wandb_project)
        if not primary:
            self.resumed = bool(resume)
            self.clock = RunClock(self.path, False)  # never recorded: process 0's is
            self._metrics = open(os.devnull, "a", encoding="utf-8")
            if not _primary_verdict(True):
                raise RunDirError(f"process 0 refused the run directory {self.path} "
                                  "(its error says why)")
            return
        try:
            self.resumed = self._prepare(resume, overwrite)
        except BaseException:
            self._unlock()
            _primary_verdict(False)  # the other processes stop too, instead of hanging
            raise
        self.clock = RunClock(self.path, self.resumed)
        _primary_verdict(True)  # after any overwrite: the directory is clear for all
        if not self.resumed:
            self.begin()

    # -- set-up ---------------------------------------------------------------------------
    def _entries(self) -> list[epath.Path]:
        if not self.path.exists():
            return []
        return [p for p in self.path.iterdir() if p.name != LOCK_FILE]

    def _prepare(self, resume: bool | str, overwrite: bool) -> bool:
        """Lock the directory and apply the refusal rules (writing nothing but the lock);
        returns whether an existing run is being continued."""
        cfg_file = self.path / CONFIG_FILE
        if self._entries() and not cfg_file.exists():
            raise RunDirError(
                f"{self.path} is not empty and holds no run ({CONFIG_FILE} missing); "
                "choose another run directory (run.dir=PATH)")
        if resume is True and not cfg_file.exists():
            raise RunDirError(
                f"run.resume=true: {self.path} holds no run to continue (no {CONFIG_FILE}); "
                "check run.dir, or set run.resume=auto to start a run there when there is "
                "none")
        if is_local(self.path):
            self._made = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                self._lock = RunLock(self.path)
            except RunLockedError as e:
                raise RunDirError(str(e)) from None
        if not cfg_file.exists():  # empty, or only a stale lock: a new run
            return False
        old = json.loads(cfg_file.read_text())
        if overwrite:
            self._clear()
            return False
        self.changed = config_diff(old.get("config", {}), self.config)
        if resume:
            if self.changed:
                print(f"[rljax] resuming {self.path} with a changed config: "
                      + "; ".join(self.changed), file=sys.stderr)
            return True
        what = "this run" if old.get("config_hash") == self.config_hash else (
            "a different run (" + "; ".join(self.changed or ["config hash differs"]) + ")")
        raise RunDirError(
            f"{self.path} already holds {what}; set run.resume=true to continue it, "
            "run.overwrite=true to replace it, or choose another run.dir")

    def begin(self) -> None:
        """Write `config.json` and open the metric writers (idempotent). A new run begins at
        construction; a resumed one when the caller has checked that its checkpoint fits
        this config (the first write does it otherwise), so a failed resume changes
        nothing."""
        if self._metrics is not None:
            return
        tensorboard, wandb_project = self._writers
        self.path.mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._metrics = self._open_metrics()
        self._tb = TensorBoardRuns(self.path / "tb") if tensorboard else None
        self._wandb = self._open_wandb(wandb_project) if wandb_project else None

    def _write_config(self) -> None:
        blob = {"config_hash": self.config_hash, "config": self.config}
        if self.resolved:
            blob["resolved"] = self.resolved
        _write_atomic(self.path / CONFIG_FILE, json.dumps(blob, indent=2, sort_keys=True))

    def record_resolved(self, name: str, record: Any) -> None:
        """Record what the run resolved from its config (e.g. "forward_paths") in config.json's
        ``"resolved"`` (now if begun, else at `begin()`); resumes compare only ``"config"``."""
        self.resolved[name] = record
        if self.primary and self._metrics is not None:
            self._write_config()

    def restore(self, ck, fresh) -> tuple:
        """`ck.restore(fresh)` for a resume: a checkpoint that does not fit `fresh` (this
        config's state) raises `mismatch`'s error, before anything is written; one whose
        arrays' shapes differ from `fresh`'s before anything is read
        (`rljax.run.checkpoint_fit`)."""
        changed = shape_changes(ck, fresh)
        if changed:
            raise self.mismatch(ValueError("; ".join(changed)))
        try:
            return ck.restore(fresh)
        except (ValueError, KeyError, TypeError) as e:
            raise self.mismatch(e) from e

    def mismatch(self, err: BaseException) -> RunDirError:
        """The error of a resume whose checkpoint does not fit this config (`err`, e.g.
        orbax's shape error, without orbax's advice on its own arguments), naming the
        config fields that differ."""
        fields = "; ".join(self.changed) if self.changed else "no config field differs"
        return RunDirError(f"run.resume: the checkpoint in {self.checkpoint_dir} does not fit "
                           f"this config (changed: {fields}): {orbax_reason(err)}. Nothing "
                           "was written; undo the change, or start a new run.dir")

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _open_metrics(self):
        """The metrics file opened for appending; on a bucket (no appends) its lines are
        kept here and the whole file is rewritten at each log."""
        path = self.path / METRICS_FILE
        if is_local(path):
            return open(path, "a", encoding="utf-8")
        return BucketLines(path.read_text().splitlines(keepends=True) if path.exists() else [],
                           path)

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

    # -- writing --------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, Any], *, phase: str = "rl") -> None:
        """Append one `metrics.jsonl` line (flushed) and the scalars to TensorBoard/wandb.

        `phase` ("sft", "rl", "eval", ...) is stored in the line, so phases that count
        steps separately stay apart (and `truncate_metrics` cuts only one phase).
        TensorBoard / wandb tags are `<phase>/<name>` for a name without a `/` of its own
        (`rl/loss`, as the warm-up's `sft/loss`; `eval/accuracy` stays), and a `seed`
        in `metrics` (a several-seed run) sends the line to that seed's TensorBoard run
        (`tb/seed_<seed>/`; wandb tags `seed_<seed>/...`), one curve per seed.
        """
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        self.begin()
        self._logged = True
        record = {"step": step, "phase": phase,
                  **{str(k): jsonable(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(record, sort_keys=False) + "\n")
        self._metrics.flush()
        if self.primary:
            self.clock.record()
        seed = record.get(_plots.SEED_KEY)
        scalars = {(k if "/" in k else f"{phase}/{k}"): v for k, v in record.items()
                   if k not in ("step", _plots.SEED_KEY)
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            self._tb.log(scalars, step, seed)
        if self._wandb is not None:
            pre = "" if seed is None else f"seed_{seed}/"
            self._wandb.log({pre + k: v for k, v in scalars.items()}, step=step)

    def truncate_metrics(self, after_step: int, phase: str | None = "rl") -> None:
        """Drop `phase`'s metric lines (every phase's when None) with step > `after_step`
        (resuming from that checkpoint), so the file reads as one uninterrupted run."""
        if not self.primary:
            return
        self.begin()
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
        self.begin()
        _write_atomic(out, json.dumps(jsonable(obj), indent=2))
        return out

    def metrics(self) -> list[dict[str, Any]]:
        """All records logged so far (including before a resume)."""
        if not self.primary:
            return []
        self.begin()
        if not self._metrics.closed:
            self._metrics.flush()
        return read_metrics(self.path)

    def plot(self) -> list[epath.Path]:
        """Draw the PNG plots of the metrics so far into `plots/`."""
        if not self.primary:
            return []
        return _plots.plot_metrics(self.metrics(), self.path / "plots")

    def close(self, *, failed: bool = False) -> None:
        """Flush and close the metric writers and release the lock (idempotent). `failed`
        (the run raised): a new run that logged nothing and saved no checkpoint (a set-up
        error) leaves no directory behind, so the corrected command is not refused."""
        discard = failed and self.primary and not (self.resumed or self._logged) and not any(
            p.name.isdigit() for d in self._entries()  # a saved RL or warm-up step
            if d.name.endswith("checkpoints") and d.is_dir() for p in d.iterdir())
        if self._metrics is not None and not self._metrics.closed:
            self._metrics.close()
            if self.primary:
                self.clock.record()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if discard:
            self._clear()
        self._unlock()
        if discard and self._made:
            self.path.rmdir()

    def _clear(self) -> None:
        for entry in self._entries():
            entry.rmtree() if entry.is_dir() else entry.unlink()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def _primary_verdict(ok: bool) -> bool:
    """Process 0's `ok` on every process (a barrier: none passes before process 0 has
    applied the refusal rules and cleared an overwritten directory)."""
    if jax.process_count() == 1:
        return ok
    multihost_utils.sync_global_devices("rljax.run_dir.prepared")
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))
