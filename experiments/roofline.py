"""A lower-bound estimate of every TPU recipe's RL step from its compiled programs (a
model, not a measurement).

Each recipe's prefill, decode, logprob and learn programs are compiled ahead of time for
its TPU topology with libtpu on this CPU host (`memory_budget.budget_recipe`), or read
back from HLO texts saved by `collective_budget.py --dump` (`--hlo DIR`). From each
program's optimised HLO (one chip's program):

- FLOPs and HBM bytes of every instruction, each loop body scaled by its trip count
  (`rljax.sharding.hlo_cost.op_costs`; XLA's `cost_analysis()` counts a loop body once).
  An instruction takes max(FLOPs / peak, bytes / HBM bandwidth); a splash attention
  kernel (a Pallas custom call, which declares no cost) takes its block FLOPs (causal
  blocks only; the fused backward 2.5 x the forward's) plus `GRID_STEP_S` per grid step.
- Collective bytes by kind (`rljax.sharding.hlo_collectives.parse_collectives`, loops
  counted) over the generation's ICI links, both directions of a ring: all-gather and
  reduce-scatter move (n - 1) / n of the full array, all-reduce twice that, all-to-all
  (n - 1) / n x n / 4 hops; a collective-permute's ring edge takes the busiest link's
  load of the recipe's fsdp rings (`rljax.sharding.rings.ring_cost`); `dcn-*` transfers
  go over the chip's DCN share.
- A program's time: max(sum of its instructions' times, its collectives' time)
  (collectives overlapped with compute); its bound is the larger of the compute-bound
  and memory-bound instruction time, or "collectives". The decode loops stop when every
  row has ended (no trip count): each phase is counted at its full length
  (`rljax.sampling.sampler.plan_phases`), every row running to `max_new_tokens`.
- The step: prefill + decode + learn (logprob, the learning program's first pass
  compiled alone, is listed but not added). `predicted_mfu`: model FLOPs (2 x matmul
  parameters per token per forward, x 3 with a backward; attention excluded) over
  chips x peak x step.

    python experiments/roofline.py [--recipes gsm8k_qwen25_grpo/0.5b-v5e8 ...]
                                   [--hlo DIR] [--set remat=none ...]

Compiling is slow on a 2-core host (0.5B learn ~200 s, 8B learn ~400 s; all recipes
about an hour): name recipes with `--recipes`. One line per recipe:
`RESULT recipe=<label> predicted_step_s=<s> predicted_mfu=<f> bound=<...>`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # memory_budget, _aot

if importlib.util.find_spec("libtpu") is None:  # CPU devices stand in, one per chip
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=64")

import memory_budget as mb  # noqa: E402

from rljax.models.attention_kernels import splash_block  # noqa: E402
from rljax.sampling.sampler import plan_phases  # noqa: E402
from rljax.sharding import make_mesh  # noqa: E402
from rljax.sharding.hlo_collectives import parse_collectives  # noqa: E402
from rljax.sharding.hlo_cost import op_costs  # noqa: E402
from rljax.sharding.rings import ring_cost  # noqa: E402

GRID_STEP_S = 0.35e-6  # a Pallas grid step's fixed overhead on TPU


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip peak bf16 FLOP/s, HBM bytes/s, one ICI link's bytes/s in one direction,
    and the chip's share of its host's DCN bytes/s."""

    peak_flops: float
    hbm_bw: float
    ici_link_bw: float
    dcn_bw: float


# Peak and HBM: Cloud TPU's v5e / v6e / v5p / v4 pages; ICI per link and direction: the
# JAX scaling book's table; DCN: the host NICs split over its chips (v5p: 50 Gbps a chip).
CHIPS = {"v5e": Chip(197e12, 819e9, 45e9, 6.25e9), "v6e": Chip(918e12, 1640e9, 90e9, 12.5e9),
         "v5p": Chip(459e12, 2765e9, 90e9, 6.25e9), "v4": Chip(275e12, 1228e9, 45e9, 6.25e9)}


@dataclasses.dataclass(frozen=True)
class ProgramTime:
    """One program's modelled seconds: instructions bound by compute, by memory, kernel
    grid-step overhead, and collectives (ICI + DCN)."""

    program: str
    compute_s: float
    memory_s: float
    overhead_s: float
    collective_s: float
    flops: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s + self.memory_s + self.overhead_s, self.collective_s)

    @property
    def bound(self) -> str:
        if self.collective_s > self.compute_s + self.memory_s + self.overhead_s:
            return "collectives"
        return "compute" if self.compute_s >= self.memory_s + self.overhead_s else "memory"


def splash_model(op) -> tuple[float, int]:
    """`(FLOPs, grid steps)` of a splash kernel call from its operand shapes: q `[(B,) N,
    T, H]`, k `[(B,) K, S, H]`, blocks as `splash_block` picks them, causal blocks only."""
    q, k = [(1,) * (4 - len(dims)) + dims for dt, dims in op.operands
            if dt in ("bf16", "f32") and len(dims) >= 3][:2]
    b, n, t, h = q
    s = k[2]
    bq, bk = splash_block(t), splash_block(s)
    blocks = sum(1 for i in range(t // bq) for j in range(s // bk)
                 if j * bk <= (s - t) + (i + 1) * bq - 1)
    matmuls = 5 if "dkv" in op.kernel else 2  # fused backward: s, dP, dV, dQ, dK
    return 2.0 * matmuls * b * n * blocks * bq * bk * h, b * n * blocks


def _collective_s(c, chip: Chip, n_devices: int, ring_load: int) -> float:
    if c.kind.startswith("dcn-"):
        return c.bytes / chip.dcn_bw
    n = len(c.groups[0]) if c.groups != ((),) else n_devices
    if n <= 1:
        return 0.0
    share = c.bytes * (n - 1) / n / (2 * chip.ici_link_bw)  # a bidirectional ring
    factor = {"all-reduce": 2.0, "all-to-all": n / 4, "collective-permute": 0.0}.get(c.kind, 1.0)
    if c.kind == "collective-permute":
        return c.bytes * max(ring_load, 1) / chip.ici_link_bw
    return share * factor


def program_time(name: str, hlo: str, chip: Chip, n_devices: int, ring_load: int,
                 unknown_trip=None) -> ProgramTime:
    """Model one program's time on `chip` (see the module docstring)."""
    compute = memory = overhead = flops = 0.0
    for op in op_costs(hlo, unknown_trip):
        f, steps = splash_model(op) if op.kernel.startswith("splash_mha") else (op.flops, 0)
        tc, tm = f / chip.peak_flops, op.hbm_bytes / chip.hbm_bw
        compute += op.executions * tc * (tc >= tm)
        memory += op.executions * tm * (tm > tc)
        overhead += op.executions * steps * GRID_STEP_S
        flops += op.executions * f
    coll = sum(_collective_s(c, chip, n_devices, ring_load) * c.executions
               for c in parse_collectives(hlo))
    return ProgramTime(name, compute, memory, overhead, coll, flops)


def decode_trips(cfg):
    """`unknown_trip` for the decode program: its outermost loops of unknown trip count
    are the phases of `plan_phases`, in order, each at full length; inner ones once."""
    p, t = cfg.task.max_prompt_tokens, cfg.sampling.max_new_tokens
    ends = [e for e, _ in plan_phases(p, t, p + t - 1, 4)]
    steps = iter([ends[0] - 1] + [b - a for a, b in zip(ends, ends[1:])])
    return lambda name, loops: next(steps, 1) if not loops else 1


def model_flops(cfg, model_cfg, trainer_paths_group: int, uses_ref: bool,
                recompute_old: bool) -> float:
    """2 x matmul parameters per token of each forward (x 3 with a backward), per step."""
    m = model_cfg
    attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    per_token = m.num_layers * (attn + 3 * m.hidden_size * m.intermediate_size) + (
        m.vocab_size * m.hidden_size)
    alg = cfg.algorithm.resolve()
    n, g = cfg.rl.prompts_per_step, alg.group_size
    p, t = cfg.task.max_prompt_tokens, cfg.sampling.max_new_tokens
    sampled = n * p + n * g * t
    learned = n * g * t + (n if trainer_paths_group > 1 else n * g) * p
    passes = 3 * alg.num_minibatches * alg.num_epochs + uses_ref + recompute_old
    return 2.0 * per_token * (sampled + learned * passes)


def _hlo_texts(label, cfg, rec, hlo_dir, log) -> dict[str, str]:
    """Each program's HLO text: compiled now, or read from `hlo_dir`
    (`collective_budget.py --dump` names them `<experiment>_<recipe>_<program>.hlo`)."""
    if hlo_dir:
        stem = label.replace("/", "_")
        return {p: (pathlib.Path(hlo_dir) / f"{stem}_{p}.hlo").read_text()
                for p in mb.PROGRAMS if (pathlib.Path(hlo_dir) / f"{stem}_{p}.hlo").exists()}
    texts = {}
    mb.budget_recipe(label, cfg, rec, log=log,
                     inspect=lambda name, compiled: texts.__setitem__(name, compiled.as_text()))
    return texts


def _trainer_facts(cfg, rec, devices):
    """`(mesh, prompt_group, uses_ref, recompute_old)` of the recipe's trainer."""
    from flax import nnx

    import _aot as aot
    from rljax.models import Decoder

    model_cfg = cfg.policy_config(rec.model_config(cfg.compute_dtype))
    mesh = make_mesh(cfg.mesh, devices=devices)
    graphdef, _ = aot.abstract_params(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)), mesh)
    trainer = aot.trainer(cfg, graphdef, None, mesh, model_cfg)
    return mesh, trainer.paths.prompt_group, trainer.uses_ref, trainer.old_mode == "recompute"


def estimate(label, cfg, rec, hlo_dir=None, log=print) -> tuple[list[ProgramTime], float, float]:
    """`(program times, step seconds, predicted MFU)` of one recipe."""
    import jax

    devices = mb.tpu_devices(rec.tpu) or jax.devices("cpu")[: rec.tpu.chips]
    mesh, group, uses_ref, old = _trainer_facts(cfg, rec, devices)
    chip = CHIPS[rec.tpu.topology.split(":")[0]]
    load = ring_cost(mesh.devices).max_link_load
    texts = _hlo_texts(label, cfg, rec, hlo_dir, log)
    times = [program_time(name, text, chip, len(devices), load,
                          decode_trips(cfg) if name == "decode" else None)
             for name, text in texts.items()]
    step = sum(t.seconds for t in times if t.program != "logprob")
    mflops = model_flops(cfg, rec.model_config(cfg.compute_dtype), group, uses_ref, old)
    return times, step, mflops / (len(devices) * chip.peak_flops * step)


def table(label: str, times: list[ProgramTime]) -> str:
    """Markdown rows: each program's modelled seconds by part, and its bound."""
    return "\n".join(
        f"| {label} | {t.program} | {t.flops / 1e12:.1f} | {t.compute_s:.3f} | {t.memory_s:.3f} "
        f"| {t.overhead_s:.3f} | {t.collective_s:.3f} | {t.seconds:.3f} | {t.bound} |"
        for t in times)


def main(argv: list[str] | None = None) -> int:
    """Estimate every (or each `--recipes`) recipe; a table and one RESULT line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="*", help="labels 'experiment/recipe' (default: all)")
    ap.add_argument("--hlo", help="read <label>_<program>.hlo texts from here; no compile")
    ap.add_argument("--set", nargs="*", default=[], dest="overrides",
                    help="overrides after the recipe's settings (memory_budget.py's)")
    args = ap.parse_args(argv)
    print("| recipe | program | TFLOP/chip | compute s | memory s | kernel grid s "
          "| collectives s | program s | bound |\n|---|---|---:|---:|---:|---:|---:|---:|---|")
    results = []
    for label, cfg, rec in mb.recipes(args.recipes, args.overrides):
        times, step, mfu = estimate(label, cfg, rec, args.hlo)
        print(table(label, times), flush=True)
        bound = max((t for t in times if t.program != "logprob"), key=lambda t: t.seconds).bound
        results.append(f"RESULT recipe={label} predicted_step_s={step:.2f} "
                       f"predicted_mfu={mfu:.3f} bound={bound}")
    print("\n".join(results) or "no recipe matched --recipes")
    return 0 if results else 2


if __name__ == "__main__":
    sys.exit(main())
