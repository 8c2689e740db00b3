"""The objective contract's inputs: `ObjectiveBatch` (arrays) and `Coef` (traced scalars).

An objective is `objective(batch, coef) -> (loss_sum, count, metrics)` (see docs/design.md).
Both dataclasses are pytrees, so they pass straight through `jax.jit`, `jax.grad` and
sharding. Optional fields hold None when absent; None is an empty pytree, so absence is
static structure and an objective may branch on it in Python.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from rljax.objectives._validate import check_ndim

Array = Any

_REQUIRED = ("logp_BxT", "old_logp_BxT", "mask_BxT", "adv_BxT")
#: The fields that may be None (the trainer fills each only when the run uses it).
OPTIONAL_FIELDS = (
    "ref_logp_BxT",
    "sampler_logp_BxT",
    "values_BxT",
    "old_values_BxT",
    "returns_BxT",
    "entropy_BxT",
    "cov_select_BxT",
    "teacher_logp_BxT",
)
#: Fields an objective may differentiate (the others are data from the rollout).
DIFFERENTIABLE_FIELDS = ("logp_BxT", "values_BxT", "entropy_BxT")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ObjectiveBatch:
    """Per-token arrays of one (micro-)batch, all `[B, T]`, right-padded.

    Fields:
      logp_BxT: log pi_theta of the taken tokens under the current policy. Gradients flow
        through this field (and through `values_BxT` / `entropy_BxT` when the trainer
        computes them inside the differentiated function).
      old_logp_BxT: log pi_old of the taken tokens (the policy the PPO ratio is taken
        against, recomputed by the trainer; no gradient).
      mask_BxT: float32 0/1, 1 on real completion tokens.
      adv_BxT: advantages per token (sequence advantages broadcast over tokens for GRPO).
      ref_logp_BxT: log pi_ref, for a KL term (None when there is no reference).
      sampler_logp_BxT: log-probs the sampler reported, for truncated importance sampling
        when sampler and trainer numerics differ (None when not used).
      values_BxT, old_values_BxT, returns_BxT: value-model predictions now and at rollout
        time, and the value targets (PPO only).
      entropy_BxT: per-token entropy of pi_theta, for an entropy bonus or metric.
      cov_select_BxT: 0/1 tokens chosen by Clip-Cov / KL-Cov (`cov_selection`, computed
        by the trainer over the whole minibatch before the objective; no gradient).
      teacher_logp_BxT: a teacher model's log-probs of the taken tokens, for on-policy
        distillation (`rljax.objectives.distill`; no gradient).
    """

    logp_BxT: Array
    old_logp_BxT: Array
    mask_BxT: Array
    adv_BxT: Array
    ref_logp_BxT: Array | None = None
    sampler_logp_BxT: Array | None = None
    values_BxT: Array | None = None
    old_values_BxT: Array | None = None
    returns_BxT: Array | None = None
    entropy_BxT: Array | None = None
    cov_select_BxT: Array | None = None
    teacher_logp_BxT: Array | None = None

    def validate(self) -> tuple[int, int]:
        """Check every present field is `[B, T]` like `logp_BxT`; return (B, T).

        Runs at trace time (shapes are static), raising ValueError naming the field.
        """
        check_ndim("ObjectiveBatch.logp_BxT", self.logp_BxT, 2, "[B, T]")
        shape = tuple(self.logp_BxT.shape)
        for name in _REQUIRED + OPTIONAL_FIELDS:
            x = getattr(self, name)
            if x is None:
                if name in _REQUIRED:
                    raise ValueError(f"ObjectiveBatch.{name} is required; got None")
                continue
            if tuple(getattr(x, "shape", ())) != shape:
                raise ValueError(
                    f"ObjectiveBatch.{name} has shape {getattr(x, 'shape', None)}; every "
                    f"field must have logp_BxT's shape {shape} [B, T]"
                )
        return shape

    def require(self, *names: str, by: str) -> None:
        """Raise ValueError if any optional field in `names` is None (`by` names the caller)."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{by} needs ObjectiveBatch field(s) {missing}; they are None")


def _as_float32(x: Any) -> Any:
    # Python numbers become float32 numpy scalars so that a schedule that sometimes passes
    # 0.1 and sometimes np.float32(0.1) never recompiles (weak vs strong types differ).
    # Anything else (arrays, tracers, pytree placeholders) passes through untouched.
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return np.float32(x)
    return x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Coef:
    """Numeric coefficients, passed traced so that changing one never recompiles.

    Defaults follow DeepSeekMath's GRPO (arXiv:2402.03300 §4.2: KL coefficient 0.04) with
    PPO's clip epsilon 0.2 (arXiv:1707.06347); the rest are off, or PPO2's for the value.

    Fields:
      kl: weight of the KL-to-reference term (beta).
      clip_low, clip_high: PPO clip range [1 - clip_low, 1 + clip_high] (arXiv:1707.06347
        Eq. 7; clip_high > clip_low is DAPO's clip-higher, arXiv:2503.14476 §3.1).
      dual_clip: c > 1 of dual-clip PPO (Ye et al. 2020, arXiv:1912.09729); inf = off.
      entropy: weight of the entropy bonus.
      value: weight of the value loss (PPO2's vf_coef 0.5).
      value_clip: clip range of the value prediction around old values (PPO2).
      tis_cap: cap of truncated importance-sampling weights, and the upper bound of the
        band of masked IS (`sampler_correction`); inf = uncapped.
      is_low: lower bound of the IS weights (`sampler_correction`): ratios below it are
        masked (is_mode "mask") or raised to it (is_mode "truncate"); 0 = none.
      sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for A > 0 and A < 0
        (arXiv:2511.20347: 1.0 and 1.05).
      kl_cov: weight of KL-Cov's |log r| penalty on the selected tokens (arXiv:2505.22617: 1).
    """

    kl: Any = 0.04
    clip_low: Any = 0.2
    clip_high: Any = 0.2
    dual_clip: Any = math.inf
    entropy: Any = 0.0
    value: Any = 0.5
    value_clip: Any = 0.2
    tis_cap: Any = math.inf
    is_low: Any = 0.0
    sapo_tau_pos: Any = 1.0
    sapo_tau_neg: Any = 1.05
    kl_cov: Any = 1.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _as_float32(getattr(self, f.name)))
        self._check_concrete()

    def _check_concrete(self) -> None:
        # Only concrete numbers can be checked; traced values pass (they were checked
        # when the Coef was built on the host).
        def num(name):
            v = getattr(self, name)
            return float(v) if isinstance(v, (np.floating, np.ndarray)) and np.ndim(v) == 0 else None

        rules = [(n, lambda v: v >= 0, "must be >= 0") for n in (
            "kl", "clip_low", "clip_high", "entropy", "value", "value_clip", "is_low", "kl_cov")]
        rules += [("clip_low", lambda v: v <= 1, "must be in [0, 1] (1 = no lower clip)"),
                  ("sapo_tau_pos", lambda v: v > 0, "must be > 0"),
                  ("sapo_tau_neg", lambda v: v > 0, "must be > 0"),
                  ("dual_clip", lambda v: v > 1, "must be > 1 (inf turns it off)"),
                  ("tis_cap", lambda v: v > 0, "must be > 0 (inf turns it off)")]
        for name, ok, rule in rules:
            v = num(name)
            if v is not None and not ok(v):
                raise ValueError(f"Coef.{name} {rule}; got {v}")
