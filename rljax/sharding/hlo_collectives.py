"""Collectives read from a compiled SPMD program's HLO text.

:func:`parse_collectives` reads ``compiled.as_text()`` (XLA's optimised, partitioned
module, the same text for XLA:CPU and XLA:TPU) into :class:`Collective` records: the kind
(all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute, their async
``-start`` / ``-done`` pairs counted once), operand and result shapes with their bytes on
one chip (and the operands before XLA's padding), the replica groups as device ids, and
the while loops around it, outermost first, each with XLA's ``known_trip_count``; nested
loops multiply (``Collective.executions``). On several slices XLA:TPU carries the part of
a collective that crosses slices as a host-transfer ``send`` for the megascale runtime;
these are read as kinds ``dcn-*`` (:data:`DCN_PREFIX`), groups unknown. Device ids in replica groups are positions in
the program's device assignment, which for a jitted program on a ``Mesh`` is
``mesh.devices.flat``; :func:`group_axes` maps them to the mesh axes they span.
:func:`activation_rows` reads the rows per chip of a program's activations. The rules
these records are judged by are in `rljax.sharding.collectives`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["DCN_PREFIX", "KINDS", "Collective", "Instruction", "Loop", "activation_rows",
           "group_axes", "hlo_shapes", "module_index", "operand_names", "parse_collectives",
           "shapes_bytes", "walk_instructions"]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
#: XLA:TPU's collectives between slices (over DCN): host-transfer sends that the megascale
#: runtime carries, named by their transfer type ("dcn-all-reduce", "dcn-all-gather",
#: "dcn-one-to-one" for a collective-permute). Their groups are not in the HLO text.
DCN_PREFIX = "dcn-"
_DCN_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(pred|[subfc]\d+|bf16|f8\w*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_CALLEES = re.compile(r"\b(?:body|calls|to_apply|branch_computations|condition)=\{?"
                      r"([%\w.\-, ]+)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop around a collective: the while instruction's name, its trip count
    (None when XLA does not know it; counted as 1) and its ``op_name`` metadata."""

    name: str
    trip_count: int | None
    op_name: str = ""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program (async pairs as one).

    shapes are ``(dtype, dims)`` pairs; bytes are per chip (one device's buffers).
    groups: the replica groups as tuples of device ids (positions in the program's device
    assignment); ``((),)`` when every device is in one group. loops: enclosing while
    loops, outermost first. unpadded_shapes: the operands before XLA's padding (XLA:TPU
    lowers a reduce-scatter of a dimension it cannot split evenly as an all-reduce of
    the zero-padded operand, then a slice); the operand shapes where nothing was padded.
    """

    kind: str
    name: str
    operand_shapes: tuple
    result_shapes: tuple
    groups: tuple
    loops: tuple[Loop, ...]
    op_name: str = ""
    unpadded_shapes: tuple = ()

    @property
    def bytes(self) -> int:
        """Bytes on one chip per execution: the larger of operand and result (what an
        all-gather ends with, what a reduce-scatter starts from)."""
        return max(shapes_bytes(self.operand_shapes), shapes_bytes(self.result_shapes))

    @property
    def executions(self) -> int:
        """Executions per run of the program: the enclosing loops' trip counts multiplied."""
        return math.prod(lp.trip_count or 1 for lp in self.loops)

    def loop_text(self) -> str:
        """``outer x8 > inner x64`` (the loops and their trip counts), or ``-``."""
        return " > ".join(f"{lp.name} x{lp.trip_count or '?'}" for lp in self.loops) or "-"


def shapes_bytes(shapes) -> int:
    """Bytes of ``(dtype, dims)`` shapes on one chip."""
    return sum(math.prod(dims) * _DTYPE_BYTES.get(dt, 4) for dt, dims in shapes)


def hlo_shapes(text: str) -> tuple:
    """Every array type in HLO ``text`` (``f32[8,16]{1,0}``) as ``(dtype, dims)``."""
    return tuple((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
                 for m in _SHAPE.finditer(text))


def _iota_groups(text: str) -> tuple:
    """``[G,S]<=[dims]T(perm)`` (XLA's iota replica-group list) as tuples of ids."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return tuple(tuple(int(i) for i in g) for g in ids.reshape(shape[0], -1))


def _mesh_groups(text: str) -> tuple:
    """``mesh['a'=2,'b'=4](, device_ids=(...))? {'a', 'b':(1)2}`` (XLA's mesh-axes
    replica groups): devices laid out on the named mesh, grouped along the listed axes
    (``name:(pre)size`` is the sub-axis of that size after ``pre`` major elements)."""
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}", text)
    if m is None:
        raise ValueError(f"unrecognised mesh replica groups: {text[:120]!r}")
    axes = [(a.split("=")[0].strip().strip("'"), int(a.split("=")[1]))
            for a in m.group(1).split(",") if a.strip()]
    sizes = [s for _, s in axes]
    ids = np.arange(math.prod(sizes))
    if m.group(2):  # "[4,2]T(1,0)": iota reshaped and transposed, else the ids listed
        iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2).strip())
        if iota:
            grid = ids.reshape([int(x) for x in iota.group(1).split(",")])
            perm = iota.group(2)
            ids = (grid.transpose([int(x) for x in perm.split(",")]) if perm else grid).ravel()
        else:
            ids = np.asarray([int(x) for x in re.findall(r"\d+", m.group(2))])
    # Split every axis into [pre, size, rest] pieces wherever a sub-axis names one.
    names = [n for n, _ in axes]
    pieces: list[list[tuple[int, bool]]] = [[(s, False)] for s in sizes]
    for ref in (r.strip().strip("'") for r in m.group(3).split(",") if r.strip()):
        sub = re.match(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?$", ref)
        i = names.index(sub.group(1))
        if sub.group(2) is None:
            pieces[i] = [(sizes[i], True)]
        else:
            pre, size = int(sub.group(2)), int(sub.group(3))
            pieces[i] = [(pre, False), (size, True), (sizes[i] // (pre * size), False)]
    flat = [p for axis in pieces for p in axis]
    grid = ids.reshape([s for s, _ in flat])
    grouped = [k for k, (_, g) in enumerate(flat) if g]
    rest = [k for k, (_, g) in enumerate(flat) if not g]
    grid = grid.transpose(rest + grouped).reshape(-1, math.prod(flat[k][0] for k in grouped))
    return tuple(tuple(int(i) for i in g) for g in grid)


def _groups(attrs: str) -> tuple:
    m = re.search(r"replica_groups=(mesh\[.*?\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|"
                  r"\{[\d,{} ]*\})", attrs)
    if m is None:
        pairs = re.search(r"source_target_pairs=\{([\d,{} ]*)\}", attrs)
        if pairs:  # collective-permute: each (source, target) pair is a group
            return tuple(tuple(int(x) for x in p.split(","))
                         for p in re.findall(r"\{(\d+,\d+)\}", pairs.group(0)))
        return ((),)
    text = m.group(1)
    if text.startswith("mesh"):
        return _mesh_groups(text)
    if "<=" in text:
        return _iota_groups(text)
    found = tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}",
                                                                               text[1:-1] or "{}"))
    return found if found and any(found) else ((),)


def _computations(hlo: str) -> tuple[dict, str]:
    """``{name: [instruction lines]}`` and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("(")[0]:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif line.strip() == "}":
            cur = None
        elif cur is not None and line.strip():
            comps[cur].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def operand_names(rest: str) -> list[str]:
    """The operand names of an instruction (the text after ``op(``)."""
    return re.findall(r"%([\w.\-]+)", rest.split(")")[0])


def _constant(name: str, defs: dict, depth: int = 0) -> int | None:
    """The integer value of ``name`` if it is a (copied, converted) scalar constant."""
    op, rest = defs.get(name, ("", ""))
    if op == "constant":
        m = re.match(r"\s*(-?\d+)\)", rest)
        return int(m.group(1)) if m else None
    if op in ("copy", "convert", "bitcast") and depth < 8:
        return _constant(operand_names(rest)[0], defs, depth + 1) if operand_names(rest) else None
    return None


def _derived_trip(cond: list[str], body: list[str], init: str, defs: dict) -> int | None:
    """A while's trip count from its condition ``i < N`` (or ``N > i``) on tuple index k,
    the body's ``i + step`` and the init tuple's element k (XLA:TPU's optimised HLO drops
    ``known_trip_count``); None unless all three are plain constants (init defaults to 0,
    where every JAX loop counter starts)."""
    root = next((line for line in cond if line.strip().startswith("ROOT")), "")
    m = re.search(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=(LT|GT)", root)
    if m is None:
        return None
    a, b, direction = m.groups()
    counter, bound = (a, b) if direction == "LT" else (b, a)
    n = _constant(bound, defs)
    gte = re.search(r"index=(\d+)", defs.get(counter, ("", ""))[1])
    if n is None or gte is None:
        return None
    k = int(gte.group(1))
    init_args = operand_names(defs.get(init, ("", ""))[1])
    start = _constant(init_args[k], defs) if k < len(init_args) else None
    broot = next((line for line in body if line.strip().startswith("ROOT")), "")
    bargs = operand_names(broot.split(" tuple(", 1)[1]) if " tuple(" in broot else []
    step = 1
    if k < len(bargs) and defs.get(bargs[k], ("",))[0] == "add":
        consts = [_constant(x, defs) for x in operand_names(defs[bargs[k]][1])]
        step = next((c for c in consts if c), 1)
    return max(0, -(-(n - (start or 0)) // step))


def _op_name(line: str) -> str:
    m = re.search(r'op_name="([^"]*)"', line)
    return m.group(1) if m else ""


def _unpad(name: str, defs: dict) -> str:
    """The instruction a ``pad`` pads (its first operand); ``name`` itself otherwise."""
    op, rest = defs.get(name, ("", ""))
    args = operand_names(rest) if op == "pad" else []
    return args[0] if args else name


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction met on a walk of a module's call graph (:func:`walk_instructions`).

    name, rtype (its result type text), op, rest (the text after ``op(``) and line as
    printed; loops: the while loops around it, outermost first; fused: inside a fusion's
    computation (its memory traffic is the fusion instruction's)."""

    name: str
    rtype: str
    op: str
    rest: str
    line: str
    loops: tuple[Loop, ...]
    fused: bool


def module_index(hlo: str) -> tuple[dict, str, dict]:
    """``(computations, entry, defs)``: each computation's instruction lines, the entry's
    name, and every instruction's ``(result type, op, rest)`` by name."""
    comps, entry = _computations(hlo)
    defs = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            if m:
                defs[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return comps, entry, defs


def walk_instructions(hlo: str, unknown_trip=None):
    """Every instruction reachable from the entry computation, with its loops (yields
    :class:`Instruction`). A while body inherits its loop (``known_trip_count``, else
    derived from its condition and counter: XLA:TPU drops the config, else
    ``unknown_trip(while_name, loops_around)`` when given, else None); every other
    callee (calls, fusions, async computations, conditionals) its caller's loops."""
    comps, entry, defs = module_index(hlo)
    ops = {k: (v[1], v[2]) for k, v in defs.items()}
    seen: set = set()

    def walk(comp: str, loops: tuple[Loop, ...], fused: bool):
        if (comp, loops) in seen or comp not in comps:
            return
        seen.add((comp, loops))
        for line in comps[comp]:
            m = _INSTR.match(line)
            if m is None:
                continue
            name, rtype, op, rest = m.groups()
            yield Instruction(name, rtype, op, rest, line, loops, fused)
            if op == "while":
                trip = _TRIP.search(line)
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                n = int(trip.group(1)) if trip else _derived_trip(
                    comps.get(cond, []), comps.get(body, []), operand_names(rest)[0], ops)
                if n is None and unknown_trip is not None:
                    n = unknown_trip(name, loops)
                yield from walk(body, loops + (Loop(name, n, _op_name(line)),), fused)
                continue
            for callees in _CALLEES.findall(rest):
                for callee in callees.split(","):
                    yield from walk(callee.strip().lstrip("%"), loops, fused or op == "fusion")

    yield from walk(entry, (), False)


def parse_collectives(hlo: str) -> list[Collective]:
    """Every collective of an HLO module's text (``compiled.as_text()``), with its loops
    (:func:`walk_instructions`). Async pairs are reported at their ``-start`` with the
    ``-done``'s result shapes."""
    _, _, defs = module_index(hlo)
    shapes = {k: v[0] for k, v in defs.items()}
    unpad_defs = {k: (v[1], v[2]) for k, v in defs.items()}
    done_of = {v[2].split(")")[0].strip().lstrip("%"): v[0] for v in defs.values()
               if v[1].endswith("-done")}
    out: list[Collective] = []
    for ins in walk_instructions(hlo):
        name, rtype, op, rest, loops = ins.name, ins.rtype, ins.op, ins.rest, ins.loops
        base = op[:-6] if op.endswith("-start") else op
        if base in KINDS and not op.endswith("-done"):
            args = operand_names(rest)
            operands = tuple(s for a in args for s in hlo_shapes(shapes.get(a, "")))
            unpadded = tuple(s for a in args
                             for s in hlo_shapes(shapes.get(_unpad(a, unpad_defs), "")))
            result = hlo_shapes(done_of.get(name, rtype)) if op.endswith("-start") else (
                hlo_shapes(rtype))
            out.append(Collective(base, name, operands, result, _groups(rest), loops,
                                  _op_name(ins.line), unpadded))
        dcn = _DCN_TYPE.search(ins.line) if op == "send" else None
        if dcn:
            sent = hlo_shapes(rtype)[:1]  # (data, context, token): the data
            kind = DCN_PREFIX + dcn.group(1).lower().replace("_", "-")
            out.append(Collective(kind, name, sent, sent, ((),), loops, _op_name(ins.line),
                                  sent))
    return out


def group_axes(coll: Collective, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) along which a collective's groups vary; device id i
    is the mesh position ``np.unravel_index(i, sizes)`` (the order of ``mesh.devices.flat``).
    Every axis of size > 1 for a single all-devices group."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    if coll.groups == ((),):
        return tuple(n for n, s in zip(names, sizes) if s > 1)
    varies = set()
    for g in coll.groups:
        coords = np.asarray(np.unravel_index(np.asarray(g, int), sizes)).T
        varies |= {names[k] for k in range(len(names)) if len(set(coords[:, k])) > 1}
    return tuple(n for n in names if n in varies)


def activation_rows(hlo: str, positions: int, widths: Sequence[int]) -> int:
    """The most rows any activation of a program holds on one chip: over every array
    shape ``[..., rows, positions, width]`` in the HLO text with ``width`` one of
    ``widths`` (the hidden, MLP, attention widths), the largest ``rows``. 0 if none.

    With the rows split over data x fsdp this is micro-batch / (data x fsdp); a program
    that lost the batch split holds every row of a micro-batch."""
    rows = 0
    for m in _SHAPE.finditer(hlo):
        dims = [int(d) for d in m.group(2).split(",") if d]
        if len(dims) >= 3 and dims[-2] == positions and dims[-1] in widths:
            rows = max(rows, dims[-3])
    return rows
