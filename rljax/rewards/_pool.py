"""`RewardPool`: worker processes that run reward calls under a per-call time limit."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence


# Generous limit for a worker to load a call (interpreter start-up, importing the reward
# function's module); the per-call time limit starts after that.
LOAD_LIMIT_S = 120.0


class _Worker:
    """One `python -m rljax.rewards._worker` process and its two pipe ends."""

    def __init__(self):
        env = dict(os.environ)
        # The parent's import path, so reward functions from its modules (tests, user
        # packages not installed) unpickle in the worker.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # Ctrl-C belongs to the training process, which stops its workers; a terminal
        # sends it to the whole process group, workers included. A worker ignores it from
        # its first instruction: SIGINT is blocked in this thread while the worker is
        # started, so the worker begins with it blocked (a Ctrl-C then stays pending, and
        # the worker drops it when it sets SIGINT to be ignored before unblocking it).
        # Here a Ctrl-C in that moment is not lost: another thread or the unblock takes it.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "rljax.rewards._worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.send = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.recv = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.send.close()
        self.recv.close()

    def stop(self) -> None:
        try:
            self.send.send_bytes(pickle.dumps(None))
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()  # a no-op on the process if it has exited


class RewardPool:
    """Worker processes for `score_batch`; keep one open across training steps.

    Workers are fresh interpreters (`python -m rljax.rewards._worker`): safe to start from
    a process running JAX, and the caller's script needs no `if __name__ == "__main__"`
    guard. Reward functions and metadata must pickle, and functions must be importable
    (module-level functions or frozen dataclasses such as those in
    `rljax.rewards.compose`). A call past its time limit has its worker killed and
    replaced (a fresh interpreter costs a fraction of a second).
    """

    def __init__(self, workers: int = 2):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"RewardPool.workers must be an int >= 1, got {workers!r}")
        self._workers: list[_Worker | None] = [_Worker() for _ in range(workers)]

    @property
    def workers(self) -> int:
        """Number of worker processes."""
        return len(self._workers)

    def _replace(self, w: int) -> None:
        self._workers[w].kill()
        self._workers[w] = _Worker()

    def _dispatch(self, w: int, task: Any) -> tuple[str, str, str] | None:
        try:
            data = pickle.dumps(task)
        except Exception as e:  # e.g. a lambda or a closure
            return ("error", f"cannot send the call to a worker process ({type(e).__name__}: "
                    f"{e}); use a module-level function or a frozen dataclass", "")
        try:
            self._workers[w].send.send_bytes(data)
        except OSError:  # the idle worker died (e.g. killed from outside): replace it
            self._replace(w)
            self._workers[w].send.send_bytes(data)
        return None

    def run(self, tasks: Sequence[tuple[Any, str, Any]], timeout_s: float | None
            ) -> list[tuple]:
        """Run `(fn, completion, meta)` tasks; per task ("ok", value), ("error", msg, tb)
        or ("timeout", seconds). The limit counts from when the worker has loaded the
        call (so interpreter start-up and importing the function's module are not
        charged to it; loading itself gets `LOAD_LIMIT_S`). A task past its limit has
        its worker killed and replaced; the other tasks continue."""
        if any(w is None for w in self._workers):
            raise RuntimeError("RewardPool.run: the pool is closed")
        results: list[Any] = [None] * len(tasks)
        pending = list(range(len(tasks)))[::-1]
        busy: dict[int, list] = {}  # worker -> [task, dispatch time, start time or None]
        while pending or busy:
            for w in range(self.workers):
                while w not in busy and pending:
                    t = pending.pop()
                    failed = self._dispatch(w, tasks[t])
                    if failed:
                        results[t] = failed
                    else:
                        busy[w] = [t, time.monotonic(), None]
            ready = wait([self._workers[w].recv for w in busy], timeout=0.05)
            for w in list(busy):
                if self._workers[w].recv in ready and self._receive(w, busy, results):
                    continue
                t, t_sent, t_start = busy[w]
                now = time.monotonic()
                over = (t_start is not None and timeout_s is not None
                        and now - t_start > timeout_s) or \
                    (t_start is None and now - t_sent > max(LOAD_LIMIT_S, timeout_s or 0))
                if over:
                    results[t] = ("timeout", now - (t_start or t_sent))
                    self._replace(w)
                    del busy[w]
        return results

    def _receive(self, w: int, busy: dict, results: list) -> bool:
        """Read one message from worker w; True if its task finished."""
        t = busy[w][0]
        try:
            msg = self._workers[w].recv.recv()
        except (EOFError, OSError):
            msg = ("error", "the worker process died", "")
            self._replace(w)
        if msg[0] == "started":
            busy[w][2] = time.monotonic()
            return False
        results[t] = msg
        del busy[w]
        return True

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        for w, worker in enumerate(self._workers):
            if worker is not None:
                worker.stop()
                self._workers[w] = None

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
