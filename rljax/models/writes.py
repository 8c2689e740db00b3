"""Atomic folder writes: nothing half-written is ever visible at the destination."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Yield a temporary folder; on success its files replace those at `path`.

    A new `path` appears by one `os.rename` of the finished folder. An existing `path`
    (e.g. one that already holds tokenizer files) gets each file moved in by `os.replace`
    (atomic per file, config.json last), and stale weight files of an earlier save are
    removed. On error the temporary folder is deleted and `path` is untouched.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        # mkdtemp makes the folder 0700; the finished folder gets a new folder's mode.
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        if not path.exists():
            os.rename(tmp, path)
            return
        if not path.is_dir():
            raise NotADirectoryError(f"save_pretrained: {path} exists and is not a directory")
        new = sorted(tmp.iterdir(), key=lambda p: p.name == "config.json")
        for old in path.glob("model*.safetensors*"):
            if not (tmp / old.name).exists():
                old.unlink()
        for f in new:
            os.replace(f, path / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
