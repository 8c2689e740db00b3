"""The arithmetic demo one step off (issue 60, "learning holds"): each seed trained
synchronously and at ``rl.max_staleness=1``, the same config otherwise.

The demo's config (``experiments/arithmetic_grpo.py``) with two changes both runs share:
one seed per run (an asynchronous run keeps its own in-flight batch; several seeds in
one vmapped program refuse it), so the reward is the task's verifier on the host; and
``algorithm.old_logp="auto"`` (with two minibatches: pi_old recomputed before the
updates, the proximal policy), since the demo's ``"sampler"`` would take the ratio
against the stale sampler. Seeds 0-3 (``--seeds``), each from its own SFT warm-up.

    python experiments/arithmetic_async.py [--seeds 4] [--root runs/arithmetic_async]

Last line: ``RESULT seeds=4 sync_after=<mean> async_after=<mean> after_diff=<async -
sync> async_gain_min=... sync_gain_min=... wall_s=...``; each seed's figures above it.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import arithmetic_grpo  # noqa: E402

from rljax.run import run_experiment  # noqa: E402


def config(seed: int, staleness: int, root: str):
    cfg = arithmetic_grpo.config()
    return dataclasses.replace(
        cfg, algorithm=dataclasses.replace(cfg.algorithm, old_logp="auto"),
        rl=dataclasses.replace(cfg.rl, max_staleness=staleness),
        run=dataclasses.replace(cfg.run, seeds=1, seed=seed, overwrite=True,
                                dir=f"{root}/seed{seed}_staleness{staleness}"))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--root", default="runs/arithmetic_async")
    a = p.parse_args(argv)
    t0, rows = time.perf_counter(), {0: [], 1: []}
    for seed in range(a.seeds):
        for k in (0, 1):
            res = run_experiment(config(seed, k, a.root))
            rows[k].append((res.accuracy_before, res.accuracy_after))
            print(f"seed {seed} staleness {k}: {res.accuracy_before:.3f} -> "
                  f"{res.accuracy_after:.3f}", flush=True)
    sync, asyn = np.array(rows[0]), np.array(rows[1])
    out = {"seeds": a.seeds, "sync_after": sync[:, 1].mean(), "async_after": asyn[:, 1].mean(),
           "after_diff": asyn[:, 1].mean() - sync[:, 1].mean(),
           "async_gain_min": (asyn[:, 1] - asyn[:, 0]).min(),
           "sync_gain_min": (sync[:, 1] - sync[:, 0]).min(),
           "wall_s": time.perf_counter() - t0}
    print("RESULT " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
