"""Reward worker process: `python -m rljax.rewards._worker`, driven by `RewardPool`.

Reads pickled `(fn, completion, meta)` calls from stdin and writes `("started",)` once
a call is loaded, then `("ok", value)` or `("error", message, traceback)`, to the
original stdout; the reward code's own prints
go to stderr so they cannot corrupt the result stream. Started as a fresh interpreter
(not forked, not via multiprocessing's spawn), so it neither inherits the trainer's JAX
threads nor re-runs the trainer's `__main__` script.

A worker ignores SIGINT (Ctrl-C): the training process owns it and stops its workers
(`RewardPool.close`). It is started with SIGINT blocked, so a Ctrl-C during its start-up
waits, and is dropped once SIGINT is ignored.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection


def main() -> None:
    """Serve calls until stdin closes or a `None` call arrives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # drops a Ctrl-C pending since the start
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints from reward code go to stderr
    rd, wr = Connection(os.dup(0), writable=False), Connection(out_fd, readable=False)
    while True:
        try:
            data = rd.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            task = pickle.loads(data)
        except Exception as e:
            wr.send(("error", f"cannot load the call in the worker ({type(e).__name__}: {e}); "
                     "reward functions must be importable (defined at module level in a "
                     "module, not in __main__)", ""))
            continue
        if task is None:
            return
        fn, completion, meta = task
        wr.send(("started",))  # the time limit runs from here, not from interpreter start
        try:
            wr.send(("ok", fn(completion, meta)))
        except Exception as e:  # the reward's own frames (this loop's frame left out)
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            wr.send(("error", f"{type(e).__name__}: {e}", tb))


if __name__ == "__main__":
    main()
