"""Sampler speed: rljax.sampling.generate vs transformers' generate on the reference model.

The reference benchmark model (docs/design.md): a random Qwen2 (hidden 256, 4 layers, 8 heads,
4 kv heads, intermediate 704, vocab 32000, float32) with transformers' initialisation,
written as an HF checkpoint to a temporary folder (``_bench.build_checkpoint``) and
loaded by both sides.
Batch 32, prompts of 32 random tokens, exactly 128 new tokens sampled at temperature 1
with no early stop on either side (no stop ids / no EOS, ``min_new_tokens=128``).

After one warm-up each, the two sides run interleaved ``--runs`` times; the medians are
compared. Beside each figure: the CPU time other processes used during that run (in
cores, from /proc/stat minus this process's /proc/self/stat), because two processes
timing on the same 2 cores slow each other several-fold. Also printed: rljax's decode
step time beside the step's matmul FLOPs divided by the float32 matmul peak measured here,
and the time per step of the output projection alone (:func:`head_step_seconds`) beside
the step time the 5x target would need.

    python experiments/bench_sampler.py [--runs 5]

Last line: ``RESULT rljax_tok_s=... hf_tok_s=... ratio=...``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _bench as B  # noqa: E402  (shared benchmark helpers)
from _bench import CpuMeter  # noqa: E402,F401

from rljax.models import from_pretrained
from rljax.sampling import generate, state_vocab_major_weight, vocab_major_head

BATCH, PROMPT_LEN, NEW_TOKENS = 32, 32, 128
TARGET = 5  # the issue's speed target: rljax >= 5x transformers' generate


def build_checkpoint(path):
    """The random reference Qwen2 written as an HF checkpoint in ``path``; returns it
    loaded by transformers (eval mode, float32)."""
    from transformers import AutoModelForCausalLM

    B.build_checkpoint(path, B.REFERENCE)
    return AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


def best_seconds(fn, reps):
    """Fastest of ``reps`` timed calls of ``fn()`` (its result waited for), after a warm-up."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak_flops(n=2048, reps=5):
    """Float32 matmul FLOP/s of this machine under XLA (best of ``reps``)."""
    return B.matmul_peak_flops(n, reps, reduce=min)


def decode_step_flops(cfg, rows, cache_len):
    """Matmul FLOPs of one decode step (projections, MLP, lm head, attention)."""
    h, n, k, d = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    per_layer = d * (2 * n * h + 2 * k * h) + 3 * d * cfg.intermediate_size
    attn = 2 * n * h * cache_len  # q.k and p.v per layer
    per_token = cfg.num_layers * (per_layer + attn) + d * cfg.vocab_size
    return 2 * rows * per_token


def head_step_seconds(model, rows=BATCH, steps=32, reps=5):
    """Seconds per decode step spent by the output projection alone (best of ``reps``).

    The sampler's first work on each step's hidden states, timed in isolation: its head
    (:func:`rljax.sampling.vocab_major_head` with the weight the sampler uses), then the
    max, exp and sum over the vocabulary (the start of the inverse-CDF draw), in a
    ``fori_loop`` of ``steps`` steps where each step's input depends on the last, as in
    the decode loop. No layers, no cache. Reported for the reference model's untied
    ``lm_head``.
    """
    if model.config.tie_word_embeddings:
        raise ValueError("head_step_seconds: expects an untied lm_head (the reference model)")
    graphdef, state = nnx.split(model)
    w = state_vocab_major_weight(state, model.config)

    @jax.jit
    def loop(state, w, h_RxD):
        head = vocab_major_head(nnx.merge(graphdef, state), w)

        def step(_, h_RxD):
            x_VxR = head(h_RxD)
            total_R = jnp.sum(jnp.exp(x_VxR - jnp.max(x_VxR, axis=0)), axis=0)
            return h_RxD + 1e-9 * total_R[:, None]

        return jax.lax.fori_loop(0, steps, step, h_RxD)

    h = jax.random.normal(jax.random.key(0), (rows, model.config.hidden_size), jnp.float32)
    return best_seconds(lambda: loop(state, w, h), reps) / steps


def hf_run(model, prompts):
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
            min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS, top_k=0, top_p=1.0,
            temperature=1.0, eos_token_id=None, pad_token_id=0,
        )
    assert out.shape == (BATCH, PROMPT_LEN + NEW_TOKENS), out.shape
    return out


def rljax_run(model, prompts, key, new_tokens=NEW_TOKENS):
    res = generate(model, prompts, key=key, max_new_tokens=new_tokens)
    jax.block_until_ready(res)
    assert int(res.completion_mask.sum()) == BATCH * new_tokens
    return res


def timed(fn):
    with CpuMeter() as m:
        fn()
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="interleaved timed runs per side (>= 3)")
    args = ap.parse_args(argv)
    if args.runs < 3:
        raise SystemExit("--runs must be >= 3 (medians of interleaved runs)")
    import torch  # the baseline's heavy optional import, only for a run

    print(f"jax {jax.__version__} devices={jax.devices()} torch {torch.__version__} "
          f"torch_threads={torch.get_num_threads()} cpus={os.cpu_count()} "
          f"loadavg={os.getloadavg()}")
    prompts = np.random.default_rng(0).integers(0, 32000, (BATCH, PROMPT_LEN)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_checkpoint(tmp)
        ours = from_pretrained(tmp)
    new = BATCH * NEW_TOKENS
    peak = matmul_peak_flops()
    rljax_run(ours, prompts, jax.random.key(0))  # compile + warm-up
    rljax_run(ours, prompts, jax.random.key(0), new_tokens=1)
    hf_run(hf, prompts)
    ours_m, hf_m, pre_m = [], [], []
    for i in range(args.runs):
        ours_m.append(timed(lambda: rljax_run(ours, prompts, jax.random.key(i + 1))))
        hf_m.append(timed(lambda: hf_run(hf, prompts)))
        pre_m.append(timed(lambda: rljax_run(ours, prompts, jax.random.key(i), new_tokens=1)))
        print(f"run {i}: rljax {new / ours_m[-1].wall:7.0f} tok/s (others "
              f"{ours_m[-1].others_cores:.2f} cores)   hf {new / hf_m[-1].wall:7.0f} tok/s "
              f"(others {hf_m[-1].others_cores:.2f} cores)")
    t_ours = statistics.median(m.wall for m in ours_m)
    t_hf = statistics.median(m.wall for m in hf_m)
    t_pre = statistics.median(m.wall for m in pre_m)
    step = (t_ours - t_pre) / (NEW_TOKENS - 1)
    flops = decode_step_flops(ours.config, BATCH, PROMPT_LEN + NEW_TOKENS - 1)
    others = lambda ms: statistics.median(m.others_cores for m in ms)  # noqa: E731
    ours_tok, hf_tok = new / t_ours, new / t_hf
    print(f"rljax: median {ours_tok:.0f} new tok/s ({t_ours:.3f} s; others' CPU median "
          f"{others(ours_m):.2f} cores)")
    print(f"hf   : median {hf_tok:.0f} new tok/s ({t_hf:.3f} s; others' CPU median "
          f"{others(hf_m):.2f} cores)")
    print(f"rljax decode step {step * 1e3:.2f} ms (prefill+first token {t_pre * 1e3:.1f} ms); "
          f"step matmul FLOPs {flops / 1e6:.0f} M / peak {peak / 1e9:.1f} GFLOP/s = "
          f"{flops / peak * 1e3:.2f} ms floor ({flops / peak / step:.0%} of peak)")
    head = head_step_seconds(ours)
    budget = (t_hf / TARGET - t_pre) / (NEW_TOKENS - 1)
    print(f"lm head alone (dot, max, exp, sum; in a loop): {head * 1e3:.2f} ms/step = "
          f"{head / step:.0%} of the decode step; {TARGET}x transformers needs a whole step "
          f"<= {budget * 1e3:.2f} ms (the head alone is {head / budget:.0%} of that)")
    print(f"ratio rljax/hf = {ours_tok / hf_tok:.2f}")
    print(f"RESULT rljax_tok_s={ours_tok:.0f} hf_tok_s={hf_tok:.0f} "
          f"ratio={ours_tok / hf_tok:.2f}")


if __name__ == "__main__":
    main()
