"""`python -m rljax ...` and the `rljax` command run the command line (`rljax.cli`) by `run`.

Ctrl-C always ends the command with status 130. While the command line loads (JAX's
imports take seconds) a Ctrl-C is held until the imports are done; a second one stops at
once. Then, for the command, `rljax.run.preemption.CtrlC` raises KeyboardInterrupt as
Python's own handler does and remembers the Ctrl-C: Python drops a KeyboardInterrupt
raised inside a library's garbage-collection callback (JAX registers one; "Exception
ignored in ..."), and inside a C extension's initialisation it becomes an ImportError. A
run reads the mark at its next step (`rljax.run.preemption.StopSignal`); a command that
went on to its end after a dropped Ctrl-C exits 130 too, and one during the exit's
clean-up (workers stopped, files closed) ends the process by SIGINT itself.
"""

import signal
import sys

_HELD: list[int] = []


def _hold(signum, frame):
    """While loading: the first Ctrl-C is remembered; the next one raises (Python's own)."""
    _HELD.append(signum)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted() -> int:
    print("rljax: interrupted", file=sys.stderr)
    return 130


def run() -> int:
    """The `rljax` command: `rljax.cli.main()` with Ctrl-C handled as the module docstring
    says (unless SIGINT is ignored: a process started in the background keeps ignoring
    it); its exit status."""
    own = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if own:
        signal.signal(signal.SIGINT, _hold)
    try:
        from rljax.cli import main
        from rljax.run.preemption import CtrlC
    finally:
        if own and not _HELD:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if _HELD:
        return _interrupted()
    latch = CtrlC()
    if own:
        signal.signal(signal.SIGINT, latch)
    status = main()
    if own:  # the command is done: a Ctrl-C during the exit's clean-up ends it at once
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # (a shell reports 130)
    return _interrupted() if latch.hit and status == 0 else status


if __name__ == "__main__":
    sys.exit(run())
