"""Frozen, validated configuration dataclasses for SFT and the RL loop.

Every config validates itself in ``__post_init__``; an error names the field, the bad
value and what is allowed. Algorithms are configurations of one loop: the fields a
paper decides default to ``None`` ("the preset of ``name``", see
``rljax.train.presets``), so ``AlgorithmConfig(name="dapo")``,
``dataclasses.replace(cfg, name="gspo")`` and ``--set algorithm.name=gspo`` all give
that paper's settings with the fields set explicitly on top; ``AlgorithmConfig.resolve()``
fills them in. Checks that need two configs are in :func:`check_algorithm_sampling`.
"""

from __future__ import annotations

import dataclasses
import math

from rljax.train.checks import check_algorithm_sampling  # noqa: F401 (public here too)
from rljax.train.checks import (check_algorithm_extras, check_bool, check_choice, check_import_path,
                                check_micro_batch, check_num, check_pass_options, fail)
from rljax.train.presets import BASE, PRESET_FIELDS, PRESETS

ALGORITHMS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce", "ppo", "cispo", "sapo",
              "gmpo", "clip_cov", "kl_cov", "distill")
SCHEDULES = ("constant", "cosine", "linear")
KL_KINDS = ("k1", "k2", "k3")
KL_IN = ("loss", "reward", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")
ADV_STDS = ("population", "sample", "none")
OLD_LOGP = ("auto", "recompute", "sampler")
REF_DTYPES = ("float32", "bfloat16")
GROUP_BASELINES = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "cispo", "sapo", "gmpo",
                   "clip_cov", "kl_cov")


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
      b1, b2, eps: Adam moments (in [0, 1): 1 makes the bias correction divide by 0) and
        epsilon.
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
        check_num(c, "lr", self.lr, lo=0.0, lo_open=True)
        check_num(c, "warmup_steps", self.warmup_steps, lo=0, integer=True)
        check_choice(c, "schedule", self.schedule, SCHEDULES)
        check_num(c, "min_lr_ratio", self.min_lr_ratio, lo=0.0, hi=1.0)
        check_num(c, "weight_decay", self.weight_decay, lo=0.0)
        check_num(c, "b1", self.b1, lo=0.0, hi=1.0, hi_open=True)
        check_num(c, "b2", self.b2, lo=0.0, hi=1.0, hi_open=True)
        check_num(c, "eps", self.eps, lo=0.0, lo_open=True)
        check_num(c, "clip_norm", self.clip_norm, lo=0.0, finite=False)


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """One RL algorithm as a configuration of the shared loop.

    The fields marked *preset* default to ``None``: "what ``name``'s paper uses"
    (``rljax.train.presets``). Setting ``name`` (in the constructor, with
    ``dataclasses.replace`` or ``--set algorithm.name=X``) therefore switches every preset
    field that was not set explicitly; explicit values stay on top. ``resolve()`` returns
    the config with every preset field filled in: readers use that one.

    Attributes:
      name: which loss and advantage estimator: one of ``ALGORITHMS``.
      group_size: (preset) completions sampled per prompt (G); group baselines need G >= 2.
      kl_coef: (preset) KL-to-reference weight (beta); with ``kl_in="reward"`` the initial
        value of the (possibly adaptive) controller.
      kl_kind: (preset) KL estimator "k1" | "k2" | "k3" (Schulman's approximations).
      kl_in: (preset) "loss" (GRPO), "reward" (PPO / InstructGPT per-token penalty, PPO
        only) or "none".
      clip_low, clip_high: (preset) ratio clip range [1 - clip_low, 1 + clip_high]
        (clip_low in [0, 1], 1 = no lower clip; DAPO's clip-higher uses a larger
        ``clip_high``; inf = no upper clip). CISPO clips its IS weight with them; GMPO
        clips in log space, ratios in [e^-clip_low, e^clip_high].
      dual_clip: dual-clip constant c > 1 for negative advantages (``inf`` = off).
      aggregation: (preset) how per-token losses reduce: one of ``AGGREGATIONS``.
      adv_std: (preset) group-advantage normalisation: "population", "sample" or "none".
      num_epochs, num_minibatches: (preset) passes over each rollout batch and minibatches
        per pass; both 1 means one update per batch (ratio 1, no extra forward pass).
      micro_batch_size: sequences per accumulation micro-batch (0 = whole minibatch).
      old_logp: "auto" (ratio 1 for single-update batches, else "recompute"),
        "recompute" (a forward pass before the updates) or "sampler" (the sampler's; not
        with top-k / top-p, see :func:`check_algorithm_sampling`).
      tis_cap, is_low, is_level, is_mode: importance correction of the sampler/trainer
        gap (``rljax.objectives.sampler_correction``), on when ``tis_cap`` is finite or
        ``is_low > 0`` (not with top-k / top-p): ``is_level`` "token" | "sequence",
        ``is_mode`` "truncate" (weights min(rho, tis_cap)) | "mask" (rho outside
        [is_low, tis_cap] gets weight 0; IcePop / MIS).
      mask_truncated: completions cut at ``max_new_tokens`` contribute no loss (DAPO §3.4).
      sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures (name="sapo").
      clip_cov_ratio, clip_cov_low, clip_cov_high: Clip-Cov's fraction of tokens and
        covariance band (name="clip_cov"); kl_cov_ratio, kl_cov_coef: KL-Cov's fraction
        and penalty weight (name="kl_cov"); see ``rljax.objectives.cov_selection``.
      distill_discount: name="distill" (the trainer needs a teacher): gamma of the
        reverse-KL reward-to-go, 0 per-token (Thinking Machines 2025) ... 1 whole sequence.
      entropy_coef: entropy bonus weight (negative = entropy penalty).
      value_coef, value_clip: PPO value-loss weight and clip range (inf = no clip).
      gamma, lam: GAE discount and lambda (PPO).
      adaptive_kl_target, adaptive_kl_horizon: adaptive KL controller (Ziegler et al.
        2019, §2.2) for ``kl_in="reward"``; target None = fixed coefficient.
      whiten_advantages: PPO: whiten GAE advantages over the batch's real tokens.
      dynamic_sampling: (preset) DAPO: drop zero-variance groups and sample more prompts
        to refill (needs group_size >= 2).
      max_refill_rounds: extra sampling rounds allowed to refill a dynamic-sampling batch.
      overlong_buffer: (preset) DAPO overlong shaping window in tokens (0 = off; "auto" =
        20% of ``max_new_tokens``, the paper's 4096 of 20480).
      overlong_penalty: penalty at the maximum length (DAPO Eq. 13).
      objective: optional import path "pkg.mod:fn" of a user objective with the contract
        ``(ObjectiveBatch, Coef) -> (loss_sum, count, metrics)`` replacing the library one.
      advantages: optional import path "pkg.mod:fn" of an advantage estimator
        ``(rewards_B, group_size) -> adv_B`` replacing the default.
    """

    name: str = "grpo"
    group_size: int | None = None
    kl_coef: float | None = None
    kl_kind: str | None = None
    kl_in: str | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float = math.inf
    aggregation: str | None = None
    adv_std: str | None = None
    num_epochs: int | None = None
    num_minibatches: int | None = None
    micro_batch_size: int = 0
    old_logp: str = "auto"
    tis_cap: float = math.inf
    is_low: float = 0.0
    is_level: str = "token"
    is_mode: str = "truncate"
    mask_truncated: bool = False
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    clip_cov_ratio: float = 2e-4
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    distill_discount: float = 0.0
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    adaptive_kl_target: float | None = None
    adaptive_kl_horizon: int = 10000
    whiten_advantages: bool = True
    dynamic_sampling: bool | None = None
    max_refill_rounds: int = 4
    overlong_buffer: int | str | None = None
    overlong_penalty: float = 1.0
    objective: str | None = None
    advantages: str | None = None

    def __post_init__(self):
        c = "AlgorithmConfig"
        check_choice(c, "name", self.name, ALGORITHMS)
        # Validate what will run: explicit values, and the preset's for the rest.
        v = {f: self.resolved(f) for f in PRESET_FIELDS}
        check_num(c, "group_size", v["group_size"], lo=1, integer=True)
        if self.name in GROUP_BASELINES and v["group_size"] < 2:
            fail(c, "group_size", v["group_size"], f">= 2 for {self.name} (group baseline)")
        check_num(c, "kl_coef", v["kl_coef"], lo=0.0)
        check_choice(c, "kl_kind", v["kl_kind"], KL_KINDS)
        check_choice(c, "kl_in", v["kl_in"], KL_IN)
        if v["kl_in"] == "reward" and self.name != "ppo":
            fail(c, "kl_in", v["kl_in"], f"'loss' or 'none' unless name='ppo' (name={self.name!r})")
        check_num(c, "clip_low", v["clip_low"], lo=0.0, hi=1.0)
        check_num(c, "clip_high", v["clip_high"], lo=0.0, finite=False)
        check_num(c, "dual_clip", self.dual_clip, lo=1.0, lo_open=True, finite=False)
        check_choice(c, "aggregation", v["aggregation"], AGGREGATIONS)
        check_choice(c, "adv_std", v["adv_std"], ADV_STDS)
        check_num(c, "num_epochs", v["num_epochs"], lo=1, integer=True)
        check_num(c, "num_minibatches", v["num_minibatches"], lo=1, integer=True)
        check_num(c, "micro_batch_size", self.micro_batch_size, lo=0, integer=True)
        check_choice(c, "old_logp", self.old_logp, OLD_LOGP)
        check_num(c, "tis_cap", self.tis_cap, lo=0.0, lo_open=True, finite=False)
        check_algorithm_extras(self)
        check_bool(c, "whiten_advantages", self.whiten_advantages)
        check_bool(c, "dynamic_sampling", v["dynamic_sampling"])
        if v["dynamic_sampling"] and v["group_size"] < 2:
            fail(c, "dynamic_sampling", True, "False when group_size < 2 (every group of "
                  "one completion has zero reward variance and would be dropped)")
        check_num(c, "max_refill_rounds", self.max_refill_rounds, lo=0, integer=True)
        if v["overlong_buffer"] != "auto":
            if isinstance(v["overlong_buffer"], str):
                fail(c, "overlong_buffer", v["overlong_buffer"], "an int >= 0 or 'auto'")
            check_num(c, "overlong_buffer", v["overlong_buffer"], lo=0, integer=True)
        check_num(c, "overlong_penalty", self.overlong_penalty, lo=0.0)
        check_import_path(c, "objective", self.objective)
        check_import_path(c, "advantages", self.advantages)

    def explicit_presets(self) -> dict:
        """The preset fields set explicitly (not None), by name."""
        return {f: getattr(self, f) for f in PRESET_FIELDS if getattr(self, f) is not None}

    def resolved(self, field: str):
        """One field's value: the explicit one, else the preset of ``name``."""
        value = getattr(self, field)
        if value is not None or field not in PRESET_FIELDS:
            return value
        return PRESETS[self.name].get(field, BASE[field])

    def resolve(self) -> AlgorithmConfig:
        """This config with every preset field filled in (explicit values kept).

        The result pins the preset's values: ``dataclasses.replace(cfg.resolve(),
        name=...)`` keeps them as if they were explicit, so switch ``name`` on the
        unresolved config.
        """
        return dataclasses.replace(self, **{f: self.resolved(f) for f in PRESET_FIELDS})

    @property
    def single_update(self) -> bool:
        """True when each rollout batch gets exactly one optimiser update."""
        return self.resolved("num_epochs") == 1 and self.resolved("num_minibatches") == 1

    def overlong_tokens(self, max_new_tokens: int) -> int:
        """The DAPO overlong window in tokens ("auto" = 20% of ``max_new_tokens``)."""
        buf = self.resolved("overlong_buffer")
        buf = max_new_tokens // 5 if buf == "auto" else buf
        if buf and buf >= max_new_tokens:
            raise ValueError(f"AlgorithmConfig.overlong_buffer={buf} must be < "
                             f"SamplingConfig.max_new_tokens={max_new_tokens}")
        return buf


def algorithm_preset(name: str, **overrides) -> AlgorithmConfig:
    """``AlgorithmConfig`` for ``name``'s paper with ``overrides`` set explicitly.

    Same as ``AlgorithmConfig(name=name, **overrides)``: the preset fields not overridden
    stay ``None`` and follow ``name`` (see ``AlgorithmConfig.resolve``).

    Raises:
      ValueError: ``name`` is not one of ``ALGORITHMS`` or an override key is unknown.
    """
    if name not in PRESETS:
        fail("algorithm_preset", "name", name, "one of " + ", ".join(ALGORITHMS))
    valid = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"algorithm_preset: unknown option(s) {unknown}; valid: {sorted(valid)}"
        )
    return AlgorithmConfig(name=name, **overrides)


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
        check_num(c, "max_new_tokens", self.max_new_tokens, lo=1, integer=True)
        check_num(c, "temperature", self.temperature, lo=0.0, lo_open=True)
        check_num(c, "top_k", self.top_k, lo=0, integer=True)
        check_num(c, "top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)

    @property
    def filters(self) -> bool:
        """True when top-k or top-p removes tokens from the draw."""
        return self.top_k > 0 or self.top_p < 1.0


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
      peak_flops: one chip's peak FLOP/s for the MFU estimate (0 = the chip's dense bf16
        peak from ``rljax.train.throughput.PEAK_BF16_FLOPS``; no MFU on CPU or an
        unknown chip, only model FLOP/s).
      value_lr_ratio: PPO: value-model learning rate as a multiple of the policy's.
      ref_dtype: storage dtype of the frozen KL reference, "float32" or "bfloat16" (half
        the memory; its forward runs in the model's compute_dtype and its log-probs stay
        float32; policy and optimiser stay float32). See ``rljax.train.reference``.
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
    ref_dtype: str = "float32"

    def __post_init__(self):
        c = "RLConfig"
        check_num(c, "steps", self.steps, lo=0, integer=True)
        check_num(c, "prompts_per_step", self.prompts_per_step, lo=1, integer=True)
        check_num(c, "eval_every", self.eval_every, lo=0, integer=True)
        check_num(c, "eval_prompts", self.eval_prompts, lo=1, integer=True)
        check_pass_options(c, self)
        check_num(c, "peak_flops", self.peak_flops, lo=0.0)
        check_num(c, "value_lr_ratio", self.value_lr_ratio, lo=0.0, lo_open=True)
        check_choice(c, "ref_dtype", self.ref_dtype, REF_DTYPES)

    def eval_due(self, step: int) -> bool:
        """Whether the held-out evaluation runs after RL step ``step`` (1-based): every
        ``eval_every`` steps, except the last, which the run's final evaluation covers."""
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.steps


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
        check_num(c, "stop_loss", self.stop_loss, lo=0)
        check_num(c, "stop_accuracy", self.stop_accuracy, lo=0, hi=1)
        check_num(c, "stop_every", self.stop_every, lo=1, integer=True)
        check_num(c, "stop_prompts", self.stop_prompts, lo=1, integer=True)
        check_num(c, "steps", self.steps, lo=0, integer=True)
        check_num(c, "batch_size", self.batch_size, lo=1, integer=True)
        check_micro_batch(c, self.micro_batch_size, self.batch_size)
        if not isinstance(self.optim, OptimConfig):
            fail(c, "optim", self.optim, "an OptimConfig")
        check_pass_options(c, self)
        check_num(c, "eval_every", self.eval_every, lo=0, integer=True)
