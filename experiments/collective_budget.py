"""Every collective of each TPU recipe's programs, compiled ahead of time for its slice.

For every recipe (or each `--recipes` label) this compiles the run's four programs
(prefill, decode, logprob, learn) exactly as `experiments/memory_budget.py` does (its
`compile_recipe`, same mesh over the slice's TPU devices from libtpu's topology
description, same abstract arguments), reads each program's optimised HLO
(`compiled.as_text()`) with `rljax.sharding.collectives.parse_collectives`, and lists
each collective: kind, bytes per chip, the while loops around it with XLA's known trip
counts, executions and bytes per step, and whether the audit's rules expect it
(`rljax.sharding.collectives.classify`: (a) FSDP weight gathers, (b) gradient reductions
at most once per micro-batch, (c) tensor-parallel activations at the ideal rows per
device, (d) at most 1 KiB). "Per step" is one run of each program: the sampler's prefill
and decode once per step, the learning program once per step (the logprob program is the
learning program's first pass compiled alone, listed for reference).

Without libtpu the programs compile for CPU devices (XLA attention): the same
partitioner, but the figures are labelled CPU. `--tiny` shrinks the model (same mesh,
micro-batches and loops) for a quick look on CPU. Run by hand (minutes per 8B program):

    python experiments/collective_budget.py [--recipes gsm8k_qwen25_grpo/0.5b-v5e8 ...]
        [--all] (list expected collectives too) [--tiny] [--dump DIR | --hlo DIR]

The last line: RESULT programs=<n> unexpected=<k> worst=<recipe>/<program>
collective_gib_per_step=<x> (worst: the program with the most bytes per step in
unexpected collectives, or in all collectives when none is unexpected; x: the sum over
every compiled program).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys

if __name__ == "__main__" and importlib.util.find_spec("libtpu") is None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # one CPU device per chip
                               + " --xla_force_host_platform_device_count=64")

import memory_budget as mb  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from rljax.models import Decoder  # noqa: E402
from rljax.train.learn.packing import choose_spec  # noqa: E402
from rljax.sharding.collectives import (DCN_PREFIX, Expectation, classify, group_axes,  # noqa: E402
                                        parse_collectives, state_parameter_sizes)

GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Row:
    """One collective of one program, classified."""

    recipe: str
    program: str
    kind: str
    groups: str
    shape: str
    bytes: int
    loops: str
    executions: int
    expected: bool
    rule: str
    op_name: str

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.executions


def _param_sizes(model_cfg, mesh) -> dict:
    """`state_parameter_sizes` of the policy (a value model has the same shapes)."""
    with jax.set_mesh(mesh):
        state = nnx.state(nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0))))
    return state_parameter_sizes(state, mesh)


def expectations(cfg, model_cfg, mesh) -> dict[str, Expectation]:
    """The rules' allowances for each program of `cfg` on `mesh` (`Expectation`)."""
    shape = dict(mesh.shape)
    shards = shape["data"] * shape["fsdp"]
    alg = cfg.algorithm.resolve()
    n_prompts, g = cfg.rl.prompts_per_step, alg.group_size
    b = n_prompts * g
    p, t = cfg.task.max_prompt_tokens, cfg.sampling.max_new_tokens
    minibatch = b // alg.num_minibatches
    micro_rows = alg.micro_batch_size or minibatch
    num_micro = minibatch // micro_rows
    if cfg.rl.tokens_per_micro_batch:  # packed: memory_budget's largest bucket
        pack = choose_spec(b // shards, cfg.rl.tokens_per_micro_batch, p + t, shards)
        micro_rows, num_micro = pack.rows_per_micro, pack.num_micro
    heads = model_cfg.num_heads * model_cfg.head_dim
    width = max(model_cfg.hidden_size, model_cfg.intermediate_size, heads)
    sizes = _param_sizes(model_cfg, mesh)
    rows = lambda n: max(n // shards, 1)  # noqa: E731
    updates = alg.num_minibatches * alg.num_epochs
    dcn = frozenset({"data"}) if len({getattr(d, "slice_index", 0)
                                      for d in mesh.devices.flat}) > 1 else frozenset()

    def ex(passes, r, pos, n_updates=1):
        return Expectation(shape, sizes, passes, r * pos * width, n_updates, dcn)

    return {"prefill": ex(1, rows(n_prompts), p), "decode": ex(1, rows(b), 1),
            "logprob": ex(1, rows(micro_rows), p + t),
            "learn": ex(num_micro * updates, rows(micro_rows), p + t, updates)}


def _source(op_name: str) -> str:
    """The op_name metadata, less jit / while / call wrappers (where in the program)."""
    parts = [p for p in op_name.split("/") if p not in ("while", "body", "closed_call",
                                                          "checkpoint", "cond")]
    return "/".join(parts[-4:])


def _shape_text(shapes) -> str:
    return ",".join(f"{dt}[{','.join(map(str, d))}]" for dt, d in shapes[:3]) + (
        f",+{len(shapes) - 3}" if len(shapes) > 3 else "")


PROGRAMS = ("prefill", "decode", "logprob", "learn")


def audit_recipe(label, cfg, rec, *, tiny: bool = False, dump: str | None = None,
                 hlo: str | None = None, log=print) -> tuple[list[Row], int]:
    """Compile one recipe's programs (`memory_budget.compile_recipe`) and classify every
    collective of each; returns the rows and the number of programs compiled. `dump`:
    write each program's HLO text there; `hlo`: read them from there instead of
    compiling (a re-audit of saved programs)."""
    devices = mb.tpu_devices(rec.tpu)
    model_cfg = cfg.policy_config(rec.model_config(cfg.compute_dtype))  # with cfg.lora
    if devices is None:  # CPU: XLA attention (interpret-mode splash is not a kernel)
        devices = jax.devices("cpu")[: rec.tpu.chips]
        model_cfg = dataclasses.replace(model_cfg, attention="xla")
    if tiny:  # the recipe's head counts (they decide the tensor split), 16-wide heads
        model_cfg = dataclasses.replace(
            model_cfg, vocab_size=1024, hidden_size=16 * model_cfg.num_heads,
            intermediate_size=32 * model_cfg.num_heads, num_layers=2, head_dim=16)
    mesh = mb.make_mesh(cfg.mesh, devices=devices)
    exp = expectations(cfg, model_cfg, mesh)
    rows: list[Row] = []
    programs: list[str] = []

    def inspect(name, compiled):
        text = compiled if isinstance(compiled, str) else compiled.as_text()
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{label.replace('/', '_')}_{name}.hlo"), "w") as f:
                f.write(text)
        for c in parse_collectives(text):
            ok, rule = classify(c, exp[name])
            rows.append(Row(label, name, c.kind,
                            "DCN" if c.kind.startswith(DCN_PREFIX) else
                            "x".join(group_axes(c, exp[name].mesh_shape)) or "-",
                            _shape_text(c.operand_shapes), c.bytes, c.loop_text(), c.executions,
                            ok, rule, _source(c.op_name)))
        programs.append(name)

    log(f"[{label}] {rec.model}{' (tiny)' if tiny else ''} on {rec.slice} "
        f"({len(devices)} x {devices[0].device_kind}), mesh {dict(mesh.shape)}")
    if hlo:
        for name in PROGRAMS:
            path = os.path.join(hlo, f"{label.replace('/', '_')}_{name}.hlo")
            if os.path.exists(path):
                with open(path) as f:
                    inspect(name, f.read())
    else:
        mb.compile_recipe(cfg, model_cfg, devices, label=label, hbm_gib=rec.tpu.hbm_gib,
                          log=log, inspect=inspect)
    return rows, len(programs)


def table(rows: list[Row]) -> str:
    """Markdown: one line per collective (MiB per chip per execution and per step)."""
    head = ("| recipe | program | kind | over | operand | MiB/chip | loops | runs | MiB/step "
            "| expected | source |\n|---|---|---|---|---|---:|---|---:|---:|---|---|")
    lines = [f"| {r.recipe} | {r.program} | {r.kind} | {r.groups} | {r.shape} | "
             f"{r.bytes / 2**20:.3g} | {r.loops} | {r.executions} | "
             f"{r.bytes_per_step / 2**20:.4g} | {'yes' if r.expected else 'NO'} ({r.rule}) | "
             f"{r.op_name} |"
             for r in rows]
    return "\n".join([head, *lines])


def summary(rows: list[Row]) -> str:
    """Markdown: per recipe and program, collectives, GiB per step, unexpected ones."""
    keys = sorted({(r.recipe, r.program) for r in rows}, key=lambda k: k)
    head = ("| recipe | program | collectives | GiB/step | unexpected | unexpected GiB/step |"
            "\n|---|---|---:|---:|---:|---:|")
    lines = []
    for k in keys:
        sel = [r for r in rows if (r.recipe, r.program) == k]
        bad = [r for r in sel if not r.expected]
        lines.append(f"| {k[0]} | {k[1]} | {len(sel)} | "
                     f"{sum(r.bytes_per_step for r in sel) / GIB:.3f} | {len(bad)} | "
                     f"{sum(r.bytes_per_step for r in bad) / GIB:.3f} |")
    return "\n".join([head, *lines])


def result_line(rows: list[Row], programs: int) -> str:
    """The RESULT line (see the module docstring)."""
    per: dict = {}
    bad_per: dict = {}
    for r in rows:
        k = f"{r.recipe}/{r.program}"
        per[k] = per.get(k, 0) + r.bytes_per_step
        if not r.expected:
            bad_per[k] = bad_per.get(k, 0) + r.bytes_per_step
    worst = max(bad_per or per, key=lambda k: (bad_per or per)[k]) if per else "-"
    total = sum(per.values()) / GIB
    return (f"RESULT programs={programs} unexpected={sum(not r.expected for r in rows)} "
            f"worst={worst} collective_gib_per_step={total:.3f}")


def main(argv: list[str] | None = None) -> int:
    """Audit every (or each `--recipes`) recipe; print the tables and the RESULT line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="*", help="labels 'experiment/recipe' (default: all)")
    ap.add_argument("--all", action="store_true", help="list expected collectives too")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, same mesh and loops")
    ap.add_argument("--dump", help="write each program's HLO text into this folder")
    ap.add_argument("--hlo", help="audit the HLO texts saved in this folder (--dump)")
    args = ap.parse_args(argv)
    rows, programs = [], 0
    for label, cfg, rec in mb.recipes(args.recipes):
        try:
            got, n = audit_recipe(label, cfg, rec, tiny=args.tiny, dump=args.dump,
                                   hlo=args.hlo)
        except Exception as e:  # noqa: BLE001 - report a recipe that does not compile, go on
            print(f"[{label}] did not compile: {type(e).__name__}: {e}", flush=True)
            continue
        rows += got
        programs += n
        print(table([r for r in got if args.all or not r.expected]), flush=True)
    if not rows:
        print("no recipe compiled")
        return 2
    target = (f"the programs saved in {args.hlo}" if args.hlo else
              "TPU (libtpu AOT)" if mb.HAVE_LIBTPU and not args.tiny else "CPU")
    print(f"\nCollectives per program ({target}):")
    print(summary(rows))
    print(result_line(rows, programs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
