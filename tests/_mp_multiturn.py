"""The multi-turn scenario of tests/test_multiturn_rollout.py: its environment, prompts
and the run it compares across topologies.

`run(mesh)` builds a tiny policy on `mesh` and samples one multi-turn rollout with
`RLTrainer(multiturn=...)`'s rollouts (this process's rows of its prompt, completion,
loss mask, log-probs and rewards, and the episode metrics). Run as a script it is one
process of a 2 x 4 pair: `python _mp_multiturn.py HOST:PORT PROCESS_ID OUT.npz` (4 CPU
devices from XLA_FLAGS, gloo collectives); the test runs the same `run` on 1 x 8 in its
own process.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from _train_common import CharTok, tiny_model
from rljax.envs import EnvLimits, StepResult

TOK = CharTok()
TURN_TOKENS = 6
LIMITS = EnvLimits(max_turns=3, max_obs_tokens=16, max_total_tokens=48)
PROMPTS = ["12+3=", "4*5=", "99-1=", "7=", "1+1=", "31*2=", "8-3=", "5="]


class CountEnv:
    """`metadata["turns"]` model turns; after turn t the observation is "ab" repeated
    t + turns - 1 times (4..10 tokens: turn 1's widest fits the 8 bucket, turn 2's the
    16); reward 0.5 per turn and, at the end, 1.0 if the last turn's text holds a digit.
    A turn ends at "=" or at "**" (two tokens)."""

    stop_strings = ("=", "**")

    def reset(self, metadata):
        self.k, self.t = int(metadata["turns"]), 0
        return metadata["prompt"]

    def step(self, model_text, tool_results=()):
        self.t += 1
        if self.t >= self.k:
            return StepResult("", float(any(c.isdigit() for c in model_text)), True)
        return StepResult("ab" * (self.t + self.k - 1), 0.5, False)


def source(start, n):
    idx = [(start + i) % len(PROMPTS) for i in range(n)]
    # 4 turns outlast EnvLimits.max_turns = 3: those rows end truncated ("max_turns")
    return [PROMPTS[i] for i in idx], [{"turns": 1 + i % 4} for i in idx]


def trainer(gd, mesh=None, obs_multiple: int = 8):
    from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
    from rljax.train.multiturn import MultiTurnConfig
    from rljax.train.rl import RLTrainer

    # kl_coef 0: no reference forward in the learning program (a smaller compile)
    return RLTrainer(gd, TOK, None, algorithm=algorithm_preset("grpo", group_size=2,
                                                                 kl_coef=0.0),
                     optim=OptimConfig(lr=1e-3),
                     sampling=SamplingConfig(max_new_tokens=TURN_TOKENS),
                     rl=RLConfig(steps=1, prompts_per_step=4, logp_chunk=8), prompt_len=16,
                     mesh=mesh, multiturn=MultiTurnConfig(CountEnv, LIMITS,
                                                          obs_multiple=obs_multiple))


def policy(mesh):
    """The tiny policy (one layer) on ``mesh``, the same on every topology."""
    return tiny_model(mesh=mesh, num_layers=1)


def replicated_key(seed: int, mesh):
    """A PRNG key replicated over ``mesh`` (on every process), as an RL step's key is."""
    from rljax.sharding import replicated

    return jax.jit(lambda: jax.random.key(seed), out_shardings=replicated(mesh))()


def run(mesh) -> dict:
    """This process's rows of one rollout on ``mesh``, sampled where any transfer but
    the named ones (``rljax.train.hosts``) is an error."""
    from rljax.train import hosts

    gd, st = policy(mesh)
    key, mt = replicated_key(0, mesh), trainer(gd, mesh).multiturn
    with jax.transfer_guard("disallow_explicit"):
        out = mt.sample(st, source, 0, 4, key)
    ro, lo, hi = out.rollout, out.lo, out.hi
    rows = {k: hosts.host_rows(getattr(ro, k), lo, hi)
            for k in ("prompt_BxP", "completion_BxT", "loss_mask_BxT", "rewards_B",
                      "sampler_logp_BxT", "truncated_B")}
    return {"lo": lo, "hi": hi, **rows, **{f"env:{k}": v for k, v in out.metrics.items()}}


def main(coordinator: str, pid: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    from rljax.sharding import MeshConfig, make_mesh

    got = run(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    np.savez(out, **{k.replace("/", "|"): np.asarray(v) for k, v in got.items()})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
