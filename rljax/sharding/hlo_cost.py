"""FLOPs and HBM bytes of a compiled program, read from its HLO text, loops counted.

XLA's ``compiled.cost_analysis()`` counts a while body once, whatever its trip count, so
a scanned layer stack or a micro-batch loop is undercounted by its trips. :func:`op_costs`
reads ``compiled.as_text()`` instead (the optimised, partitioned module: one chip's
program) and gives each instruction that touches HBM an :class:`OpCost` with its loops'
executions (`rljax.sharding.hlo_collectives.walk_instructions`):

| op | FLOPs | HBM bytes |
|---|---|---|
| ``dot`` | 2 x result elements x contracted size | operands + result |
| ``convolution`` (XLA:TPU writes most dots as one) | 2 x batch x output features x input features / groups x valid window positions (as XLA's own cost analysis) | operands + result |
| ``fusion`` | the dots and convolutions inside it | operands + result at the fusion's boundary; an operand the fusion (or a fusion inside it) only slices counts the slices' bytes, a buffer it updates in place (``dynamic-update-slice`` root) the update's |
| ``custom-call`` | 0 (a Pallas kernel declares no cost: ``kernel`` names it, and its operand shapes are kept, for a caller's model) | operands + result |
| everything else that moves data (copies, slices, gathers, ...) | 0 | operands + result |

Not counted: parameters, constants, tuples, bitcasts, control flow (their bodies are),
collectives (`rljax.sharding.hlo_collectives.parse_collectives` has them) and XLA:TPU's
bookkeeping custom calls. Element-wise arithmetic is not counted as FLOPs (it is
bandwidth-bound at these sizes). Tiled layouts' padding is ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re

from rljax.sharding.hlo_collectives import (KINDS, hlo_shapes, module_index, operand_names,
                                            shapes_bytes, walk_instructions)

__all__ = ["OpCost", "conv_flops", "op_costs"]

_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
               "call", "conditional", "after-all", "partition-id", "replica-id",
               "opt-barrier", "send", "send-done", "recv", "recv-done", "copy-done",
               "iota", "add-dependency"}
_BOOKKEEPING = ("AllocateBuffer", "AsyncCollectiveStart", "AsyncCollectiveDone",
                "ConcatBitcast", "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked")
_SLICES = ("dynamic-slice", "slice", "gather")


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One HLO instruction's cost per execution on one chip, and its executions.

    kernel: a custom call's name (e.g. ``splash_mha_fwd_segmented_residuals``), "" for
    other ops; operands: a custom call's operand shapes (``(dtype, dims)``)."""

    name: str
    op: str
    flops: float
    hbm_bytes: int
    executions: int
    kernel: str = ""
    operands: tuple = ()


def _dims(attr: str, rest: str) -> list[int]:
    m = re.search(attr + r"=\{([\d,]*)\}", rest)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _window(rest: str, n: int) -> list[dict]:
    """Per spatial dimension: size, stride, pad_lo, pad_hi, lhs / rhs dilation."""
    win = re.search(r"window=\{([^}]*)\}", rest)
    fields = dict(re.findall(r"(\w+)=([\dx_]+)", win.group(1))) if win else {}
    get = lambda k, d: [x for x in fields.get(k, "").split("x") if x] or [d] * n  # noqa: E731
    pads = [p.split("_") for p in get("pad", "0_0")]
    return [dict(size=int(s), stride=int(st), lo=int(p[0]), hi=int(p[1]), lhs=int(ld),
                 rhs=int(rd))
            for s, st, p, ld, rd in zip(get("size", "1"), get("stride", "1"), pads,
                                        get("lhs_dilate", "1"), get("rhs_dilate", "1"))]


def _valid_positions(n_in: int, n_out: int, w: dict) -> int:
    """(output, kernel) position pairs of one spatial dimension that read a real input."""
    span = (n_in - 1) * w["lhs"] + 1
    count = 0
    for o in range(n_out):
        for k in range(w["size"]):
            i = o * w["stride"] - w["lo"] + k * w["rhs"]
            count += 0 <= i < span and i % w["lhs"] == 0
    return count


def conv_flops(lhs: tuple, rhs: tuple, out: tuple, rest: str) -> float:
    """FLOPs of an HLO convolution (``dim_labels=lhs_rhs->out`` in ``rest``), counted as
    XLA's HloCostAnalysis does: 2 x batch / batch groups x output features x input
    features / feature groups x valid window positions of every spatial dimension."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest).groups()
    spatial = sorted(c for c in labels[0] if c.isdigit())
    wins = _window(rest, len(spatial))
    valid = math.prod(_valid_positions(lhs[labels[0].index(c)], out[labels[2].index(c)], w)
                      for c, w in zip(spatial, wins))
    groups = re.search(r"feature_group_count=(\d+)", rest)
    bgroups = re.search(r"batch_group_count=(\d+)", rest)
    batch = lhs[labels[0].index("b")] // (int(bgroups.group(1)) if bgroups else 1)
    fin = lhs[labels[0].index("f")] // (int(groups.group(1)) if groups else 1)
    return 2.0 * batch * rhs[labels[1].index("o")] * fin * valid


def _dot_flops(lhs: tuple, out: tuple, rest: str) -> float:
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in _dims("lhs_contracting_dims", rest))


def _first_dims(shape_text: str) -> tuple:
    found = hlo_shapes(shape_text)
    return found[0][1] if found else ()


def _math_flops(ins, types: dict) -> float:
    args = operand_names(ins.rest)
    out = _first_dims(ins.rtype)
    if ins.op == "dot" and args:
        return _dot_flops(_first_dims(types.get(args[0], "")), out, ins.rest)
    if ins.op == "convolution" and len(args) >= 2:
        return conv_flops(_first_dims(types[args[0]]), _first_dims(types[args[1]]), out,
                          ins.rest)
    return 0.0


def _fused(comps: dict, callee: str) -> tuple[dict, dict, tuple | None]:
    """A fused computation's parameters by index, each value's users ``(op, name, rest)``,
    and its root's ``(op, rest)``."""
    params, users, root = {}, {}, None
    for line in comps.get(callee, []):
        m = re.match(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=.*?\s([\w\-]+)\((.*)$", line)
        if m is None:
            continue
        if m.group(3) == "parameter":
            params[int(re.match(r"\s*(\d+)", m.group(4)).group(1))] = m.group(2)
        for a in operand_names(m.group(4)):
            users.setdefault(a, []).append((m.group(3), m.group(2), m.group(4)))
        root = (m.group(3), m.group(4)) if m.group(1) else root
    return params, users, root


def _read_bytes(comps: dict, callee: str, index: int, full: int, defs: dict,
                depth: int = 0) -> int:
    """Bytes a fused computation reads of its parameter ``index`` (``full`` bytes): the
    slices' bytes when every use slices it (through nested fusions), else ``full``."""
    params, users, _ = _fused(comps, callee)
    uses = users.get(params.get(index, ""), [])
    if not uses or depth > 4:
        return full
    total = 0
    for op, name, rest in uses:
        if op == "dynamic-update-slice" and operand_names(rest)[0] == params[index]:
            continue  # the buffer updated in place: only the update moves
        if op in _SLICES:
            total += shapes_bytes(hlo_shapes(defs[name][0]))
        elif op == "fusion":
            inner = re.search(r"calls=%?([\w.\-]+)", rest).group(1)
            total += _read_bytes(comps, inner, operand_names(rest).index(params[index]), full, defs,
                                 depth + 1)
        else:
            return full
    return min(total, full)


def _fusion_bytes(ins, comps: dict, defs: dict, types: dict) -> int:
    """A fusion's operands and result at its boundary; operands only sliced inside count
    their slices, an in-place dynamic-update-slice root its update."""
    callee = re.search(r"calls=%?([\w.\-]+)", ins.rest).group(1)
    args = operand_names(ins.rest)
    total = sum(_read_bytes(comps, callee, i, shapes_bytes(hlo_shapes(types.get(a, ""))), defs)
                for i, a in enumerate(args))
    root = _fused(comps, callee)[2]
    if root is not None and root[0] == "dynamic-update-slice":  # in place: the update
        return total + shapes_bytes(hlo_shapes(defs[operand_names(root[1])[1]][0]))
    return total + shapes_bytes(hlo_shapes(ins.rtype))


def _traffic(ins, comps: dict, defs: dict, types: dict) -> int:
    if ins.op == "fusion":
        return _fusion_bytes(ins, comps, defs, types)
    if ins.op == "dynamic-update-slice":
        return 2 * shapes_bytes(hlo_shapes(types.get(operand_names(ins.rest)[1], "")))
    if ins.op in _SLICES:
        return 2 * shapes_bytes(hlo_shapes(ins.rtype))
    return sum(shapes_bytes(hlo_shapes(types.get(a, ""))) for a in operand_names(ins.rest)) + (
        shapes_bytes(hlo_shapes(ins.rtype)))


def _braced(text: str, key: str) -> str:
    """The ``{...}`` after ``key`` in ``text`` (nested braces included), or ""."""
    start = text.find(key + "{")
    depth, i = 0, start + len(key)
    while start >= 0 and i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len(key):i + 1]
        i += 1
    return ""


def _skipped(ins) -> bool:
    base = ins.op.removesuffix("-start").removesuffix("-done")
    target = re.search(r'custom_call_target="([^"]*)"', ins.rest)
    return (ins.op in _NO_TRAFFIC or base in KINDS
            or (target is not None and target.group(1) in _BOOKKEEPING))


def op_costs(hlo: str, unknown_trip=None) -> list[OpCost]:
    """Every HBM-touching instruction of one chip's program (see the module docstring),
    with its executions per run: the enclosing loops' trip counts multiplied (a loop
    whose trip count XLA does not state and the condition does not give counts
    ``unknown_trip(while_name, loops_around)`` times, or once without it)."""
    comps, _, defs = module_index(hlo)
    types = {k: v[0] for k, v in defs.items()}
    out: list[OpCost] = []
    for ins in walk_instructions(hlo, unknown_trip):
        if ins.fused or _skipped(ins):  # a fusion's dots are credited to the fusion
            continue
        executions = math.prod(lp.trip_count or 1 for lp in ins.loops)
        flops = (_fusion_flops(ins, comps, types) if ins.op == "fusion"
                 else _math_flops(ins, types))
        kernel, operands = "", ()
        if ins.op == "custom-call":
            kernel = ins.name.rsplit(".", 1)[0]
            operands = hlo_shapes(_braced(ins.rest, "operand_layout_constraints="))
        out.append(OpCost(ins.name, ins.op, flops, _traffic(ins, comps, defs, types),
                          executions, kernel, operands))
    return out


def _fusion_flops(ins, comps: dict, types: dict, depth: int = 0) -> float:
    """The dots and convolutions of a fusion's computation (nested fusions included)."""
    callee = re.search(r"calls=%?([\w.\-]+)", ins.rest).group(1)
    total = 0.0
    for line in comps.get(callee, []):
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$", line)
        if m is None:
            continue
        inner = dataclasses.replace(ins, name=m.group(1), rtype=m.group(2), op=m.group(3),
                                    rest=m.group(4))
        if inner.op == "fusion" and depth < 4:
            total += _fusion_flops(inner, comps, types, depth + 1)
        else:
            total += _math_flops(inner, types)
    return total
