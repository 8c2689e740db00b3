"""Algorithm configs -> the pure pieces the loop plugs in: objective, coefficients,
advantage estimator and reward shaping. Each takes an ``AlgorithmConfig`` resolved or not
(preset fields left ``None`` take ``name``'s paper values, see ``AlgorithmConfig.resolve``)
or the programs' name-free ``AlgorithmConfig.spec()``; ``cfg.loss`` is the objective's entry.

| name      | objective (rljax.objectives) | advantages                            | KL            |
|-----------|------------------------------|---------------------------------------|---------------|
| reinforce | reinforce                    | r - group mean (batch mean if G = 1)  | none          |
| rloo      | reinforce                    | rloo_advantages (Ahmadian et al. 2024) | none         |
| grpo      | grpo, seq-mean-token-mean    | group_advantages (DeepSeekMath §4.1.2) | k3 in loss    |
| dr_grpo   | grpo, seq-mean-token-sum-norm| group mean only (std "none")           | none          |
| dapo      | grpo, token-mean, clip-higher| group_advantages + dynamic sampling    | none          |
| gspo      | gspo (sequence ratio)        | group_advantages                       | none          |
| ppo       | ppo (+ clipped value loss)   | GAE on KL-penalised token rewards      | k1 in reward  |
| cispo     | cispo (clipped IS weight)    | group_advantages                       | none          |
| sapo      | sapo (soft gate)             | group_advantages                       | none          |
| gmpo      | gmpo (geometric mean ratio)  | group_advantages                       | none          |
| clip_cov  | clip_cov (+ Clip-Cov tokens) | group_advantages                       | none          |
| kl_cov    | kl_cov (+ KL-Cov tokens)     | group_advantages                       | none          |
| distill   | distill (clipped ratio)      | teacher's reverse KL per token (k1)    | none          |

The name selects the objective (``rljax.train.config.presets.OBJECTIVES``, read as ``cfg.loss``);
the advantages column is the preset's ``advantage_estimator``, read by the code instead.

Every objective takes the sampler-gap correction (``is_level`` / ``is_mode`` /
``is_low`` / ``tis_cap``); ``mask_truncated`` and the Clip-Cov / KL-Cov selection are
applied by the learning program (``rljax.train.learn``).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rljax import objectives as obj
from rljax.train.config import AlgorithmConfig
from rljax.train.config.checks import corrects_sampler
from rljax.train.learn.micro import loss_mask

Array = Any


def load_import_path(path: str, field: str) -> Callable:
    """Resolve ``"package.module:function"``; errors name the config field."""
    mod_name, _, fn_name = path.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"AlgorithmConfig.{field}={path!r}: cannot import module "
                         f"{mod_name!r} ({e})") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"AlgorithmConfig.{field}={path!r}: module {mod_name!r} has no "
                         f"callable {fn_name!r}")
    return fn


def make_objective(cfg: AlgorithmConfig, max_new_tokens: int) -> Callable:
    """The objective ``(ObjectiveBatch, Coef) -> (loss_sum, count, metrics)`` for ``cfg``.

    KL enters the loss only when ``kl_in == "loss"`` and ``kl_coef > 0``; Dr.GRPO's
    constant normaliser is the generation budget ``max_new_tokens``.
    """
    if cfg.objective is not None:
        return load_import_path(cfg.objective, "objective")
    cfg = cfg.resolve()
    kl_kind = cfg.kl_kind if (cfg.kl_in == "loss" and cfg.kl_coef > 0) else None
    norm = float(max_new_tokens) if cfg.aggregation == "seq-mean-token-sum-norm" else None
    o = cfg.loss  # the name's entry selects the loss; the fields configure it
    extra = {keyword: getattr(cfg, field) for keyword, field in o.options}
    return functools.partial(o.fn, aggregation=cfg.aggregation, kl_kind=kl_kind,
                             kl_clamp=cfg.kl_clamp, norm_const=norm, is_level=cfg.is_level,
                             is_mode=cfg.is_mode, **extra)


def cov_rule(cfg: AlgorithmConfig) -> tuple | None:
    """``(rule, ratio, low, high)`` for ``rljax.objectives.cov_selection``, or None when
    ``cfg``'s objective (``cfg.loss``) selects no tokens by covariance (static: part of the
    compiled program)."""
    rule = cfg.loss.cov_rule
    if rule is None:
        return None
    if rule == "kl-cov":
        return rule, cfg.kl_cov_ratio, 0.0, 0.0
    return rule, cfg.clip_cov_ratio, cfg.clip_cov_low, cfg.clip_cov_high


def cov_tokens(cfg: AlgorithmConfig, logp_BxT: Array, mb: dict, key: Array) -> Array:
    """The tokens ``cfg``'s Clip-Cov / KL-Cov restrains in minibatch ``mb`` (its
    ``adv_BxT``, ``loss_mask_BxT`` and, when the ratio is not 1, ``old_logp_BxT``),
    from the current policy's log-probs: ``rljax.objectives.cov_selection``, Clip-Cov
    drawing only among tokens PPO's clip leaves alone (``ppo_clipped_tokens``)."""
    cfg = cfg.resolve()
    rule, ratio, low, high = cov_rule(cfg)
    logp_BxT = jax.lax.stop_gradient(logp_BxT)
    exclude = None
    if rule == "clip-cov" and mb.get("old_logp_BxT") is not None:
        dual = cfg.dual_clip if math.isfinite(cfg.dual_clip) else None
        exclude = obj.ppo_clipped_tokens(logp_BxT, mb["old_logp_BxT"], mb["adv_BxT"],
                                         eps_low=cfg.clip_low, eps_high=cfg.clip_high,
                                         dual_clip=dual)
    return obj.cov_selection(logp_BxT, mb["adv_BxT"], loss_mask(mb), rule=rule,
                             ratio=ratio, low=low, high=high, key=key, exclude_BxT=exclude)


def uses_sampler_logp(cfg: AlgorithmConfig) -> bool:
    """True when the objective needs the sampler's log-probs (the importance correction,
    or the sampler's log-probs as the ratio's denominator)."""
    return corrects_sampler(cfg) or cfg.old_logp == "sampler"


def make_coef(cfg: AlgorithmConfig, kl_coef: Any | None = None) -> obj.Coef:
    """``Coef`` from the config; ``kl_coef`` overrides the weight (adaptive controller)."""
    cfg = cfg.resolve()
    kl = cfg.kl_coef if kl_coef is None else kl_coef
    return obj.Coef(
        kl=kl if cfg.kl_in == "loss" else 0.0, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip, entropy=cfg.entropy_coef, value=cfg.value_coef,
        value_clip=cfg.value_clip, tis_cap=cfg.tis_cap, is_low=cfg.is_low,
        sapo_tau_pos=cfg.sapo_tau_pos, sapo_tau_neg=cfg.sapo_tau_neg, kl_cov=cfg.kl_cov_coef,
    )


def sequence_advantages(cfg: AlgorithmConfig, rewards_B: Array) -> Array:
    """Per-completion advantages of ``cfg.advantage_estimator`` "group_mean",
    "group_mean_or_batch" or "leave_one_out" (not "gae" / "teacher": per token); pure
    jnp, so the trainer computes them inside its learning program.

    Rewards are grouped consecutively, ``group_size`` completions per prompt; a user
    estimator (``cfg.advantages``) is ``(rewards_B, group_size) -> adv_B``.
    """
    cfg = cfg.resolve()
    g = cfg.group_size
    if rewards_B.shape[0] % g:
        raise ValueError(f"{rewards_B.shape[0]} rewards do not divide into groups of "
                         f"group_size={g}")
    rewards_B = jnp.asarray(rewards_B, jnp.float32)
    if cfg.advantages is not None:
        fn = load_import_path(cfg.advantages, "advantages")
        return jnp.asarray(fn(rewards_B, g), jnp.float32)
    if cfg.advantage_estimator == "leave_one_out":
        return obj.rloo_advantages(rewards_B, g)
    if cfg.advantage_estimator == "group_mean_or_batch" and g == 1:
        return rewards_B - jnp.mean(rewards_B)
    return obj.group_advantages(rewards_B, g, std=cfg.adv_std, eps=cfg.adv_eps)


def overlong_shaping(lengths_B: Array, max_new_tokens: int, buffer: int, penalty: float) -> Array:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476 §3.4, Eq. 13).

    With L_max = ``max_new_tokens`` and L_cache = ``buffer`` (tokens):
      0                                       if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache      if L_max - L_cache < |y| <= L_max
    scaled by ``penalty`` (the paper's -1 at the limit). Added to the task reward; pure jnp.
    """
    if buffer <= 0:
        return jnp.zeros(jnp.shape(lengths_B), jnp.float32)
    over = jnp.clip(jnp.asarray(lengths_B, jnp.float32) - (max_new_tokens - buffer), 0.0,
                    float(buffer))
    return -penalty * over / buffer


def resolve_overlong_buffer(cfg: AlgorithmConfig, max_new_tokens: int) -> int:
    """The overlong window in tokens ("auto" = 20% of ``max_new_tokens``, DAPO's 4096 of
    20480; None = the preset of ``cfg.name``); it must be smaller than ``max_new_tokens``."""
    return cfg.overlong_tokens(max_new_tokens)
