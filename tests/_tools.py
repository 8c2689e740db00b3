"""Hostile tools that tests/test_envs.py runs in reward worker processes: a module of
their own, standard library only, so a worker loads it in a fraction of a second."""

import os
import time


class _Tool:
    """Name, description and an empty argument schema: what `rljax.envs.Tool` asks for."""

    name = "tool"
    description = "a test tool"
    parameters = {"type": "object", "properties": {}}


class Hang(_Tool):
    """Sleeps far past any test's time limit."""

    name = "hang"

    def __call__(self, arguments):
        time.sleep(3600)
        return "unreachable"


class Raise(_Tool):
    """Raises with a message of about `size` characters (a huge message must be cut too)."""

    name = "raise"

    def __init__(self, size: int = 10):
        self.size = size

    def __call__(self, arguments):
        raise RuntimeError("boom" + "!" * self.size)


class Huge(_Tool):
    """Returns 10 MB of text."""

    name = "huge"

    def __call__(self, arguments):
        return "x" * 10_000_000


class NotText(_Tool):
    """Returns a number instead of a string."""

    name = "number"

    def __call__(self, arguments):
        return 42


class Echo(_Tool):
    """Returns its `text` argument."""

    name = "echo"

    def __call__(self, arguments):
        return str(arguments.get("text", ""))


class Exit(_Tool):
    """Kills its own worker process."""

    name = "exit"

    def __call__(self, arguments):
        os._exit(3)
