"""Frozen, validated configuration dataclasses for SFT and the RL loop.

Every config validates itself in ``__post_init__``; an error names the field, the bad
value and what is allowed. Algorithms are configurations of one loop: use
:func:`algorithm_preset` to get a paper's defaults and override what you need.
"""

from __future__ import annotations

import dataclasses
import math

ALGORITHMS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce", "ppo")
SCHEDULES = ("constant", "cosine", "linear")
KL_KINDS = ("k1", "k2", "k3")
KL_IN = ("loss", "reward", "none")
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
ADV_STDS = ("population", "sample", "none")
OLD_LOGP = ("auto", "recompute", "sampler")


def _fail(cls: str, field: str, value, allowed: str):
    raise ValueError(f"{cls}.{field}={value!r} is invalid; allowed: {allowed}")


def _check_choice(cls, field, value, choices):
    if value not in choices:
        _fail(cls, field, value, "one of " + ", ".join(repr(c) for c in choices))


def _check_num(cls, field, value, *, lo=None, hi=None, lo_open=False, integer=False):
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        _fail(cls, field, value, "an int" if integer else "a number")
    if integer is False and math.isnan(value):
        _fail(cls, field, value, "a number, not NaN")
    if lo is not None and (value <= lo if lo_open else value < lo):
        _fail(cls, field, value, f"a value {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        _fail(cls, field, value, f"a value <= {hi}")


def _check_import_path(cls, field, value):
    if value is None:
        return
    if not isinstance(value, str) or value.count(":") != 1 or not all(value.split(":")):
        _fail(cls, field, value, "None or an import path 'package.module:function'")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, a decay schedule and global-norm clipping.

    Attributes:
      lr: peak learning rate.
      warmup_steps: linear warm-up from 0 to ``lr`` over this many updates (0 = none).
        GRPO on a freshly initialised Adam state needs it: a constant 3e-4 collapsed the
        arithmetic demo's accuracy to 0 within 20 steps.
      schedule: after warm-up, "constant", "cosine" or "linear" decay to
        ``lr * min_lr_ratio`` at the last update.
      min_lr_ratio: final learning rate as a fraction of ``lr``.
      weight_decay: decoupled weight decay (AdamW, Loshchilov & Hutter 2019).
      b1, b2, eps: Adam moments and epsilon.
      clip_norm: clip the global gradient norm to this value (0 = no clipping).
    """

    lr: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0

    def __post_init__(self):
        c = "OptimConfig"
        _check_num(c, "lr", self.lr, lo=0.0, lo_open=True)
        _check_num(c, "warmup_steps", self.warmup_steps, lo=0, integer=True)
        _check_choice(c, "schedule", self.schedule, SCHEDULES)
        _check_num(c, "min_lr_ratio", self.min_lr_ratio, lo=0.0, hi=1.0)
        _check_num(c, "weight_decay", self.weight_decay, lo=0.0)
        _check_num(c, "b1", self.b1, lo=0.0, hi=1.0)
        _check_num(c, "b2", self.b2, lo=0.0, hi=1.0)
        _check_num(c, "eps", self.eps, lo=0.0, lo_open=True)
        _check_num(c, "clip_norm", self.clip_norm, lo=0.0)


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """One RL algorithm as a configuration of the shared loop (see :func:`algorithm_preset`).

    Attributes:
      name: which loss and advantage estimator: one of ``ALGORITHMS``.
      group_size: completions sampled per prompt (G); group baselines need G >= 2.
      kl_coef: KL-to-reference weight (beta); with ``kl_in="reward"`` the initial value of
        the (possibly adaptive) controller.
      kl_kind: KL estimator "k1" | "k2" | "k3" (Schulman's approximations).
      kl_in: "loss" (GRPO), "reward" (PPO / InstructGPT per-token penalty) or "none".
      clip_low, clip_high: ratio clip range [1 - clip_low, 1 + clip_high] (DAPO's
        clip-higher uses a larger ``clip_high``).
      dual_clip: dual-clip constant c > 1 for negative advantages (``inf`` = off).
      aggregation: how per-token losses reduce: one of ``AGGREGATIONS``.
      adv_std: group-advantage normalisation: "population", "sample" or "none".
      num_epochs, num_minibatches: passes over each rollout batch and minibatches per pass;
        both 1 means one update per batch (ratio 1, no extra forward pass).
      micro_batch_size: sequences per accumulation micro-batch (0 = whole minibatch).
      old_logp: "auto" (ratio 1 for single-update batches, else "recompute"),
        "recompute" (a forward pass before the updates) or "sampler" (the sampler's).
      tis_cap: truncated importance-sampling cap for the sampler/trainer gap (inf = off).
      entropy_coef: entropy bonus weight.
      value_coef, value_clip: PPO value-loss weight and clip range.
      gamma, lam: GAE discount and lambda (PPO).
      adaptive_kl_target, adaptive_kl_horizon: adaptive KL controller (Ziegler et al.
        2019, §2.2); target None = fixed coefficient.
      whiten_advantages: PPO: whiten GAE advantages over the batch's real tokens.
      dynamic_sampling: DAPO: drop zero-variance groups and sample more prompts to refill.
      max_refill_rounds: extra sampling rounds allowed to refill a dynamic-sampling batch.
      overlong_buffer: DAPO overlong shaping window in tokens (0 = off; None = 20% of
        ``max_new_tokens``, the paper's 4096 of 20480).
      overlong_penalty: penalty at the maximum length (DAPO Eq. 13).
      objective: optional import path "pkg.mod:fn" of a user objective with the contract
        ``(ObjectiveBatch, Coef) -> (loss_sum, count, metrics)`` replacing the library one.
      advantages: optional import path "pkg.mod:fn" of an advantage estimator
        ``(rewards_B, group_size) -> adv_B`` replacing the default.
    """

    name: str = "grpo"
    group_size: int = 8
    kl_coef: float = 0.04
    kl_kind: str = "k3"
    kl_in: str = "loss"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = math.inf
    aggregation: str = "seq-mean-token-mean"
    adv_std: str = "population"
    num_epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int = 0
    old_logp: str = "auto"
    tis_cap: float = math.inf
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    adaptive_kl_target: float | None = None
    adaptive_kl_horizon: int = 10000
    whiten_advantages: bool = True
    dynamic_sampling: bool = False
    max_refill_rounds: int = 4
    overlong_buffer: int | None = 0
    overlong_penalty: float = 1.0
    objective: str | None = None
    advantages: str | None = None

    def __post_init__(self):
        c = "AlgorithmConfig"
        _check_choice(c, "name", self.name, ALGORITHMS)
        _check_num(c, "group_size", self.group_size, lo=1, integer=True)
        if self.name in ("grpo", "dr_grpo", "dapo", "gspo", "rloo") and self.group_size < 2:
            _fail(c, "group_size", self.group_size, f">= 2 for {self.name} (group baseline)")
        _check_num(c, "kl_coef", self.kl_coef, lo=0.0)
        _check_choice(c, "kl_kind", self.kl_kind, KL_KINDS)
        _check_choice(c, "kl_in", self.kl_in, KL_IN)
        if self.kl_in == "reward" and self.name != "ppo":
            _fail(c, "kl_in", self.kl_in, "'loss' or 'none' unless name='ppo'")
        _check_num(c, "clip_low", self.clip_low, lo=0.0, hi=1.0)
        _check_num(c, "clip_high", self.clip_high, lo=0.0)
        _check_num(c, "dual_clip", self.dual_clip, lo=1.0, lo_open=True)
        _check_choice(c, "aggregation", self.aggregation, AGGREGATIONS)
        _check_choice(c, "adv_std", self.adv_std, ADV_STDS)
        _check_num(c, "num_epochs", self.num_epochs, lo=1, integer=True)
        _check_num(c, "num_minibatches", self.num_minibatches, lo=1, integer=True)
        _check_num(c, "micro_batch_size", self.micro_batch_size, lo=0, integer=True)
        _check_choice(c, "old_logp", self.old_logp, OLD_LOGP)
        _check_num(c, "tis_cap", self.tis_cap, lo=0.0, lo_open=True)
        _check_num(c, "entropy_coef", self.entropy_coef)
        _check_num(c, "value_coef", self.value_coef, lo=0.0)
        _check_num(c, "value_clip", self.value_clip, lo=0.0, lo_open=True)
        _check_num(c, "gamma", self.gamma, lo=0.0, hi=1.0)
        _check_num(c, "lam", self.lam, lo=0.0, hi=1.0)
        if self.adaptive_kl_target is not None:
            _check_num(c, "adaptive_kl_target", self.adaptive_kl_target, lo=0.0, lo_open=True)
        _check_num(c, "adaptive_kl_horizon", self.adaptive_kl_horizon, lo=1, integer=True)
        if not isinstance(self.whiten_advantages, bool):
            _fail(c, "whiten_advantages", self.whiten_advantages, "True or False")
        if not isinstance(self.dynamic_sampling, bool):
            _fail(c, "dynamic_sampling", self.dynamic_sampling, "True or False")
        _check_num(c, "max_refill_rounds", self.max_refill_rounds, lo=0, integer=True)
        if self.overlong_buffer is not None:
            _check_num(c, "overlong_buffer", self.overlong_buffer, lo=0, integer=True)
        _check_num(c, "overlong_penalty", self.overlong_penalty, lo=0.0)
        _check_import_path(c, "objective", self.objective)
        _check_import_path(c, "advantages", self.advantages)

    @property
    def single_update(self) -> bool:
        """True when each rollout batch gets exactly one optimiser update."""
        return self.num_epochs == 1 and self.num_minibatches == 1


# Each paper's defaults. Values not listed keep the AlgorithmConfig defaults.
_PRESETS: dict[str, dict] = {
    # DeepSeekMath (Shao et al. 2024) §4.1, Eq. 3: group-normalised advantages, clip 0.2,
    # k3 KL in the loss with beta 0.04, per-sequence mean of per-token losses.
    "grpo": dict(kl_coef=0.04, kl_kind="k3", kl_in="loss", aggregation="seq-mean-token-mean"),
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1): no std
    # normalisation, no per-response length normalisation (a constant instead), no KL.
    "dr_grpo": dict(
        kl_coef=0.0, kl_in="none", adv_std="none", aggregation="seq-mean-token-sum-norm"
    ),
    # DAPO (Yu et al. 2025): clip-higher 0.2/0.28 (§3.1), dynamic sampling (§3.2),
    # token-level loss (§3.3), overlong reward shaping (§3.4, Eq. 13), no KL.
    "dapo": dict(
        kl_coef=0.0, kl_in="none", clip_low=0.2, clip_high=0.28, aggregation="token-mean",
        dynamic_sampling=True, overlong_buffer=None, overlong_penalty=1.0,
    ),
    # GSPO (Zheng et al. 2025) §4.1: sequence-level ratios, clip 3e-4 / 4e-4, no KL.
    "gspo": dict(
        kl_coef=0.0, kl_in="none", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean"
    ),
    # RLOO (Ahmadian et al. 2024, Eq. 5): leave-one-out baseline, REINFORCE loss.
    "rloo": dict(kl_coef=0.0, kl_in="none", adv_std="none", aggregation="seq-mean-token-sum"),
    # REINFORCE (Williams 1992) with the group-mean baseline.
    "reinforce": dict(
        kl_coef=0.0, kl_in="none", adv_std="none", aggregation="seq-mean-token-sum"
    ),
    # PPO (Schulman et al. 2017; Ouyang et al. 2022): value model + GAE, clip 0.2, k1 KL
    # penalty per token in the reward (DeepSeekMath Eq. 2), clipped value loss.
    "ppo": dict(
        group_size=1, kl_coef=0.05, kl_kind="k1", kl_in="reward", aggregation="token-mean",
        gamma=1.0, lam=0.95, value_coef=0.5, value_clip=0.2, num_epochs=2, num_minibatches=2,
    ),
}


def algorithm_preset(name: str, **overrides) -> AlgorithmConfig:
    """Return ``AlgorithmConfig`` with the defaults of ``name``'s paper, then ``overrides``.

    Raises:
      ValueError: ``name`` is not one of ``ALGORITHMS`` or an override key is unknown.
    """
    if name not in _PRESETS:
        _fail("algorithm_preset", "name", name, "one of " + ", ".join(ALGORITHMS))
    valid = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"algorithm_preset: unknown option(s) {unknown}; valid: {sorted(valid)}"
        )
    return AlgorithmConfig(**{"name": name, **_PRESETS[name], **overrides})


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Rollout sampling settings (passed to ``rljax.sampling.generate``).

    Attributes:
      max_new_tokens: completion length cap (tokens).
      temperature: softmax temperature (> 0 in RL; the trainer's log-probs use the same).
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus threshold in (0, 1] (1 = off).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        c = "SamplingConfig"
        _check_num(c, "max_new_tokens", self.max_new_tokens, lo=1, integer=True)
        _check_num(c, "temperature", self.temperature, lo=0.0, lo_open=True)
        _check_num(c, "top_k", self.top_k, lo=0, integer=True)
        _check_num(c, "top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL loop's schedule and memory options.

    Attributes:
      steps: RL steps (each: sample, score, update).
      prompts_per_step: prompts per step; the batch holds ``prompts_per_step * group_size``
        completions.
      eval_every: evaluate every N steps (0 = only before and after).
      eval_prompts: held-out prompts per evaluation.
      remat: rematerialise each decoder layer in the backward pass.
      logp_chunk: sequence positions per log-prob chunk; each chunk's ``[B, chunk, V]``
        logits are recomputed in the backward pass, never the whole ``[B, T, V]``.
      max_nonfinite_steps: stop with an error after this many consecutive updates skipped
        for a non-finite loss or gradient.
      peak_flops: device peak FLOP/s for the MFU estimate (0 = report model FLOP/s only).
      value_lr_ratio: PPO: value-model learning rate as a multiple of the policy's.
    """

    steps: int = 100
    prompts_per_step: int = 8
    eval_every: int = 0
    eval_prompts: int = 256
    remat: bool = False
    logp_chunk: int = 256
    max_nonfinite_steps: int = 5
    peak_flops: float = 0.0
    value_lr_ratio: float = 1.0

    def __post_init__(self):
        c = "RLConfig"
        _check_num(c, "steps", self.steps, lo=0, integer=True)
        _check_num(c, "prompts_per_step", self.prompts_per_step, lo=1, integer=True)
        _check_num(c, "eval_every", self.eval_every, lo=0, integer=True)
        _check_num(c, "eval_prompts", self.eval_prompts, lo=1, integer=True)
        if not isinstance(self.remat, bool):
            _fail(c, "remat", self.remat, "True or False")
        _check_num(c, "logp_chunk", self.logp_chunk, lo=1, integer=True)
        _check_num(c, "max_nonfinite_steps", self.max_nonfinite_steps, lo=1, integer=True)
        _check_num(c, "peak_flops", self.peak_flops, lo=0.0)
        _check_num(c, "value_lr_ratio", self.value_lr_ratio, lo=0.0, lo_open=True)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning on (prompt, completion) pairs; loss on completion tokens.

    Attributes:
      steps: optimiser updates.
      batch_size: pairs per update.
      micro_batch_size: pairs per accumulation micro-batch (0 = whole batch).
      optim: the SFT optimiser (its own schedule; the RL optimiser starts fresh).
      remat, logp_chunk, max_nonfinite_steps: as in :class:`RLConfig`.
      eval_every: held-out loss every N steps (0 = only at the end).
      stop_loss: stop the warm-up early once the mean training loss of the last 20 steps
        is below this (0 = run all `steps`); a loss target gives every seed a similar
        starting ability where a fixed step count does not.
      stop_accuracy: stop the warm-up at the first check (every `stop_every` steps) where
        greedy accuracy on `stop_prompts` validation prompts reaches this (0 = off; in
        [0, 1]). The validation prompts are disjoint from the held-out prompts that
        measure accuracy before and after RL (a procedural task may also draw them for
        training). It sets the starting ability directly: the loss at which a model
        reaches a given accuracy moves with the machine's rounding.
      stop_every, stop_prompts: how often the accuracy is checked, on how many prompts.
    """

    steps: int = 100
    batch_size: int = 32
    micro_batch_size: int = 0
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=10, schedule="cosine",
                                            min_lr_ratio=0.1)
    )
    remat: bool = False
    logp_chunk: int = 256
    max_nonfinite_steps: int = 5
    eval_every: int = 0
    stop_loss: float = 0.0
    stop_accuracy: float = 0.0
    stop_every: int = 10
    stop_prompts: int = 256

    def __post_init__(self):
        c = "SFTConfig"
        _check_num(c, "stop_loss", self.stop_loss, lo=0)
        _check_num(c, "stop_accuracy", self.stop_accuracy, lo=0, hi=1)
        _check_num(c, "stop_every", self.stop_every, lo=1, integer=True)
        _check_num(c, "stop_prompts", self.stop_prompts, lo=1, integer=True)
        _check_num(c, "steps", self.steps, lo=0, integer=True)
        _check_num(c, "batch_size", self.batch_size, lo=1, integer=True)
        _check_num(c, "micro_batch_size", self.micro_batch_size, lo=0, integer=True)
        if not isinstance(self.optim, OptimConfig):
            _fail(c, "optim", self.optim, "an OptimConfig")
        if not isinstance(self.remat, bool):
            _fail(c, "remat", self.remat, "True or False")
        _check_num(c, "logp_chunk", self.logp_chunk, lo=1, integer=True)
        _check_num(c, "max_nonfinite_steps", self.max_nonfinite_steps, lo=1, integer=True)
        _check_num(c, "eval_every", self.eval_every, lo=0, integer=True)
