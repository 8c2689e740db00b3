"""The learning program padded vs packed, side by side in one run, on a fixed workload.

Workload (fixed): ``--prompts`` prompts (default 8) of 120 tokens, G = 8 completions each,
completion lengths log-normal with median 180 and sigma 0.6, capped at 1,024 (numpy seed
0); random tokens; shared prompts on where the program can take them.

- padded: ``RLTrainer``'s learning program today (``max_new_tokens`` = 1,024: every row
  is 1,024 completion slots; each group's prompt computed once, ``share_prompts``), in
  micro-batches of ``--micro-batch-size`` rows (16: under 10 GB of host memory);
- packed: the same trainer with ``RLConfig.tokens_per_micro_batch`` (each row's real
  tokens packed into rows of ``120 + 1,024`` slots within each batch shard;
  ``rljax.train.learn.packing``), ``--rows-per-micro`` packed rows a micro-batch, its
  bucket from ``Packed.for_rollout`` (``rljax.train.learn.layout``).

Both run GRPO with beta 0.04 (the reference forward, group advantages, one AdamW update
with the k3 KL in the loss) on the benchmark model (``_bench.REFERENCE``: random Qwen2,
hidden 256, 4 layers, vocab 32,000, float32), calls alternating after one compiling call
each; the times are medians of ``--reps`` calls.

    python experiments/bench_packing.py [--prompts 8] [--reps 3] [--rows-per-micro N]
                                        [--micro-batch-size 16] [--quick]

Last line: ``RESULT padded_s=<a> packed_s=<b> speedup=<a/b> useful_token_frac=<f>``
(``useful_token_frac``: real tokens over packed slots).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _bench as B  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rljax.models import Decoder, build_char_tokenizer  # noqa: E402
from rljax.train import (AlgorithmConfig, OptimConfig, RLConfig, RLTrainer,  # noqa: E402
                         Rollout, SamplingConfig)
from rljax.train.programs.step import learn_step, run, state_scalars  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Workload:
    """The issue's fixed workload (``quick``: tiny, for a smoke test)."""

    prompts: int = 8
    group: int = 8
    prompt_len: int = 120
    max_new_tokens: int = 1024
    median: float = 180.0
    sigma: float = 0.6
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.prompts * self.group


QUICK = Workload(prompts=2, group=4, prompt_len=8, max_new_tokens=32, median=8.0)


def completion_lengths(w: Workload) -> np.ndarray:
    """Log-normal lengths (median ``w.median``, ``w.sigma``), in 1 .. ``max_new_tokens``."""
    rng = np.random.default_rng(w.seed)
    n = np.rint(rng.lognormal(np.log(w.median), w.sigma, w.rows)).astype(int)
    return np.clip(n, 1, w.max_new_tokens)


def workload_rollout(w: Workload, vocab: int) -> Rollout:
    """The workload as a rollout: each prompt's G completions consecutive, right-padded."""
    rng = np.random.default_rng(w.seed + 1)
    b, p, t = w.rows, w.prompt_len, w.max_new_tokens
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    cmask = np.arange(t)[None] < completion_lengths(w)[:, None]
    prompt_NxP = rng.integers(2, vocab, (w.prompts, p))
    return Rollout(
        prompt_BxP=jnp.asarray(np.repeat(prompt_NxP, w.group, axis=0), jnp.int32),
        prompt_mask_BxP=f32(np.ones((b, p))),
        completion_BxT=jnp.asarray(np.where(cmask, rng.integers(2, vocab, (b, t)), 0),
                                   jnp.int32),
        completion_mask_BxT=f32(cmask), sampler_logp_BxT=f32(-rng.exponential(10.0, (b, t))),
        truncated_B=f32(cmask[:, -1]), rewards_B=f32(rng.random(b)),
        correct_B=f32(np.zeros(b)), weight_B=f32(np.ones(b)), group_size=w.group)


class Side:
    """One learning program (padded, or packed with ``tokens_per_micro_batch``)."""

    def __init__(self, sizes: dict, w: Workload, ro: Rollout, steps: int,
                 tokens_per_micro_batch: int = 0, micro_batch_size: int = 0):
        config = B.model_config(sizes)
        graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
        self.tr = RLTrainer(
            graphdef, build_char_tokenizer(), lambda c, m: np.zeros(len(c), np.float32),
            algorithm=AlgorithmConfig(name="grpo", group_size=w.group, kl_coef=0.04,
                                      micro_batch_size=micro_batch_size),
            optim=OptimConfig(lr=1e-6),
            rl=RLConfig(steps=steps, prompts_per_step=w.prompts,
                        tokens_per_micro_batch=tokens_per_micro_batch),
            sampling=SamplingConfig(max_new_tokens=w.max_new_tokens),
            prompt_len=w.prompt_len)
        self.state = self.tr.init_state(params, seed=0)
        self.ro, self.key = ro, jax.random.key(0)
        spec = self.tr.step_spec(self.state)
        spec = dataclasses.replace(spec, layout=spec.layout.for_rollout(ro))
        self.layout = spec.layout
        self.program = functools.partial(run, learn_step, spec)
        self.metrics: dict = {}

    def call(self) -> float:
        """One call (parameters and optimiser state donated and replaced); wall seconds."""
        s = self.state
        with B.CpuMeter() as meter:
            params, opt_state, out, m = self.program(s.params, s.opt_state, state_scalars(s),
                                                     s.ref_params, self.ro, self.key, None)
            jax.block_until_ready((params, opt_state, m))
        self.state = dataclasses.replace(s, params=params, opt_state=opt_state, **out)
        self.metrics, self.others = {k: float(v) for k, v in m.items()}, meter.others_cores
        return meter.wall


def measure(sizes: dict, w: Workload, reps: int, rows_per_micro: int, micro_batch_size: int,
            log=print) -> dict:
    """Median seconds of the padded and the packed program, their calls alternating."""
    ro = workload_rollout(w, sizes["vocab_size"])
    width = w.prompt_len + w.max_new_tokens
    sides = {"padded": Side(sizes, w, ro, reps + 1, micro_batch_size=micro_batch_size),
             "packed": Side(sizes, w, ro, reps + 1, rows_per_micro * width)}
    log(f"rows {w.rows}, completion tokens {int(np.sum(ro.completion_mask_BxT))} of "
        f"{w.rows * w.max_new_tokens} slots; packed: {sides['packed'].layout.shape}")
    times: dict = {k: [] for k in sides}
    for name, side in sides.items():
        log(f"  {name} compile+call: {side.call():.2f} s")
    for i in range(reps):
        for name, side in sides.items():
            times[name].append(side.call())
            log(f"  {name} call {i}: {times[name][-1]:.2f} s (others {side.others:.2f} "
                f"cores) loss {side.metrics['loss']:.6g}")
    padded, packed = B.median(times["padded"]), B.median(times["packed"])
    return {"padded_s": padded, "packed_s": packed, "speedup": padded / packed,
            "useful_token_frac": sides["packed"].metrics["useful_token_frac"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts (x 8 completions)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per side (after one)")
    ap.add_argument("--rows-per-micro", type=int, default=0,
                    help="packed rows per micro-batch (tokens_per_micro_batch / 1,144); "
                         "default: prompts / 4, at least 1")
    ap.add_argument("--micro-batch-size", type=int, default=16,
                    help="the padded program's rows per micro-batch (0: the whole batch; "
                         "16 keeps a CPU host's memory under 10 GB)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = ap.parse_args(argv)
    w = QUICK if args.quick else dataclasses.replace(Workload(), prompts=args.prompts)
    sizes = B.TINY if args.quick else B.REFERENCE
    rows = args.rows_per_micro or max(1, w.prompts // 4)
    micro = 0 if args.quick else args.micro_batch_size
    print(f"backend {jax.default_backend()}, model {sizes}, workload {w}, padded "
          f"micro_batch_size {micro}, packed rows per micro-batch {rows}")
    r = measure(sizes, w, args.reps, rows, micro)
    print(" ".join(f"{k}={v:.4g}" for k, v in r.items()).join(("RESULT ", "")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
