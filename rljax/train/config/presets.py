"""The algorithm registry: what an ``AlgorithmConfig.name`` selects, and nothing else reads
the name. ``PRESETS[name]``: the paper's settings, the values ``AlgorithmConfig.resolve()``
gives the fields left ``None`` (see :class:`rljax.train.config.AlgorithmConfig`);
``OBJECTIVES[name]``: the loss and what it needs of the batch.

``PRESET_FIELDS`` are the fields a preset decides; ``BASE`` holds their values for every
algorithm, and ``PRESETS[name]`` what ``name``'s paper changes on top of ``BASE``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from rljax import objectives as obj

#: ``advantage_estimator``: per completion (those needing group_size >= 2), then per token.
SEQUENCE_ESTIMATORS = ("group_mean", "group_mean_or_batch", "leave_one_out")
NEEDS_GROUP = ("group_mean", "leave_one_out")
ADVANTAGE_ESTIMATORS = SEQUENCE_ESTIMATORS + ("gae", "teacher")

# Shared values: no KL, PPO's symmetric clip 0.2, one update per batch, no DAPO shaping.
BASE: dict = dict(
    group_size=8, kl_coef=0.0, kl_kind="k3", kl_in="none", clip_low=0.2, clip_high=0.2,
    aggregation="seq-mean-token-mean", adv_std="population", num_epochs=1, num_minibatches=1,
    dynamic_sampling=False, overlong_buffer=0, advantage_estimator="group_mean",
)
PRESET_FIELDS: tuple[str, ...] = tuple(BASE)

PRESETS: dict[str, dict] = {
    # DeepSeekMath (Shao et al. 2024) §4.1, Eq. 3: group-normalised advantages, clip 0.2,
    # k3 KL in the loss with beta 0.04 (the paper's Eq. 4, not TRL 1.16's default
    # bias-corrected k3 x pi/pi_old: kl_kind="k3_ratio"), per-sequence mean of per-token
    # losses.
    "grpo": dict(kl_coef=0.04, kl_kind="k3", kl_in="loss", aggregation="seq-mean-token-mean"),
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1): no std
    # normalisation, no per-response length normalisation (a constant instead), no KL.
    "dr_grpo": dict(kl_coef=0.0, kl_in="none", adv_std="none",
                    aggregation="seq-mean-token-sum-norm"),
    # DAPO (Yu et al. 2025): clip-higher 0.2/0.28 (§3.1), dynamic sampling (§3.2),
    # token-level loss (§3.3), overlong reward shaping over the last 20% of the budget
    # (§3.4, Eq. 13: 4096 of 20480 tokens), no KL.
    "dapo": dict(kl_coef=0.0, kl_in="none", clip_low=0.2, clip_high=0.28,
                 aggregation="token-mean", dynamic_sampling=True, overlong_buffer="auto"),
    # GSPO (Zheng et al. 2025) §4.1: sequence-level ratios, clip 3e-4 / 4e-4, no KL.
    "gspo": dict(kl_coef=0.0, kl_in="none", clip_low=3e-4, clip_high=4e-4,
                 aggregation="seq-mean-token-mean"),
    # RLOO (Ahmadian et al. 2024, Eq. 5): leave-one-out baseline, REINFORCE loss.
    "rloo": dict(kl_coef=0.0, kl_in="none", adv_std="none", aggregation="seq-mean-token-sum",
                 advantage_estimator="leave_one_out"),
    # REINFORCE (Williams 1992) with the group-mean baseline (the batch mean with G = 1).
    "reinforce": dict(kl_coef=0.0, kl_in="none", adv_std="none",
                      aggregation="seq-mean-token-sum", advantage_estimator="group_mean_or_batch"),
    # PPO (Schulman et al. 2017; Ouyang et al. 2022): value model + GAE, one completion per
    # prompt, k1 KL penalty per token in the reward (DeepSeekMath Eq. 2), 2 epochs x 2
    # minibatches. Its value settings (gamma 1, lambda 0.95, clipped value loss 0.5 / 0.2)
    # are AlgorithmConfig's plain defaults.
    "ppo": dict(group_size=1, kl_coef=0.05, kl_kind="k1", kl_in="reward",
                aggregation="token-mean", num_epochs=2, num_minibatches=2,
                advantage_estimator="gae"),
    # CISPO (MiniMax-M1, Chen et al. 2025, §3.1): token-level normalisation (Eq. 4), no
    # lower bound on the IS weight (clip_low 1: weights >= 0), no KL. The paper does not
    # publish its eps_high: 4.0 (weights capped at 5) is rljax's choice, inside the range
    # peers use for CISPO's cap.
    "cispo": dict(kl_coef=0.0, kl_in="none", clip_low=1.0, clip_high=4.0,
                  aggregation="token-mean"),
    # SAPO (Gao et al. 2025): the soft gate replaces the clip (temperatures 1.0 / 1.05 are
    # AlgorithmConfig.sapo_tau_pos / sapo_tau_neg); per-sequence token mean; no KL.
    "sapo": dict(kl_coef=0.0, kl_in="none", aggregation="seq-mean-token-mean"),
    # GMPO (Zhao et al. 2025): geometric mean of token ratios, clipped in log space to
    # (e^-0.4, e^0.4), mean over sequences; no KL.
    "gmpo": dict(kl_coef=0.0, kl_in="none", clip_low=0.4, clip_high=0.4,
                 aggregation="seq-mean-token-mean"),
    # Clip-Cov / KL-Cov (Cui et al. 2025): GRPO-style advantages, token-level loss, no KL;
    # their ratios and bands are AlgorithmConfig.clip_cov_* / kl_cov_* (paper values).
    # The authors' scripts (verl recipe/entropy/7b_clip_cov.sh, 7b_kl_cov.sh) take 256
    # prompts per batch in mini-batches of 32: 8 updates per batch. With one, r = 1 and
    # neither rule would restrain anything (docs/objectives.md).
    "clip_cov": dict(kl_coef=0.0, kl_in="none", aggregation="token-mean", num_minibatches=8),
    "kl_cov": dict(kl_coef=0.0, kl_in="none", aggregation="token-mean", num_minibatches=8),
    # On-policy distillation (Agarwal et al. 2024; Lu / Thinking Machines 2025): the
    # teacher's per-token reverse KL is the reward, so no group baseline is needed (one
    # completion per prompt, rljax's choice); a token sum per sequence makes the expected
    # gradient that of the reverse KL (rljax.objectives.distill); no KL to a reference.
    "distill": dict(group_size=1, kl_coef=0.0, kl_in="none", aggregation="seq-mean-token-sum",
                    advantage_estimator="teacher"),
}


class Objective(NamedTuple):
    """The loss ``name`` selects (``rljax.train.learn.algorithms.make_objective``).

    fn: the ``rljax.objectives`` function. ratio: False for A log pi (no importance ratio:
    one update per batch). estimators: the ``advantage_estimator`` values whose batch it
    reads. cov_rule: ``rljax.objectives.cov_selection``'s rule, or None. options: its own
    keyword arguments, as ``(keyword, AlgorithmConfig field)`` pairs.
    """

    fn: Callable
    ratio: bool = True
    estimators: tuple[str, ...] = SEQUENCE_ESTIMATORS
    cov_rule: str | None = None
    options: tuple[tuple[str, str], ...] = ()


_REINFORCE = Objective(obj.reinforce, ratio=False)
OBJECTIVES: dict[str, Objective] = {
    "grpo": Objective(obj.grpo), "dr_grpo": Objective(obj.grpo), "dapo": Objective(obj.grpo),
    "gspo": Objective(obj.gspo), "rloo": _REINFORCE, "reinforce": _REINFORCE,
    "ppo": Objective(obj.ppo, estimators=("gae",)),  # reads the values and GAE's returns
    "cispo": Objective(obj.cispo), "sapo": Objective(obj.sapo), "gmpo": Objective(obj.gmpo),
    "clip_cov": Objective(obj.clip_cov, cov_rule="clip-cov"),
    "kl_cov": Objective(obj.kl_cov, cov_rule="kl-cov"),
    "distill": Objective(obj.distill, estimators=("teacher",),  # the teacher's log-probs
                         options=(("discount", "distill_discount"),)),
}
