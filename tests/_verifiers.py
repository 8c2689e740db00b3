"""Rewards and verifiers that reward worker processes import (the multi-process runs of
tests/_multiprocess.py and tests/test_preemption.py, tests/test_stop_ids_and_flops.py): a
module of its own, numpy only, so a worker loads it in a fraction of a second. Defined in
an experiment file or a test module, a reward makes each worker import what that file
imports (JAX, flax, rljax's trainer: 3-4 s of start-up per worker)."""

import dataclasses
import time

import numpy as np


def digit_share(completions, metadata):
    """Fraction of digits in each completion: varies within groups from step 1."""
    return np.array([sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions])


def width_reward(completions, metadata):
    """Short prompts score 1 (no signal: DAPO drops their groups); long prompts score
    0, 1, 0, 1, ... within their group (rows of a group are contiguous)."""
    return np.array([1.0 if m["answer"] == "short" else float(k % 2)
                     for k, m in enumerate(metadata)])


class WidthTerms:
    """width_reward, with two terms logged as reward/<term>: "width" (the reward) and
    "digits" (digit_share, weight 0): their means are over every process's rows and
    every DAPO round (rljax.train.sources.host.Rollouts.step_metrics)."""

    def __call__(self, completions, metadata):
        w = width_reward(completions, metadata)
        self.last_components = {"width": w, "digits": digit_share(completions, metadata)}
        return w


width_terms = WidthTerms()


@dataclasses.dataclass(frozen=True)
class MetaVerdict:
    """The verdict written in the metadata (``meta["ok"]``), after sleeping
    ``meta["sleep"]`` seconds (a verifier that hangs on one input)."""

    name: str = "meta_verdict"

    def __call__(self, completion, meta) -> bool:
        time.sleep(meta.get("sleep", 0.0))
        return bool(meta["ok"])
