"""Time the demo's RL step by phase, and its learning phase against the CPU's matmul peak.

Builds the demo's model and task (`experiments/arithmetic_grpo.py`, random weights: the
shapes, not the accuracy, set the cost), runs warm-up steps (compilation), then times
`--steps` RL steps and prints the median split rollout / rewards / learn, and the
learning phase's model FLOP/s (6N per token per training pass, 2N per extra forward;
N = parameters that multiply activations, the input embedding table excluded) over the
float32 matmul peak measured in the same process (the best of repeated square `jnp.dot`
calls). Run it on an idle machine: other processes on these 2 cores halve every figure.

The last line is `RESULT step_s=... rollout_s=... reward_s=... learn_s=... learn_flops_frac=...`.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _bench as B  # noqa: E402  (shared benchmark helpers)

from rljax.train.rl import RLTrainer  # noqa: E402

try:
    from rljax.run import builders
except ImportError:  # rljax before the run layer had its own package (side-by-side runs)
    from rljax.train import builders  # type: ignore[no-redef]

_DEMO = pathlib.Path(__file__).with_name("arithmetic_grpo.py")


def demo_config():
    """The demo experiment's config (imported from its file)."""
    spec = importlib.util.spec_from_file_location("arithmetic_grpo", _DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.config()


def matmul_peak_flops(n: int = 1024, repeats: int = 20) -> float:
    """Best float32 FLOP/s of an ``[n, n] @ [n, n]`` jitted dot on the default device."""
    return B.matmul_peak_flops(n, repeats, reduce=min)


def matmul_params(params, cfg) -> int:
    """Parameters that multiply activations (the input embedding is a lookup)."""
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return total - (0 if cfg.model.tie_word_embeddings else cfg.model.vocab_size * cfg.model.hidden_size)


def _learn_fields(m: dict, epochs: int, share_group: int = 1) -> None:
    """``time_learn`` and ``seq_tokens`` of a step's metrics; rljax before the one
    learning program timed its forwards and updates apart and logged no token counts."""
    if "time_learn" not in m:
        m["time_learn"] = sum(m.get(f"time_{k}", 0.0)
                              for k in ("ref_logp", "old_logp", "values", "update"))
        m["seq_tokens"] = m["train_tok_s"] * m["time_update"] / epochs
    else:  # the tokens the forwards compute: each group's prompt once where shared
        m["seq_tokens"] = m["completion_tokens"] + m["prompt_tokens"] / share_group


def main(argv=None) -> int:
    """Time the steps and print the split, the FLOP/s ratio and the RESULT line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed RL steps (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    args = ap.parse_args(argv)
    cfg = demo_config()
    tok = builders.build_tokenizer(cfg)
    mesh = builders.build_mesh(cfg)
    graphdef, params = nnx.split(builders.build_model(cfg, tok, mesh))
    n_matmul = matmul_params(params, cfg)
    task = builders.build_task(cfg, tok)
    reward_fns, accuracy_fn = builders.build_reward(cfg)
    tr = RLTrainer(graphdef, tok, reward_fns, algorithm=cfg.algorithm, optim=cfg.optim,
                   sampling=cfg.sampling, rl=cfg.rl, prompt_len=cfg.task.max_prompt_tokens,
                   accuracy_fn=accuracy_fn, mesh=mesh)
    a = tr.alg
    state = tr.init_state(params, seed=0)
    rows = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, m = tr.step(state, task.train)
        m["step_s"] = time.perf_counter() - t0
        if i >= args.warmup:
            rows.append(m)
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)
    for r in rows:
        _learn_fields(r, a.num_epochs, getattr(tr, "share_group", 1))
    learn_s = med("time_learn")
    seq_tokens = med("seq_tokens")
    fwd = tr.uses_ref + (tr.old_mode == "recompute")
    flops = (6 * a.num_epochs + 2 * fwd) * n_matmul * seq_tokens
    peak = matmul_peak_flops()
    frac = flops / learn_s / peak
    print(f"devices {jax.device_count()}, {n_matmul / 1e6:.2f}M matmul parameters, "
          f"{tr.batch_size} completions x {cfg.sampling.max_new_tokens} tokens per step")
    print(f"median of {len(rows)} steps: step {med('step_s'):.3f} s = rollout "
          f"{med('time_rollout'):.3f} + rewards {med('time_reward'):.3f} + learn {learn_s:.3f}")
    print(f"learning phase: {flops / learn_s / 1e9:.2f} GFLOP/s = {frac:.1%} of the float32 "
          f"matmul peak measured here ({peak / 1e9:.1f} GFLOP/s)")
    print(f"RESULT step_s={med('step_s'):.4f} rollout_s={med('time_rollout'):.4f} "
          f"reward_s={med('time_reward'):.4f} learn_s={learn_s:.4f} learn_flops_frac={frac:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
