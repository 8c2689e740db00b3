"""The RL learning program alone, against the float32 matmul peak measured in the same process.

The program is ``RLTrainer``'s own jitted learning program (GRPO, beta 0.04 with a frozen
reference: the reference forward, group advantages, one AdamW update with the k3 KL in
the loss; parameters and optimiser state donated), called directly on a synthetic rollout
of 64 sequences x 160 tokens (8 prompts x 8 completions; prompts of 32 tokens, 128
completion tokens, every token real), for two random Qwen2 models (float32, vocab
32000): the reference benchmark model (hidden 256, 4 layers, 8 heads, 4 kv heads,
intermediate 704) and a larger one (hidden 512, intermediate 1408, 8 layers).

Achieved model FLOP/s: matmul FLOPs only (``_bench.grouped_forward_flops``: projections,
MLP, causal attention, the head on the 128 completion positions, each group's prompt once
as the trainer computes it; ``forward_flops`` per row with ``--per-row-prompts``),
forward + backward = 3 forwards, plus the reference forward (4 in all), over the median
time of ``--reps`` calls after a compiling call. The peak is the median FLOP/s of 2048^3 float32
``jnp.dot`` calls, one measured after each call of the program (same conditions).
Other processes' CPU use and this process's own kernel time (on a CPU backend mostly
the zeroing of fresh pages for the program's large buffers) are printed beside each
figure.

    python experiments/bench_train_step.py [--reps 5] [--quick] [--logp-chunk N]
                                           [--per-row-prompts] [--lora R]

With ``--lora R`` each model's program also runs with rank-R adapters on all seven
projections (alpha 2R; only the adapters train, the reference is the base with a copy of them),
its calls interleaved with the full-parameter program's; both medians and their ratio are
printed.

Last line (the larger model): ``RESULT flops_per_s=... peak_flops_per_s=... fraction=...``,
with ``--lora`` also ``lora_s=... full_s=... lora_over_full=...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _bench as B  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rljax.models import Decoder, build_char_tokenizer  # noqa: E402
from rljax.models.lora import LoraConfig  # noqa: E402
from rljax.train import (AlgorithmConfig, OptimConfig, RLConfig, RLTrainer,  # noqa: E402
                         Rollout, SamplingConfig)
from rljax.train.programs.step import learn_step, run, state_scalars  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    """One learning batch: ``prompts x group`` sequences of ``prompt_len + new_tokens``."""

    prompts: int = 8
    group: int = 8
    prompt_len: int = 32
    new_tokens: int = 128

    @property
    def rows(self) -> int:
        return self.prompts * self.group


# QUICK: bench_grpo_step's quick shapes, so a test process compiles one tiny program.
FULL, QUICK = Shape(), Shape(prompts=2, group=4, prompt_len=8, new_tokens=8)


def random_rollout(shape: Shape, vocab: int, seed: int = 0) -> Rollout:
    """A full-length rollout of random tokens (each prompt's completions consecutive, as a
    sampler lays them out), with rewards that vary within each group."""
    rng = np.random.default_rng(seed)
    b, p, t = shape.rows, shape.prompt_len, shape.new_tokens
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    prompt_NxP = rng.integers(2, vocab, (shape.prompts, p))
    return Rollout(
        prompt_BxP=jnp.asarray(np.repeat(prompt_NxP, shape.group, axis=0), jnp.int32),
        prompt_mask_BxP=f32(np.ones((b, p))),
        completion_BxT=jnp.asarray(rng.integers(2, vocab, (b, t)), jnp.int32),
        completion_mask_BxT=f32(np.ones((b, t))),
        sampler_logp_BxT=f32(-rng.exponential(10.0, (b, t))),
        truncated_B=f32(np.ones(b)), rewards_B=f32(rng.random(b)), correct_B=f32(np.zeros(b)),
        weight_B=f32(np.ones(b)), group_size=shape.group)


class LearnBench:
    """``RLTrainer``'s learning program for a random model, called directly."""

    def __init__(self, sizes: dict, shape: Shape, steps: int, seed: int = 0,
                 logp_chunk: int | None = None, share_prompts: bool | None = None,
                 one_pass_head: bool | None = None, lora: LoraConfig | None = None):
        self.config = dataclasses.replace(B.model_config(sizes), lora=lora)
        graphdef, params = nnx.split(Decoder(self.config, rngs=nnx.Rngs(seed)))
        # The trainer reads only the pad / eos ids of its tokenizer outside rollouts.
        self.tr = RLTrainer(
            graphdef, build_char_tokenizer(), lambda c, m: np.zeros(len(c), np.float32),
            algorithm=AlgorithmConfig(name="grpo", group_size=shape.group, kl_coef=0.04),
            optim=OptimConfig(lr=1e-6),
            rl=RLConfig(steps=steps, prompts_per_step=shape.prompts,
                        share_prompts=share_prompts, one_pass_head=one_pass_head,
                        **({} if logp_chunk is None else {"logp_chunk": logp_chunk})),
            sampling=SamplingConfig(max_new_tokens=shape.new_tokens),
            prompt_len=shape.prompt_len)
        self.state = self.tr.init_state(params, seed=seed)
        self.ro = random_rollout(shape, self.config.vocab_size, seed)
        self.program = learning_program(self.tr, self.state)
        self.key = jax.random.key(seed)
        self.shape = shape

    def call(self) -> float:
        """One call of the program (params and optimiser state donated and replaced);
        returns its wall seconds."""
        s = self.state
        scalars = state_scalars(s)
        with B.CpuMeter() as meter:
            params, opt_state, out, metrics = self.program(
                s.params, s.opt_state, scalars, s.ref_params, self.ro, self.key, None)
            jax.block_until_ready((params, opt_state, metrics))
        self.state = dataclasses.replace(s, params=params, opt_state=opt_state, **out)
        self.others, self.kernel = meter.others_cores, meter.kernel_s
        return meter.wall

    def flops(self) -> int:
        """Matmul FLOPs of one call: the reference forward + forward and backward (3x), each
        group's prompt counted once where the trainer shares prompts."""
        sh = self.shape
        if self.tr.share_group > 1:
            return 4 * B.grouped_forward_flops(self.config, sh.prompts, sh.group,
                                               sh.prompt_len, sh.new_tokens)
        return 4 * B.forward_flops(self.config, sh.rows, sh.prompt_len + sh.new_tokens,
                                   sh.new_tokens)


def learning_program(tr: RLTrainer, state):
    """The trainer's jitted learning program ``(params, opt_state, scalars, ref_params,
    rollout, key, teacher_params) -> (params, opt_state, scalars, metrics)``: the one
    ``RLTrainer.step`` calls (``rljax.train.programs.step.learn_step`` of the trainer's
    spec), so this benchmark times exactly it."""
    return functools.partial(run, learn_step, tr.step_spec(state))


def measure(sizes: dict, shape: Shape, reps: int, peak_n: int = 2048, log=print,
            logp_chunk: int | None = None, share_prompts: bool | None = None,
            one_pass_head: bool | None = None) -> dict:
    """Median seconds, FLOP/s and peak (one peak measurement after each call)."""
    bench = LearnBench(sizes, shape, steps=reps + 1, logp_chunk=logp_chunk,
                       share_prompts=share_prompts, one_pass_head=one_pass_head)
    bench.call()  # compile
    B.matmul_peak_flops(peak_n, 1)
    times, others, kernel, peaks = [], [], [], []
    for i in range(reps):
        times.append(bench.call())
        others.append(bench.others)
        kernel.append(bench.kernel)
        peaks.append(B.matmul_peak_flops(peak_n))
        log(f"  call {i}: {times[-1]:.3f} s (others {others[-1]:.2f} cores; kernel "
            f"{kernel[-1]:.2f} s), peak "
            f"{peaks[-1] / 1e9:.1f} GFLOP/s")
    t, peak = B.median(times), B.median(peaks)
    flops = bench.flops()
    return {"seconds": t, "flops": flops, "flops_per_s": flops / t, "peak": peak,
            "fraction": flops / t / peak, "others": B.median(others),
            "kernel": B.median(kernel)}


def measure_lora(sizes: dict, shape: Shape, reps: int, rank: int, log=print, **kw) -> dict:
    """Median seconds of the learning program with rank-``rank`` adapters and with full
    parameters, their calls interleaved (after one compiling call each)."""
    benches = {"full": LearnBench(sizes, shape, steps=reps + 1, **kw),
               "lora": LearnBench(sizes, shape, steps=reps + 1,
                                  lora=LoraConfig(rank=rank, alpha=2.0 * rank), **kw)}
    times: dict = {k: [] for k in benches}
    for b in benches.values():
        b.call()  # compile
    for i in range(reps):
        for name, b in benches.items():
            times[name].append(b.call())
            log(f"  {name} call {i}: {times[name][-1]:.3f} s (others {b.others:.2f} cores)")
    med = {k: B.median(v) for k, v in times.items()}
    return {"lora_s": med["lora"], "full_s": med["full"],
            "lora_over_full": med["lora"] / med["full"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="timed calls per model (after one)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--logp-chunk", type=int, default=None,
                    help="RLConfig.logp_chunk (default: RLConfig's own); e.g. 32 vs 256 "
                         "to compare the head's chunking on one device")
    ap.add_argument("--per-row-prompts", action="store_true",
                    help="RLConfig.share_prompts=False: every row computes its prompt "
                         "(the FLOPs counted accordingly)")
    ap.add_argument("--two-pass-head", action="store_true",
                    help="RLConfig.one_pass_head=False: the update recomputes each log-prob "
                         "chunk's logits in the backward pass (the FLOPs counted are the same "
                         "model FLOPs either way)")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="also time the program with rank-R LoRA adapters, interleaved with "
                         "the full-parameter one, and print the ratio")
    args = ap.parse_args(argv)
    if args.lora < 0:
        ap.error(f"--lora must be >= 0, got {args.lora}")
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.logp_chunk is not None and args.logp_chunk < 1:
        ap.error(f"--logp-chunk must be >= 1, got {args.logp_chunk}")
    shape = QUICK if args.quick else FULL
    models = ({"tiny": B.TINY} if args.quick else
              {"reference": B.REFERENCE, "larger": B.LARGER})
    print(f"jax {jax.__version__} {jax.devices()} cpus {os.cpu_count()} "
          f"loadavg {os.getloadavg()}; {shape.rows} sequences x "
          f"{shape.prompt_len + shape.new_tokens} tokens")
    res = {}
    for name, sizes in models.items():
        print(f"{name} model {sizes}:")
        r = res[name] = measure(sizes, shape, args.reps, 256 if args.quick else 2048,
                                logp_chunk=args.logp_chunk,
                                share_prompts=False if args.per_row_prompts else None,
                                one_pass_head=False if args.two_pass_head else None)
        print(f"{name}: learning program {r['seconds']:.3f} s (median; others' CPU "
              f"{r['others']:.2f} cores; own kernel time {r['kernel']:.2f} s), "
              f"{r['flops'] / 1e9:.1f} GFLOP -> "
              f"{r['flops_per_s'] / 1e9:.1f} GFLOP/s = {r['fraction']:.1%} of the float32 "
              f"matmul peak ({r['peak'] / 1e9:.1f} GFLOP/s)")
        if args.lora:
            r.update(measure_lora(sizes, shape, args.reps, args.lora,
                                  logp_chunk=args.logp_chunk))
            print(f"{name}: LoRA rank {args.lora} {r['lora_s']:.3f} s vs full parameters "
                  f"{r['full_s']:.3f} s (medians, interleaved): ratio {r['lora_over_full']:.3f}")
    r = res[list(models)[-1]]
    lora = (f" lora_s={r['lora_s']:.4g} full_s={r['full_s']:.4g} "
            f"lora_over_full={r['lora_over_full']:.4f}" if args.lora else "")
    print(f"RESULT flops_per_s={r['flops_per_s']:.4g} peak_flops_per_s={r['peak']:.4g} "
          f"fraction={r['fraction']:.4f}{lora}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
