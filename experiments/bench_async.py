"""Synchronous vs one-step-off asynchronous RL steps, side by side in one run (issue 60).

The host's work is made to *wait* as a remote judge or a sandbox does (a sleep: the chips
idle, nothing burns CPU): a batch reward that waits ``R`` seconds a call, and a multi-turn
tool environment whose every turn waits. ``R`` is set to the synchronous step's measured
learning time ``L`` (``--reward-over-learn`` scales it). Two trainers of the same model,
config and seed, ``rl.max_staleness`` 0 and 1, step in turns (one synchronous step, one
asynchronous step, ...), so both see the same machine.

With sampling ``S``, learning ``L`` and host work ``R`` per synchronous step, one step off
on one mesh overlaps the host's ``R`` with the chips' ``L`` (the sampler of the next batch
runs first): the ideal speedup is ``(S + L + R) / (S + max(L, R))`` = ``1 + R / (S + L)``
for ``R <= L``. ``efficiency`` = (speedup - 1) / (ideal - 1); ``overlap_frac`` = the
host time hidden per step, (sync_s - async_s) / R; ``staleness_mean`` the learned
batches' mean ``async/staleness``. Multi-turn on one mesh overlaps only the first turn's
host work: later turns' programs queue behind the learning program on the same chips.

    python experiments/bench_async.py [--steps 6] [--warmup 2] [--quick]

Last lines: ``RESULT source=reward sync_s=... async_s=... speedup=... ideal=...
efficiency=... overlap_frac=... staleness_mean=...`` and the same for ``source=episodes``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.envs import EnvLimits, StepResult
from rljax.models import Decoder, ModelConfig
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.multiturn import MultiTurnConfig
from rljax.train.rl import RLTrainer

WAIT = {"reward_s": 0.0, "turn_s": 0.0}  # the host's waits, set from the measured L


class Tok:
    """Ids 2.. as printable characters (pad 0, eos 1)."""

    pad_token_id, eos_token_id = 0, 1

    def encode(self, s):
        return [ord(c) - 30 for c in s]

    def decode(self, ids):
        return "".join(chr(30 + i) for i in ids if i >= 2)


PROMPTS = [f"{a}+{b}=" for a in range(10, 40) for b in range(3, 9)]


def prompts(start, n):
    idx = [(start + i) % len(PROMPTS) for i in range(n)]
    return [PROMPTS[i] for i in idx], [{"turns": 2} for _ in idx]


def judged(completions, metadata):
    """A batch reward behind a remote judge: waits, then scores the digits' share."""
    time.sleep(WAIT["reward_s"])
    return np.array([sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions],
                    np.float32)


class SandboxEnv:
    """Two model turns; each answer comes back from a sandbox after a wait (per batch
    of rows, shared: ``WAIT["turn_s"]`` divided over the rows that call it)."""

    stop_strings = ("=",)
    rows = 1

    def reset(self, metadata):
        self.t, self.k = 0, int(metadata["turns"])
        return metadata["prompt"]

    def step(self, model_text, tool_results=()):
        time.sleep(WAIT["turn_s"] / SandboxEnv.rows)
        self.t += 1
        done = self.t >= self.k
        return StepResult("" if done else "ok", float(any(c.isdigit() for c in model_text)),
                          done)


def trainers(cfg: ModelConfig, source: str, args):
    gd, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    multiturn = (MultiTurnConfig(SandboxEnv, EnvLimits(max_turns=2, max_obs_tokens=8,
                                                      max_total_tokens=2 * args.tokens + 24))
                 if source == "episodes" else None)
    out = []
    for k in (0, 1):
        out.append(RLTrainer(
            gd, Tok(), None if multiturn else judged,
            algorithm=algorithm_preset("grpo", group_size=args.group, kl_coef=0.0),
            optim=OptimConfig(lr=1e-4), sampling=SamplingConfig(max_new_tokens=args.tokens),
            rl=RLConfig(steps=1000, prompts_per_step=args.prompts, logp_chunk=16,
                        max_staleness=k),
            prompt_len=16, multiturn=multiturn))
    return out, params


def _median(ms, *keys):
    return statistics.median(sum(m.get(k, 0.0) for k in keys) for m in ms)


def measure(cfg, source: str, args) -> dict:
    (sync, asyn), params = trainers(cfg, source, args)
    SandboxEnv.rows = args.prompts * args.group
    WAIT.update(reward_s=0.0, turn_s=0.0)
    s_state = sync.init_state(jax.tree.map(jnp.copy, params), seed=0)
    a_state = asyn.init_state(jax.tree.map(jnp.copy, params), seed=0)  # each owns its own
    ms = []
    for _ in range(args.warmup + 2):  # compile; then S and L without waits
        s_state, m = sync.step(s_state, prompts)
        ms.append(m)
    learn_s = _median(ms[args.warmup:], "time_learn")
    wait = learn_s * args.reward_over_learn
    WAIT.update(reward_s=wait if source == "reward" else 0.0,
                turn_s=wait / 2 if source == "episodes" else 0.0)
    for _ in range(args.warmup):
        a_state, _ = asyn.step(a_state, prompts)
    walls, sm, am = {"sync": [], "async": []}, [], []
    for _ in range(args.steps):
        for name, tr in (("sync", sync), ("async", asyn)):
            t0 = time.perf_counter()
            if name == "sync":
                s_state, m = tr.step(s_state, prompts)
                sm.append(m)
            else:
                a_state, m = tr.step(a_state, prompts)
                am.append(m)
            walls[name].append(time.perf_counter() - t0)
    sync_s, async_s = statistics.median(walls["sync"]), statistics.median(walls["async"])
    # The host's wait per synchronous step: the reward's phase, or the environments' turns.
    host = _median(sm, "time_reward") if source == "reward" else wait
    ideal = 1.0 + host / max(sync_s - host, 1e-9)  # 1 + R / (S + L)
    speedup = sync_s / async_s
    return {"source": source, "sync_s": round(sync_s, 4), "async_s": round(async_s, 4),
            "speedup": round(speedup, 3), "ideal": round(ideal, 3),
            "efficiency": round((speedup - 1) / max(ideal - 1, 1e-9), 3),
            "overlap_frac": round(max(0.0, min(1.0, (sync_s - async_s) / max(host, 1e-9))), 3),
            "staleness_mean": round(float(np.mean([m["async/staleness"] for m in am])), 3),
            "learn_s": round(learn_s, 4), "host_s": round(host, 4)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="measured steps of each trainer")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps (compilation)")
    p.add_argument("--reward-over-learn", type=float, default=1.0,
                   help="the host's wait per step as a multiple of the measured L")
    p.add_argument("--quick", action="store_true", help="a tiny model (a smoke test)")
    p.add_argument("--sources", default="reward,episodes")
    a = p.parse_args(argv)
    size = (dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                 intermediate_size=64) if a.quick else
            dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                 intermediate_size=704))
    a.prompts, a.group, a.tokens = (2, 2, 4) if a.quick else (8, 4, 32)
    cfg = ModelConfig(vocab_size=128, max_position_embeddings=128, **size)
    out = []
    for source in a.sources.split(","):
        res = measure(cfg, source, a)
        print("RESULT " + " ".join(f"{k}={v}" for k, v in res.items()), flush=True)
        out.append(res)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
