"""``CompileLog``: the XLA compilations of a block by program name, how a run shows that it
compiles each of its programs once. The programs themselves are module-level ``jax.jit``
functions of frozen specs (``rljax.train.programs.step``): JAX's cache shares them between
trainers with equal specs.

The package: ``step`` (the step's programs and their ``StepSpec``), ``device`` (the
device reward's programs: sample -> score -> learn as one program, and the held-out
evaluation's scores), ``paths`` (the forward paths a program takes, resolved once per
trainer).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

__all__ = ["CompileLog", "program_signature"]


def program_signature(static, args) -> tuple:
    """What a jitted program is compiled for besides its static arguments' identity:
    ``static`` and every argument's shape and dtype."""
    leaves, treedef = jax.tree.flatten(args)
    return static, treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)


class CompileLog:
    """The XLA compilations in a ``with`` block, in order, as ``(program name, seconds)``
    in ``compiles`` (jax.monitoring's backend-compile events: every program this process
    compiles in the block, on any thread; a load from JAX's persistent cache counts too).
    Names are JAX's: ``jit(learn_step)``, ``jit(seeds_step)``, ``jit(seeds_sft_update)``, ..."""

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
