"""`RunLock`: one process at a time in a run directory.

The lock is `RUN_DIR/run.lock`, held with `fcntl.flock` (the kernel releases it when its
owner exits, `kill -9` included) and holding the owner's pid, host and start time, so a
refused process can name the owner. A lock file whose lock is free is what a killed owner
leaves behind: the next process takes it over and says so. `release()` (at the end of a
run) deletes the file. Buckets (`gs://...`) have no file locks: there a run directory is
not locked, and one writer at a time is the user's to ensure.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys

__all__ = ["LOCK_FILE", "RunLock", "RunLockedError"]

LOCK_FILE = "run.lock"


class RunLockedError(ValueError):
    """Another live process holds the run directory's lock (the message names it)."""


def _owner(text: str) -> dict:
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict) -> str:
    if not owner:
        return "another process (the lock file names no owner yet)"
    return (f"process {owner.get('pid')} on host {owner.get('host')} (since "
            f"{owner.get('started', '?')})")


class RunLock:
    """The lock of the run directory `directory` (a local folder that exists), taken at
    construction: `RunLockedError` when a live process holds it; a stale lock (its owner
    was killed) is taken over with a note on stderr. `release()` frees it (idempotent)."""

    def __init__(self, directory: str | os.PathLike):
        self.path = os.path.join(os.fspath(directory), LOCK_FILE)
        self._fd: int | None = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                with open(fd, encoding="utf-8", closefd=True) as fh:
                    owner = _owner(fh.read())
                raise RunLockedError(
                    f"{directory} is in use by {_describe(owner)}: its lock {self.path} is "
                    "held. Wait for that run to end (or stop it), or choose another "
                    "run.dir") from None
            # The file may have been deleted (released) between our open and our lock:
            # then the lock is on a dead inode and the next process would take a new one.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        old = _owner(os.pread(fd, 65536, 0).decode("utf-8", "replace"))
        if old:
            print(f"[rljax] {directory}: taking over the stale lock of {_describe(old)}, "
                  "which is gone (killed?)", file=sys.stderr, flush=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        """Delete the lock file and free the lock (the file first: a process waiting to
        open it then makes a new one)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
