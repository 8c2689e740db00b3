"""The collectives of a compiled SPMD program, read from its HLO, and the rules they keep.

A sharded program's communication is what it costs on a pod (docs/pods.md, "Collective
audit"). `rljax.sharding.hlo_collectives` reads a compiled program's collectives
(:func:`parse_collectives`, re-exported here with :class:`Collective`, :class:`Loop`,
:func:`group_axes` and :func:`activation_rows`).

:func:`classify` applies the audit's rules. A collective is *expected* only if it is

  (a) an all-gather of a parameter shard over fsdp (the FSDP weight gather of a pass),
      or XLA:TPU's collective-matmul form of it: parameter shards passed around the
      fsdp ring by collective-permutes;
  (b) a gradient reduce-scatter or all-reduce over the batch axes, executed at most once
      per micro-batch (per layer, for a stacked layer's slice); its operands are
      parameter-shaped before XLA's padding (XLA:TPU reduce-scatters a dimension it
      cannot split evenly as an all-reduce of a zero-padded operand). Over an axis that
      crosses DCN (``data`` on several slices): at most once per update;
  (c) an activation collective over the tensor axis only, no larger than one layer's
      activation at the ideal rows per device (micro-batch / (data x fsdp));
  (d) at most 1 KiB on a chip;
  (e) on several slices, a reduction over DCN (``dcn-all-reduce``, XLA:TPU's cross-slice
      part of a gradient reduction over ``data``) executed at most once per update (once
      per layer inside a layer scan);
  (f) batch rows moved between batch shards: an all-to-all or collective-permute within
      the batch axes, or an all-gather / all-reduce of integer or boolean arrays (token
      ids, masks, the lookup's indices) within them, no larger than one layer's
      activation at the ideal rows (the embedding lookup's exchange of each chip's table
      columns, the shared prompt's hidden states read from the shard that holds them, the
      micro-batch layout); its bytes per step are what it costs.

Everything else is *unexpected*.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
from flax import nnx

from rljax.sharding.hlo_collectives import (DCN_PREFIX, Collective, Loop, activation_rows,
                                            group_axes, parse_collectives, shapes_bytes)
from rljax.sharding.rules import BATCH_AXES, logical_axes, state_shardings

__all__ = ["DCN_PREFIX", "Collective", "Expectation", "Loop", "activation_rows", "classify",
           "group_axes", "parameter_sizes", "parse_collectives", "state_parameter_sizes"]

SMALL_BYTES = 1024
_INDEX_DTYPES = ("pred", "s8", "u8", "s16", "u16", "s32", "u32", "s64", "u64")


def parameter_sizes(shapes_and_specs: Sequence, mesh_shape: Mapping[str, int]) -> dict:
    """``{elements on one chip: slices per parameter}`` for every way a parameter can be
    held: its global shape split by any subset of the mesh axes its spec names, whole
    (slices 1) or as one slice of its leading stacked-layers axis (slices L).

    shapes_and_specs: ``(shape, spec, stacked)`` triples, spec a PartitionSpec-like tuple
    of mesh axis names / tuples / None per dimension, stacked: dimension 0 is layers.
    """
    sizes: dict[int, int] = {}
    for shape, spec, stacked in shapes_and_specs:
        axes = sorted({a for s in spec if s for a in ((s,) if isinstance(s, str) else s)})
        for mask in range(2 ** len(axes)):
            split = math.prod(mesh_shape[a] for k, a in enumerate(axes) if mask >> k & 1)
            n = math.prod(shape) // split
            sizes[n] = max(sizes.get(n, 1), 1)
            if stacked and shape[0] > 1:
                sizes[n // shape[0]] = max(sizes.get(n // shape[0], 1), shape[0])
    return sizes


def state_parameter_sizes(state, mesh) -> dict:
    """:func:`parameter_sizes` of an NNX state (or abstract state) on ``mesh``, each
    variable split per its logical axes (``rljax.sharding.state_shardings``); a variable
    whose first logical axis is "layers" is stacked."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    triples = []
    for var, sh in zip(jax.tree.leaves(state, is_leaf=is_var),
                       jax.tree.leaves(state_shardings(state, mesh), is_leaf=is_var)):
        names = logical_axes(var) or ()
        spec = tuple(sh.get_value().spec)
        shape = tuple(var.get_value().shape)
        triples.append((shape, spec + (None,) * (len(shape) - len(spec)),
                        bool(names) and names[0] == "layers"))
    return parameter_sizes(triples, dict(mesh.shape))


@dataclasses.dataclass(frozen=True)
class Expectation:
    """What the rules allow in one program.

    mesh_shape: mesh axis sizes ({"data": d, "fsdp": f, "tensor": t}).
    param_sizes: :func:`parameter_sizes` of the program's parameters.
    micro_batches: micro-batch passes per run (updates x micro-batches per update;
      1 for a program without gradients): a gradient may be reduced this many times
      (times L for a stacked layer's slice).
    activation_elems: one layer's activation on a chip at the ideal rows per device
      (rows x positions x the widest of hidden, MLP and attention widths): the most a
      tensor-axis collective may move.
    updates: optimiser updates per run (epochs x minibatches; 1 without gradients): a
      gradient may cross DCN this many times (times L for a stacked layer's slice).
    dcn_axes: the mesh axes whose groups span several TPU slices (``{"data"}`` on a
      multislice mesh, else empty).
    """

    mesh_shape: Mapping[str, int]
    param_sizes: Mapping[int, int]
    micro_batches: int
    activation_elems: int
    updates: int = 1
    dcn_axes: frozenset = frozenset()


def _elems(shapes) -> list[int]:
    return [math.prod(d) for _, d in shapes]


def classify(coll: Collective, exp: Expectation) -> tuple[bool, str]:
    """``(expected, rule)``: which rule admits ``coll`` ("a" weight gather, "b" gradient
    reduction, "c" tensor-parallel activation, "d" small) or why none does."""
    if coll.bytes <= SMALL_BYTES:
        return True, "d small"
    if coll.kind.startswith(DCN_PREFIX):
        # Its groups and operands are not in the text (operands are tiled): once per
        # update, L times where its innermost loop is a layer scan (L or L - 1 trips).
        layers = max(exp.param_sizes.values(), default=1)
        per_layer = bool(coll.loops) and coll.loops[-1].trip_count in (layers - 1, layers)
        allowed = exp.updates * (layers if per_layer else 1)
        if coll.kind == DCN_PREFIX + "all-reduce" and coll.executions <= allowed:
            return True, "e gradient reduction over DCN"
        return False, f"over DCN {coll.executions}x: not a gradient reduction once per update"
    axes = set(group_axes(coll, exp.mesh_shape))
    if coll.kind == "all-gather" and axes == {"fsdp"} and all(
            n in exp.param_sizes for n in _elems(coll.result_shapes)):
        return True, "a weight gather"
    # XLA:TPU's collective matmul (windowed einsum) passes parameter shards (or their
    # gradients' partial sums) around the fsdp ring instead of gathering them whole.
    if coll.kind == "collective-permute" and axes == {"fsdp"} and all(
            n in exp.param_sizes for n in _elems(coll.operand_shapes)):
        return True, "a weight gather (collective matmul)"
    if coll.kind in ("all-reduce", "reduce-scatter") and axes and axes <= {"data", "fsdp"}:
        # XLA combines reductions: parameter-shaped operands (before any padding), plus at
        # most 1 KiB of others.
        shapes = coll.unpadded_shapes or coll.operand_shapes
        per = [exp.param_sizes.get(n) for n in _elems(shapes)]
        rest = sum(shapes_bytes([sh]) for sh, k in zip(shapes, per) if k is None)
        layers = max((k for k in per if k), default=0)
        if layers and rest <= SMALL_BYTES:
            if axes & exp.dcn_axes and coll.executions > exp.updates * layers:
                return False, (f"gradient crosses DCN {coll.executions}x, more than once "
                               "per update")
            if coll.executions <= exp.micro_batches * layers:
                return True, "b gradient reduction"
            return False, (f"gradient reduced {coll.executions}x, more than once per "
                           "micro-batch")
    largest = max(_elems(coll.operand_shapes) + _elems(coll.result_shapes))
    if axes == {"tensor"} and largest <= exp.activation_elems:
        return True, "c tensor activation"
    if axes and axes <= set(BATCH_AXES) and largest <= exp.activation_elems and (
            coll.kind in ("all-to-all", "collective-permute") or all(
                dt in _INDEX_DTYPES for dt, _ in coll.operand_shapes)):
        return True, "f rows between batch shards"
    return False, "over " + ("x".join(sorted(axes)) or "no axis") + \
        (" at more than the ideal rows" if axes == {"tensor"} else "")
