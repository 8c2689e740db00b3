"""`python -m rljax ...` runs the `rljax` command line (see `rljax.cli`).

A Ctrl-C while the command line loads (JAX's imports take seconds) exits 130 once the
imports are done, like one during the command; a second one stops at once. Python's own
handler would raise KeyboardInterrupt wherever the main thread is: inside a C extension's
initialisation it becomes an ImportError, and inside a library's garbage-collection
callback (JAX registers one) it is printed and dropped, so the run would go on.
"""

import signal
import sys

_CTRL_C: list[int] = []


def _ctrl_c(signum, frame):
    """The first Ctrl-C is remembered; the next one raises (Python's own handler)."""
    _CTRL_C.append(signum)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _load():
    """`rljax.cli.main`, imported with Ctrl-C held (unless SIGINT is ignored: a process
    started in the background keeps ignoring it); exits 130 after a Ctrl-C."""
    held = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if held:
        signal.signal(signal.SIGINT, _ctrl_c)
    try:
        from rljax.cli import main
    finally:
        if held and not _CTRL_C:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if _CTRL_C:
        print("rljax: interrupted", file=sys.stderr)
        sys.exit(130)
    return main


if __name__ == "__main__":
    sys.exit(_load()())
