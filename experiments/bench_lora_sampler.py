"""LoRA in the sampler: adapters applied on the fly vs merged into the weights once.

The reference benchmark model (docs/design.md: a random Qwen2, hidden 256, 4 layers,
vocab 32000, float32) with rank-R adapters on all seven projections (A and B random, so
nothing is zero). Two ways for the sampler to run base + adapters:

- on the fly (what rljax does): the LoRA model itself; each projection adds
  ``scale (x A) B`` beside ``x W``;
- merged: ``W + scale A B`` computed once (one jitted program over every adapted weight,
  the cost of a step's merge, timed separately) and the plain model sampled.

Batch 32, prompts of 32 random tokens, 128 new tokens at temperature 1, no early stop.
After a warm-up each, the two run interleaved ``--runs`` times; medians compared, with
the CPU other processes used beside each figure (``_bench.CpuMeter``). The merged side's
per-step cost is its sampling time plus one merge.

    python experiments/bench_lora_sampler.py [--rank 32] [--runs 5]

Last line: ``RESULT rank=R fly_s=... merged_s=... merge_s=... ratio=...`` (ratio =
on the fly / (merged + merge)).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _bench as B  # noqa: E402  (shared benchmark helpers)

from rljax.models import from_pretrained
from rljax.models.lora import LoraConfig, merged_weight, split_trainable
from rljax.sampling import generate

BATCH, PROMPT_LEN, NEW_TOKENS = 32, 32, 128


def _random_adapters(state, seed=1, scale=0.02):
    keys = iter(jax.random.split(jax.random.key(seed), 10_000))
    one = lambda v: (v.replace(scale * jax.random.normal(next(keys), v.get_value().shape))
                     if isinstance(v, nnx.LoRAParam) else v)
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def merge_program(lora_scale: float):
    """``(adapters, base) -> base`` with every adapted weight replaced by W + s A B."""

    @jax.jit
    def merge(adapters, base):
        flat, ad = dict(nnx.to_flat_state(base)), dict(nnx.to_flat_state(adapters))
        for path, var in list(flat.items()):
            a = ad.get(path[:-1] + (f"{path[-1]}_lora", "a"))
            if a is not None:
                b = ad[path[:-1] + (f"{path[-1]}_lora", "b")]
                flat[path] = var.replace(merged_weight(var.get_value(), a.get_value(),
                                                       b.get_value(), lora_scale))
        return nnx.from_flat_state(sorted(flat.items()))

    return merge


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        B.build_checkpoint(tmp, B.REFERENCE)
        lora = from_pretrained(tmp, lora=LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
        plain = from_pretrained(tmp)
    gd, state = nnx.split(lora)
    state = _random_adapters(state)
    lora = nnx.merge(gd, state)
    adapters, base = split_trainable(state)
    merge = merge_program(lora.config.lora.scale)
    plain_gd = nnx.graphdef(plain)
    prompts = np.random.default_rng(0).integers(3, 32000, (BATCH, PROMPT_LEN)).astype(np.int32)

    def sample(model):
        return generate(model, prompts, key=jax.random.key(0), max_new_tokens=NEW_TOKENS).tokens

    def merged_once():
        return nnx.merge(plain_gd, merge(adapters, base))

    sides = {"fly": lambda: sample(lora), "merged": lambda: sample(merged_model),
             "merge": merged_once}
    merged_model = merged_once()
    times: dict = {k: [] for k in sides}
    for fn in sides.values():  # warm-up (compiles)
        jax.block_until_ready(jax.tree.leaves(nnx.state(fn()) if fn is merged_once else fn()))
    for _ in range(args.runs):
        for name, fn in sides.items():
            with B.CpuMeter() as m:
                t = time.perf_counter()
                out = fn()
                jax.block_until_ready(nnx.state(out) if name == "merge" else out)
                dt = time.perf_counter() - t
            times[name].append(dt)
            print(f"{name:7s} {dt * 1e3:9.1f} ms   (other processes: {m.others_cores:.2f} cores)")
    med = {k: B.median(v) for k, v in times.items()}
    ratio = med["fly"] / (med["merged"] + med["merge"])
    print(f"medians: on the fly {med['fly']:.3f} s, merged {med['merged']:.3f} s + merge "
          f"{med['merge'] * 1e3:.1f} ms ({BATCH}x{NEW_TOKENS} new tokens, rank {args.rank})")
    print(f"RESULT rank={args.rank} fly_s={med['fly']:.4f} merged_s={med['merged']:.4f} "
          f"merge_s={med['merge']:.4f} ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
