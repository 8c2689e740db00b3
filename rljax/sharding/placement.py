"""A state's placement across compiled programs.

A program that updates a state (parameters, optimiser moments) returns it on the
shardings it came with, so the next call passes equal arguments and donates the buffers
in place. Module-level programs (``rljax.train.programs.step``, ``rljax.train.sft``) take
those shardings as part of their static spec (``output_shardings``) and constrain their
outputs to them from inside (``place_outputs``); a state whose shardings are spelled
otherwise is re-spelled once before the first call (``put_on``).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from rljax.sharding.rules import replicated

__all__ = ["canonical_sharding", "output_shardings", "place_outputs", "put_on"]


def canonical_sharding(sharding):
    """``sharding`` spelled as a compiled program returns it: a ``NamedSharding``'s mesh
    axes of size 1 dropped (``P("tensor", "fsdp")`` -> ``P(None, "fsdp")`` where tensor is
    1) and then its trailing ``None`` axes (``P("fsdp", None)`` -> ``P("fsdp")``). Each is
    the same placement but not an equal sharding: a program returns one spelling for every
    leaf of one placement (the value model's and the policy's alike), so a program fed
    another would be compiled twice. Other shardings are returned as they are."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    sizes = sharding.mesh.shape

    def kept(entry):
        names = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ())
                      if sizes[a] > 1)
        return None if not names else names[0] if len(names) == 1 else names

    spec = tuple(kept(e) for e in sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    if spec == tuple(sharding.spec):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def output_shardings(mesh, tree, *, of_shardings: bool = False) -> tuple | None:
    """On a mesh, ``(treedef, leaves)`` of ``tree``'s array shardings spelled canonically
    (:func:`canonical_sharding`): hashable, for a program spec whose outputs
    keep the placement of ``tree`` (a state's parameters and optimiser state). None
    without a mesh."""
    if mesh is None:
        return None
    get = (lambda x: x) if of_shardings else (lambda x: x.sharding)
    leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: canonical_sharding(get(x)), tree))
    return treedef, tuple(leaves)


def put_on(tree, shardings: tuple | None):
    """``tree`` on ``shardings`` (from :func:`output_shardings`): the same placement,
    spelled as the programs return it, so every call passes equal arguments; ``tree``
    itself when it already is (no copy)."""
    if shardings is None:
        return tree
    want = jax.tree.unflatten(*shardings)
    if all(x.sharding == s for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(want))):
        return tree
    return jax.device_put(tree, want)


def place_outputs(mesh, shardings: tuple | None, kept, *rest):
    """Inside a program: ``kept`` constrained to ``shardings`` (the state's placement) and
    every tree of ``rest`` (counters, metrics) replicated; ``(kept, *rest)``."""
    if mesh is None:
        return (kept, *rest)
    kept = jax.lax.with_sharding_constraint(kept, jax.tree.unflatten(*shardings))
    rep = replicated(mesh)
    rest = jax.lax.with_sharding_constraint(rest, jax.tree.map(lambda _: rep, rest))
    return (kept, *rest)
