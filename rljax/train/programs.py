"""Jitted programs shared by the trainers of one process.

A trainer's program is a function of its model's structure and of the configs it reads;
two trainers with equal ones (a resumed run in the same process, the demo's SFT baseline
after its warm-up, a second run in a notebook) would otherwise compile the same program
again. ``shared(key, build)`` returns the program stored under ``key`` and calls ``build``
(which returns a ``jax.jit`` function: it compiles at its first call) only when there is
none. A key must hold everything the program computes with; its closures are then those of
the first trainer, equal by construction to any later one's. The least recently used
program goes once a process holds more than ``MAX_PROGRAMS``, and its executables with it.

``CompileLog`` records the XLA compilations of a block by program name: how a run shows
that it compiles each of its programs once.
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable

import jax

__all__ = ["MAX_PROGRAMS", "CompileLog", "shared"]

MAX_PROGRAMS = 8
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()


def shared(key: Hashable, build: Callable[[], Callable]) -> Callable:
    """The program stored under ``key``, built by ``build()`` the first time."""
    if key in _PROGRAMS:
        _PROGRAMS.move_to_end(key)
        return _PROGRAMS[key]
    while len(_PROGRAMS) >= MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    program = _PROGRAMS[key] = build()
    return program


class CompileLog:
    """The XLA compilations in a ``with`` block, in order, as ``(program name, seconds)``
    in ``compiles`` (jax.monitoring's backend-compile events: every program this process
    compiles in the block, on any thread; a load from JAX's persistent cache counts too).
    Names are JAX's: ``jit(rl_step)``, ``jit(sft_update)``, ``jit(evaluate)``, ..."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.compiles: list[tuple[str, float]] = []

    @property
    def count(self) -> int:
        return len(self.compiles)

    def by_name(self) -> collections.Counter:
        """How many times each program name was compiled."""
        return collections.Counter(name for name, _ in self.compiles)

    def summary(self, top: int = 4) -> str:
        """One line: the count, the seconds, and the slowest programs with their counts."""
        names, slowest = self.by_name(), {}
        for name, seconds in self.compiles:
            slowest[name] = max(seconds, slowest.get(name, 0.0))
        ranked = sorted(slowest, key=lambda n: -slowest[n])[:top]
        total = sum(s for _, s in self.compiles)
        biggest = ", ".join(f"{n} x{names[n]} ({slowest[n]:.1f} s)" for n in ranked)
        return f"{self.count} XLA compilations, {total:.1f} s; the slowest: {biggest or 'none'}"

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            self.compiles.append((str(kwargs.get("fun_name", "?")), float(duration)))

    def __enter__(self) -> CompileLog:
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self)
