"""The RL algorithm's configuration: :class:`AlgorithmConfig` (one algorithm as a
configuration of the shared loop) and :func:`algorithm_preset`, public through
``rljax.train.config`` as well."""

from __future__ import annotations

import dataclasses
import math

from rljax.train.config.checks import (check_algorithm_extras, check_bool, check_choice,
                                       check_import_path, check_num, fail)
from rljax.train.config.presets import (ADVANTAGE_ESTIMATORS, BASE, NEEDS_GROUP, OBJECTIVES,
                                        PRESET_FIELDS, PRESETS, Objective)

ALGORITHMS = tuple(PRESETS)
KL_KINDS = ("k1", "k2", "k3", "k3_ratio")
KL_IN = ("loss", "reward", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")
ADV_STDS = ("population", "sample", "none")
OLD_LOGP = ("auto", "recompute", "sampler")
#: The names whose preset baseline is a group's (their group_size must be >= 2).
GROUP_BASELINES = tuple(n for n, p in PRESETS.items()
                        if p.get("advantage_estimator", BASE["advantage_estimator"]) in NEEDS_GROUP)


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """One RL algorithm as a configuration of the shared loop.

    The fields marked *preset* default to ``None``: "what ``name``'s paper uses"
    (``rljax.train.config.presets``). Setting ``name`` (in the constructor, with
    ``dataclasses.replace`` or ``--set algorithm.name=X``) therefore switches every preset
    field that was not set explicitly; explicit values stay on top. ``resolve()`` returns
    the config with every preset field filled in: readers use that one. ``name`` selects
    the preset and the objective (``rljax.train.config.presets``) and nothing else: behaviour
    reads the fields, and the programs a name-free :class:`AlgorithmSpec` (``spec()``).

    Attributes:
      name: which preset and objective: one of ``ALGORITHMS``.
      group_size: (preset) completions sampled per prompt (G); group baselines need G >= 2.
      kl_coef: (preset) KL-to-reference weight (beta); with ``kl_in="reward"`` the initial
        value of the (possibly adaptive) controller.
      kl_kind: (preset) KL estimator "k1" | "k2" | "k3" (Schulman's approximations) |
        "k3_ratio" (k3 weighted by each token's pi / pi_old: DeepSeek-V3.2's unbiased
        gradient of KL(pi || ref), TRL's ``use_bias_correction_kl``; ``kl_in="loss"``
        only). The ``grpo`` preset takes the paper's "k3" (DeepSeekMath Eq. 4); TRL 1.16's
        GRPO default (``use_bias_correction_kl=True``, acting once its beta > 0) is
        "k3_ratio".
      kl_clamp: None (default) or c > 0: clip each token's KL estimate to [-c, c] in the
        loss (verl clamps k3 at 10).
      kl_in: (preset) "loss" (GRPO), "reward" (PPO / InstructGPT per-token penalty, PPO
        only) or "none".
      clip_low, clip_high: (preset) ratio clip range [1 - clip_low, 1 + clip_high]
        (clip_low in [0, 1], 1 = no lower clip; DAPO's clip-higher uses a larger
        ``clip_high``; inf = no upper clip). CISPO clips its IS weight with them; GMPO
        clips in log space, ratios in [e^-clip_low, e^clip_high].
      dual_clip: dual-clip constant c > 1 for negative advantages (``inf`` = off).
      aggregation: (preset) how per-token losses reduce: one of ``AGGREGATIONS``.
      adv_std: (preset) group-advantage normalisation: "population", "sample" or "none".
      adv_eps: added to the group std before dividing (1e-6; TRL uses 1e-4: with
        ``adv_std="sample"`` that is TRL's ``scale_rewards="group"``).
      num_epochs, num_minibatches: (preset) passes over each rollout batch and minibatches
        per pass; both 1 means one update per batch (ratio 1, no extra forward pass).
        ``reinforce`` / ``rloo`` (no importance ratio) take only one.
      micro_batch_size: sequences per accumulation micro-batch (0 = whole minibatch).
      old_logp: "auto" (ratio 1 for single-update batches, else "recompute"),
        "recompute" (a forward pass before the updates) or "sampler" (the sampler's; not
        with top-k / top-p, see :func:`check_algorithm_sampling`).
      tis_cap, is_low, is_level, is_mode: importance correction of the sampler/trainer
        gap (``rljax.objectives.sampler_correction``), on when ``tis_cap`` is finite or
        ``is_low > 0`` (not with top-k / top-p): ``is_level`` "token" | "sequence",
        ``is_mode`` "truncate" (weights clip(rho, is_low, tis_cap), as TRL's truncate
        modes) | "mask" (rho outside [is_low, tis_cap] gets weight 0; IcePop / MIS).
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
        ``(rewards_B, group_size) -> adv_B`` replacing the sequence estimator's function.
      advantage_estimator: (preset) "group_mean" (minus the group's mean, over the std as
        ``adv_std`` says; G >= 2), "group_mean_or_batch" (the same, the batch mean when
        G = 1: REINFORCE), "leave_one_out" (RLOO; G >= 2), "gae" (per token, with a value
        model: ``needs_value_model``; PPO's objective only) or "teacher" (the teacher's
        reverse KL per token: ``needs_teacher``; distill's objective only). A user
        ``objective`` takes any.
    """

    #: The fields whose None means "the preset of name" (not a field: a class attribute,
    #: read by ``rljax.run.overrides`` so that ``--set X=preset`` returns X to it).
    PRESET_FIELDS = PRESET_FIELDS

    name: str = "grpo"
    group_size: int | None = None
    kl_coef: float | None = None
    kl_kind: str | None = None
    kl_clamp: float | None = None
    kl_in: str | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float = math.inf
    aggregation: str | None = None
    adv_std: str | None = None
    adv_eps: float = 1e-6
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
    advantage_estimator: str | None = None

    def __post_init__(self):
        c = "AlgorithmConfig"
        check_choice(c, "name", self.name, ALGORITHMS)
        # Validate what will run: explicit values, and the preset's for the rest.
        v = {f: self.resolved(f) for f in PRESET_FIELDS}
        check_num(c, "group_size", v["group_size"], lo=1, integer=True)
        est = v["advantage_estimator"]
        check_choice(c, "advantage_estimator", est, ADVANTAGE_ESTIMATORS)
        fits = self.loss.estimators
        if self.objective is None and est not in fits:
            fail(c, "advantage_estimator", est, f"one of {', '.join(map(repr, fits))} with "
                 f"name={self.name!r} (the batch its objective reads), any with a user objective")
        if est in NEEDS_GROUP and v["group_size"] < 2:
            fail(c, "group_size", v["group_size"], f">= 2 for {self.name} (group baseline: "
                 f"advantage_estimator={est!r} gives a group of one advantage 0)")
        check_num(c, "kl_coef", v["kl_coef"], lo=0.0)
        check_choice(c, "kl_kind", v["kl_kind"], KL_KINDS)
        check_choice(c, "kl_in", v["kl_in"], KL_IN)
        if v["kl_in"] == "reward" and est != "gae":
            fail(c, "kl_in", v["kl_in"], "'loss' or 'none' unless name='ppo' (the per-token "
                 f"penalty enters GAE's rewards: advantage_estimator='gae'; name={self.name!r}, "
                 f"advantage_estimator={est!r})")
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
        unresolved config. The programs read :meth:`spec`.
        """
        return dataclasses.replace(self, **{f: self.resolved(f) for f in PRESET_FIELDS})

    @property
    def loss(self) -> Objective:
        """The registry's entry of ``name``'s objective (``presets.OBJECTIVES``)."""
        return OBJECTIVES[self.name]

    def spec(self) -> AlgorithmSpec:
        """What the programs read: the resolved fields without ``name``, and ``loss`` (the
        entry the name selects) in its place; equal for equal fields and objective."""
        fields = {k: v for k, v in vars(self.resolve()).items() if k != "name"}
        return AlgorithmSpec(**fields, loss=self.loss)

    @property
    def needs_value_model(self) -> bool:
        """True when the advantages are GAE's: the trainer needs a value model (PPO)."""
        return self.resolved("advantage_estimator") == "gae"

    @property
    def needs_teacher(self) -> bool:
        """True when the advantages are the teacher's reverse KL: the trainer needs a
        teacher (on-policy distillation)."""
        return self.resolved("advantage_estimator") == "teacher"

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


#: ``AlgorithmConfig.spec()``: the resolved fields but ``name``, and ``loss`` (its objective's
#: entry). Frozen, hashable by value: static in the programs (``programs.step.StepSpec.alg``).
AlgorithmSpec = dataclasses.make_dataclass(
    "AlgorithmSpec", [(f.name, f.type) for f in dataclasses.fields(AlgorithmConfig)
                      if f.name != "name"] + [("loss", Objective)], frozen=True,
    namespace=dict(__module__=__name__, resolve=lambda self: self,
                   resolved=lambda self, field: getattr(self, field),
                   needs_value_model=AlgorithmConfig.needs_value_model,
                   needs_teacher=AlgorithmConfig.needs_teacher))


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
