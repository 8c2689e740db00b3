"""Field checks shared by the config dataclasses: each error names the class, the field,
the bad value and what is allowed."""

from __future__ import annotations

import math

from rljax.objectives import IS_LEVELS, IS_MODES
from rljax.train.config.presets import OBJECTIVES


def fail(cls: str, field: str, value, allowed: str):
    raise ValueError(f"{cls}.{field}={value!r} is invalid; allowed: {allowed}")


def check_choice(cls, field, value, choices):
    if value not in choices:
        fail(cls, field, value, "one of " + ", ".join(repr(c) for c in choices))


def check_bool(cls, field, value, *, auto: bool = False):
    """A bool; with ``auto`` also None (the field's "decide for me")."""
    if auto and value is None:
        return
    if not isinstance(value, bool):
        fail(cls, field, value, "None (auto), True or False" if auto else "True or False")


def check_num(cls, field, value, *, lo=None, hi=None, lo_open=False, hi_open=False,
              integer=False, finite=True):
    """A number in [lo, hi] (open ends where asked); NaN never, inf only with finite=False."""
    kind = "an int" if integer else ("a finite number" if finite else "a number")
    if lo is not None and hi is not None:
        allowed = f"{kind} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    elif lo is not None:
        allowed = f"{kind} {'>' if lo_open else '>='} {lo}"
    else:
        allowed = kind
    if not finite and hi is None:
        allowed += " (inf allowed)"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        fail(cls, field, value, allowed)
    bad = math.isnan(value) or (finite and math.isinf(value))
    if bad or (lo is not None and (value <= lo if lo_open else value < lo)):
        fail(cls, field, value, allowed)
    if hi is not None and (value >= hi if hi_open else value > hi):
        fail(cls, field, value, allowed)


def check_micro_batch(cls, micro: int, batch: int) -> None:
    """``micro_batch_size``: 0 (the whole batch) or a divisor of ``batch``."""
    check_num(cls, "micro_batch_size", micro, lo=0, integer=True)
    if 0 < micro < batch and batch % micro:
        fail(cls, "micro_batch_size", micro, f"0 or a divisor of batch_size={batch}")


def check_pass_options(cls, cfg) -> None:
    """The fields RLConfig and SFTConfig share: ``steps``, ``eval_every``, ``remat``,
    ``logp_chunk``, ``max_nonfinite_steps``."""
    check_num(cls, "steps", cfg.steps, lo=0, integer=True)
    check_num(cls, "eval_every", cfg.eval_every, lo=0, integer=True)
    check_bool(cls, "remat", cfg.remat)
    check_num(cls, "logp_chunk", cfg.logp_chunk, lo=1, integer=True)
    check_num(cls, "max_nonfinite_steps", cfg.max_nonfinite_steps, lo=1, integer=True)


def check_import_path(cls, field, value):
    if value is None:
        return
    if not isinstance(value, str) or value.count(":") != 1 or not all(value.split(":")):
        fail(cls, field, value, "None or an import path 'package.module:function'")


def check_algorithm_extras(cfg) -> None:
    """``AlgorithmConfig``'s value, KL-controller, sampler-correction, SAPO, Clip-Cov / KL-Cov
    and ratio-free update-count checks (``__post_init__`` delegates them here)."""
    c = "AlgorithmConfig"
    for names, bounds in ((("entropy_coef", "clip_cov_low", "clip_cov_high"), {}),
                          (("value_coef", "is_low", "kl_cov_coef", "adv_eps"), dict(lo=0.0)),
                          (("gamma", "lam", "distill_discount"), dict(lo=0.0, hi=1.0)),
                          (("sapo_tau_pos", "sapo_tau_neg"), dict(lo=0.0, lo_open=True)),
                          (("clip_cov_ratio", "kl_cov_ratio"), dict(lo=0.0, hi=1.0, lo_open=True))):
        for name in names:
            check_num(c, name, getattr(cfg, name), **bounds)
    check_num(c, "value_clip", cfg.value_clip, lo=0.0, lo_open=True, finite=False)
    if cfg.adaptive_kl_target is not None:
        check_num(c, "adaptive_kl_target", cfg.adaptive_kl_target, lo=0.0, lo_open=True)
        kl_in = cfg.resolved("kl_in")
        if kl_in != "reward":
            fail(c, "adaptive_kl_target", cfg.adaptive_kl_target,
                 f"None unless kl_in='reward' (the controller adapts the reward "
                 f"penalty; kl_in={kl_in!r})")
    check_num(c, "adaptive_kl_horizon", cfg.adaptive_kl_horizon, lo=1, integer=True)
    check_choice(c, "is_level", cfg.is_level, IS_LEVELS)
    check_choice(c, "is_mode", cfg.is_mode, IS_MODES)
    if cfg.is_low >= cfg.tis_cap:
        fail(c, "is_low", cfg.is_low, f"< tis_cap={cfg.tis_cap} (the band [is_low, tis_cap])")
    check_bool(c, "mask_truncated", cfg.mask_truncated)
    if cfg.clip_cov_low >= cfg.clip_cov_high:  # the band is open: (low, high)
        fail(c, "clip_cov_low", cfg.clip_cov_low, f"< clip_cov_high={cfg.clip_cov_high}")
    if cfg.kl_clamp is not None:
        check_num(c, "kl_clamp", cfg.kl_clamp, lo=0.0, lo_open=True, finite=False)
    if cfg.resolved("kl_kind") == "k3_ratio" and cfg.resolved("kl_in") == "reward":
        fail(c, "kl_kind", "k3_ratio", "'k1', 'k2' or 'k3' with kl_in='reward' (the ratio "
             "weights a gradient; a reward penalty has none)")
    # A loss without a ratio (``reinforce`` / ``rloo``'s A log pi) takes one update per batch.
    epochs, minibatches = cfg.resolved("num_epochs"), cfg.resolved("num_minibatches")
    if not cfg.loss.ratio and cfg.objective is None and epochs * minibatches > 1:
        field = "num_epochs" if epochs > 1 else "num_minibatches"
        raise ValueError(
            f"AlgorithmConfig.{field}={cfg.resolved(field)} is invalid for name={cfg.name!r}: "
            f"its loss (A log pi) has no importance ratio, so after the first of "
            f"num_epochs x num_minibatches = {epochs * minibatches} updates per batch the "
            f"samples come from an older policy, uncorrected. Allowed: num_epochs=1 and "
            f"num_minibatches=1; for several updates per batch use PPO's or GRPO's clipped "
            f"ratio: name='grpo' (adv_std='none' for REINFORCE's group-mean baseline, "
            f"advantages='rljax.objectives:rloo_advantages' for RLOO's) or name='ppo'")


#: Objectives without an importance ratio: every update after a batch's first would use
#: samples of an older policy, uncorrected.
NO_RATIO = tuple(n for n, o in OBJECTIVES.items() if not o.ratio)


def corrects_sampler(cfg) -> bool:
    """True when ``cfg`` asks for the sampler-gap importance correction."""
    return math.isfinite(cfg.tis_cap) or cfg.is_low > 0


def check_algorithm_sampling(algorithm, sampling, budget: int | None = None) -> None:
    """Reject ``AlgorithmConfig`` settings that the ``SamplingConfig`` makes wrong.

    The sampler reports each token's log-prob under the distribution it drew from: with
    top-k / top-p that is the filtered, renormalised softmax, while the trainer's log-probs
    are of the full softmax. So

    - ``old_logp="sampler"`` would put the filtered probability in the ratio's denominator:
      at theta = theta_old the ratio equals the kept probability mass (< 1), not 1, and the
      clip acts from the first update;
    - ``tis_cap`` would weight each token by pi / pi_filtered = the kept mass, a shrinking
      of the gradient rather than a correction of the sampler/trainer numerical gap.

    Both are rejected, and so is on-policy distillation (its reverse-KL estimate needs
    samples of the student's full softmax); ``old_logp="auto"`` / ``"recompute"`` (full
    softmax on both sides) work with any filter. Also checks the overlong window against
    the response ``budget``: ``max_new_tokens``, or a multi-turn episode's model tokens
    (``rljax.train.multiturn.MultiTurnConfig.response_budget``).

    Raises:
      ValueError: naming the fields, their values and what is allowed.
    """
    a = algorithm
    if sampling.filters:
        why = (f"with SamplingConfig.top_k={sampling.top_k}, top_p={sampling.top_p} the "
               "sampler's log-probs are of the filtered, renormalised distribution while "
               "the trainer's are of the full softmax")
        if a.old_logp == "sampler":
            raise ValueError(
                f"AlgorithmConfig.old_logp='sampler' is invalid {why}: at theta = theta_old "
                "the ratio would equal the kept probability mass, not 1. Allowed: "
                "old_logp='auto' or 'recompute', or top_k=0 and top_p=1.0")
        if a.needs_teacher:
            raise ValueError(
                f"AlgorithmConfig.name={a.name!r} is invalid {why}: its advantage_estimator="
                "'teacher' estimates the reverse KL to the teacher on samples of the "
                "student's full softmax. Allowed: top_k=0 and top_p=1.0")
        if corrects_sampler(a):
            raise ValueError(
                f"AlgorithmConfig.tis_cap={a.tis_cap}, is_low={a.is_low} is invalid {why}: "
                "every importance "
                "weight would be the kept probability mass, not a correction near 1. "
                "Allowed: tis_cap=inf and is_low=0, or top_k=0 and top_p=1.0")
    a.overlong_tokens(sampling.max_new_tokens if budget is None else budget)


def check_packing(rl, algorithm, device_reward: bool) -> None:
    """Reject ``RLConfig.tokens_per_micro_batch`` (packing the batch) beside what it rules
    out: a device reward (the one-program step cannot size its packed batch), several
    minibatches, a fixed micro-batch size, shared prompts.

    Raises:
      ValueError: naming the setting that conflicts and what is allowed.
    """
    a = algorithm
    why = ("a device reward (the one-program step cannot size its packed batch)"
           if device_reward else
           f"num_minibatches={a.num_minibatches}" if a.num_minibatches > 1 else
           f"micro_batch_size={a.micro_batch_size}" if a.micro_batch_size else
           "share_prompts=True" if rl.share_prompts else "")
    if rl.tokens_per_micro_batch and why:
        raise ValueError(f"RLConfig.tokens_per_micro_batch={rl.tokens_per_micro_batch} "
                         f"packs the batch, which rules out {why}; allowed: a host "
                         "reward, num_minibatches=1, micro_batch_size=0, share_prompts "
                         "None/False (or tokens_per_micro_batch=0)")
