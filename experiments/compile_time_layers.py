"""Compile time of the training step vs depth: layers as a Python loop vs `scan_layers`.

For 2, 4 and 8 layers, lowers and compiles (XLA, this machine's backend) a
`jax.value_and_grad` of the mean next-token NLL of a decoder shaped like the sampler
benchmark's model (hidden 256, 8 heads, 4 kv heads, intermediate 704, vocab 32000), on
abstract inputs (nothing runs, no weights are allocated), once with the layers as a
Python loop and once stacked under `jax.lax.scan` (`ModelConfig.scan_layers=True`).
The loop's compile time grows with depth; the scanned one should stay about flat (its
compiled program is the same size at every depth: one loop forward, one backward).
Timings swing on a busy machine: a warm-up compile comes first, the two layouts and the
depths are interleaved over `--repeats` rounds and each figure is the median, with the
1-minute load average printed beside it. Figures are this process's CPU seconds.

The last line is `RESULT loop_L2_s=... ... scan_L8_s=... loop_8_over_2=... scan_8_over_2=...`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models import Decoder, ModelConfig


def _lm_loss(graphdef, state, ids_BxT, mask_BxT):
    logits = nnx.merge(graphdef, state)(ids_BxT, mask_BxT=mask_BxT)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, ids_BxT[:, 1:, None], axis=-1)[..., 0]
    m = (mask_BxT[:, 1:] & mask_BxT[:, :-1]).astype(jnp.float32)
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def compile_seconds(config: ModelConfig, batch: int, length: int) -> tuple[float, float]:
    """(lower, compile) CPU seconds of this process for value_and_grad of the LM loss
    (process time: compiling is one thread, and other jobs inflate wall time)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, length), jnp.bool_)
    fn = jax.jit(jax.value_and_grad(lambda st, i, m: _lm_loss(graphdef, st, i, m)))
    t0 = time.process_time()
    lowered = fn.lower(state, ids, mask)
    t1 = time.process_time()
    lowered.compile()
    return t1 - t0, time.process_time() - t1


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--remat", default="none", choices=("none", "full", "dots_saveable"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    base = ModelConfig(vocab_size=32000, hidden_size=256, intermediate_size=704, num_layers=2,
                       num_heads=8, num_kv_heads=4, qkv_bias=True, architecture="qwen2",
                       remat=args.remat)
    print(f"backend={jax.default_backend()} remat={args.remat} batch={args.batch} "
          f"length={args.length}")
    compile_seconds(ModelConfig(**{**base.__dict__, "num_layers": 1}), 1, 8)  # warm-up
    times: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for n in args.layers:
            for scan in (False, True):
                name = "scan" if scan else "loop"
                config = ModelConfig(**{**base.__dict__, "num_layers": n, "scan_layers": scan})
                lower_s, compile_s = compile_seconds(config, args.batch, args.length)
                times.setdefault(f"{name}_L{n}_s", []).append(lower_s + compile_s)
                print(f"round {r} layers={n} {name}: lower {lower_s:.2f} s + compile "
                      f"{compile_s:.2f} s CPU (load average {os.getloadavg()[0]:.1f})", flush=True)
    result = {k: round(statistics.median(v), 2) for k, v in times.items()}
    lo, hi = min(args.layers), max(args.layers)
    for name in ("loop", "scan"):
        result[f"{name}_{hi}_over_{lo}"] = round(result[f"{name}_L{hi}_s"] /
                                                 result[f"{name}_L{lo}_s"], 2)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
