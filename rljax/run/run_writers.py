"""The run directory's metric sinks: tensorboardX writers (one TensorBoard run per seed)
and `metrics.jsonl` on a bucket (rewritten whole, buckets have no appends)."""

from __future__ import annotations

from etils import epath

__all__ = ["BucketLines", "TensorBoardRuns", "write_atomic"]


def write_atomic(path: epath.Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename: readers see the
    old file or the new one, never half of one."""
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


class TensorBoardRuns:
    """tensorboardX writers: `tb/` for the run's lines, `tb/seed_<s>/` for a seed's (each
    a run of its own in TensorBoard, so the seeds' curves of one tag sit side by side)."""

    def __init__(self, root: epath.Path):
        self.root, self._writers = root, {}

    def log(self, scalars: dict[str, float], step: int, seed) -> None:
        """Add `scalars` at `step` to seed `seed`'s run (`None`: the run's own)."""
        writer = self._writers.get(seed)
        if writer is None:
            # Imported here: tensorboardX imports torch when torch is installed (~1.1 s).
            from tensorboardX import SummaryWriter

            logdir = self.root if seed is None else self.root / f"seed_{seed}"
            writer = self._writers[seed] = SummaryWriter(logdir=str(logdir), flush_secs=10)
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush and close every writer."""
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


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
