"""Per-chip memory of each TPU recipe's programs, compiled ahead of time for its slice.

For every named recipe (`RECIPES`) of the GSM8K experiments (`gsm8k_qwen25_grpo`,
`gsm8k_qwen25_ppo`, `gsm8k_llama3_grpo`) this builds the model from the real checkpoint's
shapes (`rljax.run.recipes.MODEL_SHAPES`; `jax.eval_shape`, no weights), places it on a
mesh over the slice's TPU devices from `jax.experimental.topologies.get_topology_desc`
(no TPU needed: libtpu's compiler runs on this host, as MaxText's train_compile.py does),
lowers and compiles, without running, the run's four programs:

  prefill  the sampler's prompt forward into the KV cache (`rljax.sampling.sampler`)
  decode   the sampler's decode loops (donated state, cache grown per phase)
           Both take the policy in the sampler's inference layout
           (`rljax.sharding.inference_shardings`: replicated over data x fsdp, split over
           tensor, matmul weights in the compute dtype), the copy
           `rljax.sampling.sampler.run` makes once per step.
  logprob  the reference's log-probs over the whole rollout batch, micro-batched (the
           first pass of the learning program, compiled alone)
  learn    the one learning program of `rljax.train.rl.RLTrainer` (forwards, advantages,
           epochs x minibatches of micro-batched updates; params and Adam state donated)

and prints each program's per-chip bytes from `compiled.memory_analysis()`: peak =
arguments + outputs + temporaries + generated code - aliased (donated) bytes, plus
"resident": the run's other state that stays in HBM while the program runs but is not
one of its arguments (during sampling: the training parameters, the policy's FSDP shard
beside its inference copy, and the Adam moments and reference).
`peak + resident` is compared with the chip's HBM (v5e 16 GiB, v5p 95 GiB).

libtpu is not a project dependency (684 MB). Install it beside the project's jax:

    pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"

Without it the programs compile for CPU devices instead (splash attention replaced by
XLA's einsum attention) and every figure is labelled a CPU estimate. Run by hand, not in
CI (minutes per 8B program on 2 cores):

    python experiments/memory_budget.py [--recipes gsm8k_qwen25_grpo/0.5b-v5e8 ...]

The last line: RESULT programs=<n> worst=<recipe>/<program> worst_peak_gib=<x>
hbm_gib=<y> fits=<true|false> (worst = the largest peak + resident relative to its HBM).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import sys
import time
import types

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
if __name__ == "__main__" and not HAVE_LIBTPU:  # CPU estimates need one device per chip
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=64")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # this folder's _aot

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import _aot as aot  # noqa: E402
from _aot import GIB, abstract_params, per_chip_bytes  # noqa: E402
from rljax.models import Decoder, ValueModel  # noqa: E402
from rljax.models.layers import cast_matmul_weights, compute_dtype  # noqa: E402
from rljax.run.experiment_files import experiment_module, load_experiment  # noqa: E402
from rljax.sampling import sampler as sampler_lib  # noqa: E402
from rljax.sampling.ops import SamplingParams  # noqa: E402
from rljax.sharding import inference_shardings, make_mesh, mesh_context, replicated  # noqa: E402
from rljax.train.learn.layout import Packed, Padded, frozen_logprobs  # noqa: E402
from rljax.train.learn.reference import lora_base, reference_model  # noqa: E402
from rljax.train.programs.step import learn_step  # noqa: E402

PROGRAMS = ("prefill", "decode", "logprob", "learn")
EXPERIMENTS = ("gsm8k_qwen25_grpo", "gsm8k_qwen25_ppo", "gsm8k_llama3_grpo")


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-chip bytes of one compiled program (`compiled.memory_analysis()`)."""

    recipe: str
    program: str
    arguments: int
    outputs: int
    temps: int
    code: int
    aliased: int
    resident: int
    hbm_gib: float
    compile_s: float

    @property
    def peak(self) -> int:
        """Arguments + outputs + temporaries + code - donated (aliased) bytes."""
        return self.arguments + self.outputs + self.temps + self.code - self.aliased

    @property
    def total_gib(self) -> float:
        """Peak plus the run's other state resident in HBM, GiB."""
        return (self.peak + self.resident) / GIB

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.hbm_gib


def _memory(compiled) -> tuple[int, int, int, int, int]:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
            m.generated_code_size_in_bytes, m.alias_size_in_bytes)


def sampler_programs(record, graphdef, mesh, policy, cfg, model_cfg, resident, log):
    """Compile the sampler's prefill and decode through `record` (`compile_recipe`'s)."""
    n_prompts, g = cfg.rl.prompts_per_step, cfg.algorithm.resolve().group_size
    p, t = cfg.task.max_prompt_tokens, cfg.sampling.max_new_tokens
    cd = compute_dtype(model_cfg)  # run() casts the matmul weights before the copy
    infer = aot.abstract(jax.eval_shape(lambda w: cast_matmul_weights(w, cd), policy),
                         inference_shardings(policy, mesh))
    head = aot.sampler_head(infer, model_cfg, mesh)
    spec = sampler_lib.DecodeSpec(SamplingParams(temperature=cfg.sampling.temperature),
                                  (model_cfg.vocab_size - 1,), g, t,
                                  sampler_lib.plan_phases(p, t, p + t - 1, 4),
                                  model_cfg.vocab_size - 1)
    log(f"inference copy of the policy per chip: {per_chip_bytes(infer) / GIB:.2f} GiB")
    prompts = tuple(aot.batch(mesh, (n_prompts, p), dt)
                    for dt in (jnp.int32, jnp.bool_, jnp.int32))
    pre = record("prefill", lambda: sampler_lib._prefill.lower(
        graphdef, spec, mesh, infer, head, *prompts, aot.key(mesh)).compile(), resident,
                 needed_by="decode")
    s, cache, _ = aot.outputs(pre)
    record("decode", lambda: sampler_lib._decode.lower(
        graphdef, spec, mesh, infer, head, s, cache).compile(), resident)


def compile_recipe(cfg, model_cfg, devices, *, label: str, hbm_gib: float,
                   log=print, inspect=None, programs: tuple = PROGRAMS) -> list[ProgramMemory]:
    """Compile `cfg`'s prefill, decode, logprob and learn programs (those in `programs`)
    for `devices` (a mesh of `cfg.mesh` over them) with the model shapes `model_cfg`;
    their per-chip memory.
    `inspect(name, compiled)`, when given, sees each compiled program (the collective
    audit, `experiments/collective_budget.py`, reads its HLO)."""
    mesh = make_mesh(cfg.mesh, devices=devices)
    graphdef, policy = abstract_params(lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)), mesh)
    value_gd, value = None, None
    if cfg.algorithm.resolve().name == "ppo":
        value_gd, value = abstract_params(lambda: ValueModel(model_cfg, rngs=nnx.Rngs(0)), mesh)
    trainer = aot.trainer(cfg, graphdef, value_gd, mesh, model_cfg)
    lora = trainer.trainable.adapters
    if lora:  # RLTrainer.init_state: the frozen base in the compute dtype, adapters float32
        policy = jax.tree.map(lambda o, x: jax.ShapeDtypeStruct(o.shape, o.dtype,
                                                                sharding=x.sharding),
                              jax.eval_shape(lambda w: lora_base(graphdef, w, trainer.trainable),
                                             policy), policy)
    params = {"policy": policy} | ({"value": value} if value is not None else {})
    opt = aot.opt_state(trainer, params, mesh)
    # A LoRA policy's KL reference copies its adapters only, in the compute dtype
    # (make_reference); the base is the policy's own.
    ref = None
    if trainer.uses_ref:
        ref = (aot.cast(trainer.trainable.split(policy)[0], jnp.dtype(compute_dtype(model_cfg)).name)
               if lora else aot.cast(policy, getattr(cfg.rl, "ref_dtype", "float32")))
    n_prompts, g = cfg.rl.prompts_per_step, trainer.alg.group_size
    p, t, b = cfg.task.max_prompt_tokens, cfg.sampling.max_new_tokens, n_prompts * g
    state_bytes = {"params": per_chip_bytes(params), "opt": per_chip_bytes(opt),
                   "ref": per_chip_bytes(ref) if ref is not None else 0}
    log(f"[{label}] state per chip: " + ", ".join(f"{k} {v / GIB:.2f} GiB"
                                                   for k, v in state_bytes.items())
        + (" (LoRA: params = frozen base + adapters, opt = the adapters' moments, ref = "
           "a copy of the adapters, on the policy's base)" if lora else ""))
    out, rep = [], replicated(mesh)

    def record(name, fn, resident, needed_by=""):
        if name not in programs:  # compiled all the same when a later program needs it
            return fn() if needed_by in programs else None
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):  # a mesh over TPU devices traces the real splash kernel
            compiled = fn()
        row = ProgramMemory(label, name, *_memory(compiled), resident=resident,
                            hbm_gib=hbm_gib, compile_s=time.perf_counter() - t0)
        log(f"[{label}] {name}: peak {row.peak / GIB:.2f} + resident {resident / GIB:.2f} "
            f"GiB ({row.compile_s:.0f} s to compile)")
        out.append(row)
        if inspect is not None:
            inspect(name, compiled)
        return compiled

    # Sampler: the policy's inference copy (and the head built from it) are arguments;
    # the training parameters (the policy's FSDP shard included), Adam moments and the
    # reference stay resident beside them.
    if {"prefill", "decode"} & set(programs):
        sampler_programs(record, graphdef, mesh, policy, cfg, model_cfg,
                         sum(state_bytes.values()), lambda m: log(f"[{label}] {m}"))
    # Reference log-probs over the batch (the learning program's first pass, alone).
    ro = aot.rollout(trainer, mesh, b, p, t)
    d = mesh.shape["data"] * mesh.shape["fsdp"]  # packed: the largest bucket
    layout = trainer.base_spec.layout
    layout = layout.sized(b // d, p + t) if isinstance(layout, Packed) else layout
    spec_l = dataclasses.replace(trainer.base_spec, layout=layout)
    # The reference pass alone: padded, every row's prompt.
    ref_layout = layout if isinstance(layout, Packed) else Padded(num_micro=layout.num_micro)
    # Its arguments: the reference's weights (LoRA: the policy's and the adapters' copy).
    w = (policy, ref) if lora and ref is not None else ref if ref is not None else policy
    model = (lambda w: reference_model(graphdef, *w, trainer.trainable)) if (
        lora and ref is not None) else (lambda w: (graphdef, w))
    logp = jax.jit(lambda w, seqs: frozen_logprobs(
        ref_layout, *model(w), ref_layout.plan(seqs)[0], chunk=spec_l.chunk,
        temperature=spec_l.temperature))
    record("logprob", lambda: logp.lower(w, ro.seqs()).compile(),
           sum(state_bytes.values()) - per_chip_bytes(w))
    scalars = dict(updates=jnp.int32, nonfinite_run=jnp.int32, skipped=jnp.int32,
                   kl_coef=jnp.float32, step=jnp.int32)
    scalars = {k: jax.ShapeDtypeStruct((), v, sharding=rep) for k, v in scalars.items()}
    spec = dataclasses.replace(trainer.step_spec(types.SimpleNamespace(params=params,
                                                                       opt_state=opt)),
                               layout=layout)

    def learn():
        with mesh_context(mesh):
            return learn_step.lower(spec, params, opt, scalars, ref, ro, aot.key(mesh), None)
    record("learn", lambda: learn().compile(), 0)
    return out


def tpu_devices(tpu):
    """The devices of a TPU slice (`rljax.run.recipes.TpuSlice`) as a run sees them, hosts
    included (libtpu's compiler on this host), or None without libtpu."""
    if not HAVE_LIBTPU:
        return None
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=tpu.topology,
                                             **tpu.topology_kwargs()).devices)


def recipes(selected: list[str] | None = None, overrides: list[str] = ()):
    """`(label, ExperimentConfig, Recipe)` of every recipe (or of `selected` labels,
    "experiment/recipe", in their order: the riskiest first), with `overrides`
    (``--set`` strings, e.g. ``remat=none``) applied after the recipe's own settings."""
    found = {f"{exp}/{name}": (exp, name, rec) for exp in EXPERIMENTS for name, rec in
             experiment_module(pathlib.Path(__file__).with_name(f"{exp}.py")).RECIPES.items()}
    for label in selected or found:
        if label in found:
            exp, name, rec = found[label]
            yield label, load_experiment(pathlib.Path(__file__).with_name(f"{exp}.py"),
                                         [f"recipe={name}", *overrides]), rec


def budget_recipe(label, cfg, rec, log=print, programs: tuple = PROGRAMS,
                  inspect=None) -> tuple[list[ProgramMemory], str]:
    """Compile one recipe for its TPU slice (or CPU devices without libtpu)."""
    devices = tpu_devices(rec.tpu)
    model_cfg = cfg.policy_config(rec.model_config(cfg.compute_dtype))  # with cfg.lora
    if devices is None:  # CPU estimate: XLA attention (interpret-mode splash is not a kernel)
        devices = jax.devices("cpu")[: rec.tpu.chips]
        model_cfg = dataclasses.replace(model_cfg, attention="xla")
    kind = devices[0].device_kind
    log(f"[{label}] {rec.model} on {rec.slice} ({rec.tpu.topology}, {len(devices)} x {kind}), "
        f"mesh {cfg.mesh.resolve(len(devices))}, micro {cfg.algorithm.micro_batch_size}: {rec.why}")
    return compile_recipe(cfg, model_cfg, devices, label=label, hbm_gib=rec.tpu.hbm_gib,
                          log=log, programs=programs, inspect=inspect), kind


def table(rows: list[ProgramMemory]) -> str:
    """A markdown table of the rows (GiB per chip)."""
    head = ("| recipe | program | args | temps | peak | resident | peak+resident | HBM | fits "
            "| compile |\n|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    lines = [f"| {r.recipe} | {r.program} | {r.arguments / GIB:.2f} | {r.temps / GIB:.2f} | "
             f"{r.peak / GIB:.2f} | {r.resident / GIB:.2f} | {r.total_gib:.2f} | "
             f"{r.hbm_gib:.0f} | {'yes' if r.fits else 'NO'} | {r.compile_s:.0f} s |"
             for r in rows]
    return "\n".join([head, *lines])


def result_line(rows: list[ProgramMemory], failed: list[str] = ()) -> str:
    """The RESULT line: the program with the largest share of its chip's HBM (fits=false
    too when a recipe in `failed` did not compile)."""
    worst = max(rows, key=lambda r: r.total_gib / r.hbm_gib)
    fits = all(r.fits for r in rows) and not failed
    return (f"RESULT programs={len(rows)} worst={worst.recipe}/{worst.program} "
            f"worst_peak_gib={worst.total_gib:.2f} hbm_gib={worst.hbm_gib:.0f} "
            f"fits={'true' if fits else 'false'}" + (f" failed={','.join(failed)}" * bool(failed)))


def main(argv: list[str] | None = None) -> int:
    """Compile every (or each `--recipes`) recipe; print the table and the RESULT line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="*", help="labels 'experiment/recipe' (default: all)")
    ap.add_argument("--set", nargs="*", default=[], dest="overrides",
                    help="overrides after the recipe's settings, e.g. remat=none rl.remat=false "
                         "algorithm.micro_batch_size=128 (a sizing candidate)")
    ap.add_argument("--programs", nargs="*", default=list(PROGRAMS), choices=PROGRAMS,
                    help="compile only these (logprob and learn are the ones remat and "
                         "micro-batch change)")
    args = ap.parse_args(argv)
    rows, kinds, failed = [], set(), []
    for label, cfg, rec in recipes(args.recipes, args.overrides):
        try:
            got, kind = budget_recipe(label, cfg, rec, programs=tuple(args.programs))
        except Exception as e:  # noqa: BLE001 - report a program that does not compile, go on
            print(f"[{label}] did not compile: {type(e).__name__}: {e}", flush=True)
            failed.append(label)
            continue
        rows += got
        kinds.add(kind)
        for r in got:
            if not r.fits:
                print(f"[{label}] {r.program} does NOT fit: {r.total_gib:.2f} GiB > "
                      f"{r.hbm_gib:.0f} GiB by {r.total_gib - r.hbm_gib:.2f} GiB")
    if not rows:
        print("no recipe compiled" if failed else "no recipe matched --recipes")
        return 2
    target = "TPU (libtpu AOT)" if HAVE_LIBTPU else "CPU ESTIMATES (libtpu not installed)"
    print(f"\nPer-chip memory, GiB, compiled for {target}: {', '.join(sorted(kinds))}")
    print(table(rows))
    print(result_line(rows, failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
