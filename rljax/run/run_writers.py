"""The run directory's metric sinks: tensorboardX writers (one TensorBoard run per seed)
and `metrics.jsonl` on a bucket (rewritten whole, buckets have no appends); its paths
(`run_path`, `is_local`) and `read_metrics`, the reader of `metrics.jsonl`."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
from typing import Any

from etils import epath

__all__ = ["BucketLines", "TensorBoardRuns", "is_local", "read_metrics", "run_path",
           "write_atomic", "write_folder"]

METRICS_FILE = "metrics.jsonl"


def run_path(path: str | os.PathLike) -> epath.Path:
    """`path` as an `epath.Path`: a local path made absolute, a URI (`gs://...`) as is."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def is_local(path: epath.Path) -> bool:
    """True for a path on this machine's file system (not a bucket URI)."""
    return "://" not in os.fspath(path)


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


def write_atomic(path: epath.Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename: readers see the
    old file or the new one, never half of one."""
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_folder(out: epath.Path, write) -> None:
    """`write(local_folder)`, then, for a bucket (`gs://...`), copy the files up."""
    if is_local(out):
        write(pathlib.Path(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        write(pathlib.Path(tmp) / "out")
        out.mkdir(parents=True, exist_ok=True)
        files = sorted((pathlib.Path(tmp) / "out").iterdir(), key=lambda f: f.name == "config.json")
        for f in files:  # config.json last: a reader never sees a folder without weights
            epath.Path(f).copy(out / f.name, overwrite=True)


class TensorBoardRuns:
    """tensorboardX writers: `tb/` for the run's lines, `tb/seed_<s>/` for a seed's (each
    a run of its own in TensorBoard, so the seeds' curves of one tag sit side by side)."""

    def __init__(self, root: epath.Path):
        self.root, self._writers = root, {}

    def log(self, scalars: dict[str, float], step: int, seed) -> None:
        """Add `scalars` at `step` to seed `seed`'s run (`None`: the run's own)."""
        writer = self._writers.get(seed)
        if writer is None:
            logdir = self.root if seed is None else self.root / f"seed_{seed}"
            writer = self._writers[seed] = _summary_writer()(logdir=str(logdir), flush_secs=10)
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush and close every writer."""
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


def _summary_writer():
    """tensorboardX's `SummaryWriter`, imported on first use and without torch: its writer
    module imports torch whenever torch is installed (1.6-3 s of every logging process's
    start-up), and scalars never need it. Imported as it is where torch already is."""
    if "torch" in sys.modules or "tensorboardX.writer" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class BucketLines:
    """A write-only text sink for `metrics.jsonl` on a bucket: each write adds to the
    kept lines and `flush` rewrites the file (buckets have no appends)."""

    def __init__(self, lines: list[str], path: epath.Path):
        self.lines, self.path, self.closed = lines, path, False

    def write(self, text: str) -> int:
        """Keep `text` (written out at the next `flush`)."""
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        """Rewrite the whole file with the lines kept."""
        write_atomic(self.path, "".join(self.lines))

    def close(self) -> None:
        """Mark the sink closed (the lines stay written)."""
        self.closed = True
