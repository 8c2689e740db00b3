"""Algorithm configs run what they name: `name` selects the paper's preset, explicit
fields go on top (in Python and with `--set`); ranges and sampler/filter combinations
fail when the config is built."""

import dataclasses
import math

import pytest

from rljax.train.config import (ALGORITHMS, AlgorithmConfig, OptimConfig, RLConfig,
                                SamplingConfig, SFTConfig, algorithm_preset,
                                check_algorithm_sampling)
from rljax.train.config.presets import BASE, PRESET_FIELDS, PRESETS

# Each paper's settings, written out from the papers (not read from PRESETS):
# (clip_low, clip_high, aggregation, adv_std, kl_in, kl_coef, kl_kind, dynamic_sampling,
#  overlong_buffer, group_size, num_epochs, num_minibatches)
PAPER = {
    "grpo": (0.2, 0.2, "seq-mean-token-mean", "population", "loss", 0.04, "k3", False, 0, 8, 1, 1),
    "dr_grpo": (0.2, 0.2, "seq-mean-token-sum-norm", "none", "none", 0.0, "k3", False, 0, 8, 1, 1),
    "dapo": (0.2, 0.28, "token-mean", "population", "none", 0.0, "k3", True, "auto", 8, 1, 1),
    "gspo": (3e-4, 4e-4, "seq-mean-token-mean", "population", "none", 0.0, "k3", False, 0, 8, 1, 1),
    "rloo": (0.2, 0.2, "seq-mean-token-sum", "none", "none", 0.0, "k3", False, 0, 8, 1, 1),
    "reinforce": (0.2, 0.2, "seq-mean-token-sum", "none", "none", 0.0, "k3", False, 0, 8, 1, 1),
    "ppo": (0.2, 0.2, "token-mean", "population", "reward", 0.05, "k1", False, 0, 1, 2, 2),
    # MiniMax-M1 Eq. 4: token-level mean, no lower bound on the IS weight, no KL (its
    # eps_high is unpublished: 4.0 is rljax's choice).
    "cispo": (1.0, 4.0, "token-mean", "population", "none", 0.0, "k3", False, 0, 8, 1, 1),
    # SAPO: per-sequence token mean; the gate replaces the clip.
    "sapo": (0.2, 0.2, "seq-mean-token-mean", "population", "none", 0.0, "k3", False, 0, 8, 1, 1),
    # GMPO: clip (e^-0.4, e^0.4) in log space, mean over sequences.
    "gmpo": (0.4, 0.4, "seq-mean-token-mean", "population", "none", 0.0, "k3", False, 0, 8, 1, 1),
    # Cui et al. 2025 (Clip-Cov / KL-Cov on a token-level GRPO without KL); verl's
    # recipe/entropy/7b_*_cov.sh: 256 prompts in mini-batches of 32, 8 updates per batch.
    "clip_cov": (0.2, 0.2, "token-mean", "population", "none", 0.0, "k3", False, 0, 8, 1, 8),
    "kl_cov": (0.2, 0.2, "token-mean", "population", "none", 0.0, "k3", False, 0, 8, 1, 8),
    # On-policy distillation: the teacher's per-token reverse KL is the reward (no group
    # baseline: one completion per prompt), token sum per sequence, no reference KL.
    "distill": (0.2, 0.2, "seq-mean-token-sum", "population", "none", 0.0, "k3", False, 0, 1, 1, 1),
}
FIELDS = ("clip_low", "clip_high", "aggregation", "adv_std", "kl_in", "kl_coef", "kl_kind",
          "dynamic_sampling", "overlong_buffer", "group_size", "num_epochs", "num_minibatches")


def _values(cfg):
    r = cfg.resolve()
    return tuple(getattr(r, f) for f in FIELDS)


def test_presets_cover_every_algorithm_and_only_preset_fields():
    assert set(PRESETS) == set(ALGORITHMS) == set(PAPER)
    # advantage_estimator, the behaviour the names chose: tests/test_algorithm_fields.py
    assert set(FIELDS) | {"advantage_estimator"} == set(PRESET_FIELDS)
    for preset in PRESETS.values():
        assert set(preset) <= set(BASE)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_name_alone_gives_the_papers_settings(name):
    assert _values(AlgorithmConfig(name=name)) == PAPER[name]
    assert _values(algorithm_preset(name)) == PAPER[name]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_replace_name_switches_preset_and_keeps_explicit_fields(name):
    other = "ppo" if name != "ppo" else "grpo"
    built = algorithm_preset(other)
    assert _values(dataclasses.replace(built, name=name)) == PAPER[name]
    # Explicit fields stay on top of the new preset.
    # (reinforce / rloo refuse several updates per batch: tests/test_objectives_conventions.py)
    minibatches = 1 if name in ("reinforce", "rloo") else 4
    explicit = dict(clip_high=0.5, entropy_coef=0.01, num_minibatches=minibatches)
    got = dataclasses.replace(algorithm_preset(other, **explicit), name=name).resolve()
    assert (got.clip_high, got.entropy_coef, got.num_minibatches) == (0.5, 0.01, minibatches)
    assert got.clip_low == PAPER[name][0] and got.aggregation == PAPER[name][2]


def test_resolve_is_idempotent_and_none_means_preset():
    r = AlgorithmConfig(name="dapo", clip_high=0.3).resolve()
    assert r.resolve() == r and r.clip_high == 0.3 and r.dynamic_sampling is True
    assert all(getattr(r, f) is not None for f in PRESET_FIELDS)
    # Setting a field back to None returns it to the preset.
    assert dataclasses.replace(r, clip_high=None).resolve().clip_high == 0.28
    assert AlgorithmConfig(name="ppo").single_update is False
    assert AlgorithmConfig(name="grpo").single_update is True


def test_explicit_fields_are_validated_against_the_new_name():
    ppo = algorithm_preset("ppo", kl_in="reward")
    with pytest.raises(ValueError, match=r"AlgorithmConfig.kl_in='reward'.*name='grpo'"):
        dataclasses.replace(ppo, name="grpo")
    with pytest.raises(ValueError, match=r"AlgorithmConfig.group_size=1 .*>= 2 for gspo"):
        dataclasses.replace(algorithm_preset("ppo", group_size=1), name="gspo")


@pytest.mark.parametrize("cls, kwargs, match", [
    (AlgorithmConfig, dict(clip_low=1.5), r"clip_low=1.5 is invalid; allowed: a finite number in \[0.0, 1.0\]"),
    (AlgorithmConfig, dict(clip_low=-0.1), r"clip_low=-0.1"),
    (AlgorithmConfig, dict(clip_high=-0.1), r"clip_high=-0.1"),
    (AlgorithmConfig, dict(clip_high=math.nan), r"clip_high=nan"),
    (AlgorithmConfig, dict(dual_clip=1.0), r"dual_clip=1.0"),
    (AlgorithmConfig, dict(kl_coef=math.inf), r"kl_coef=inf .*finite"),
    (AlgorithmConfig, dict(kl_coef=-1.0), r"kl_coef=-1.0"),
    (AlgorithmConfig, dict(tis_cap=0.0), r"tis_cap=0.0"),
    (AlgorithmConfig, dict(is_level="batch"), r"is_level='batch'.*'token', 'sequence'"),
    (AlgorithmConfig, dict(is_mode="clip"), r"is_mode='clip'.*'truncate', 'mask'"),
    (AlgorithmConfig, dict(is_low=-0.5), r"is_low=-0.5.*>= 0.0"),
    (AlgorithmConfig, dict(adv_eps=-1e-4), r"adv_eps=-0.0001.*>= 0.0"),
    (AlgorithmConfig, dict(kl_clamp=0.0), r"kl_clamp=0.0.*> 0.0"),
    (AlgorithmConfig, dict(name="ppo", kl_kind="k3_ratio"), r"kl_kind='k3_ratio'.*kl_in='reward'"),
    (AlgorithmConfig, dict(kl_kind="k4"), r"kl_kind='k4'.*'k3_ratio'"),
    (AlgorithmConfig, dict(is_mode="mask", is_low=2.0, tis_cap=2.0), r"is_low=2.0.*< tis_cap"),
    (AlgorithmConfig, dict(mask_truncated=1), r"mask_truncated=1.*True or False"),
    (AlgorithmConfig, dict(sapo_tau_neg=0.0), r"sapo_tau_neg=0.0"),
    (AlgorithmConfig, dict(clip_cov_ratio=0.0), r"clip_cov_ratio=0.0.*\(0.0, 1.0\]"),
    (AlgorithmConfig, dict(kl_cov_ratio=1.5), r"kl_cov_ratio=1.5"),
    (AlgorithmConfig, dict(clip_cov_low=6.0), r"clip_cov_low=6.0.*< clip_cov_high=5.0"),
    (AlgorithmConfig, dict(clip_cov_low=5.0), r"clip_cov_low=5.0.*< clip_cov_high=5.0"),
    (AlgorithmConfig, dict(kl_cov_coef=-1.0), r"kl_cov_coef=-1.0"),
    (AlgorithmConfig, dict(name="distill", distill_discount=1.5), r"distill_discount=1.5.*\[0.0, 1.0\]"),
    (AlgorithmConfig, dict(entropy_coef=math.nan), r"entropy_coef=nan"),
    (AlgorithmConfig, dict(value_clip=0.0), r"value_clip=0.0"),
    (AlgorithmConfig, dict(gamma=1.5), r"gamma=1.5"),
    (AlgorithmConfig, dict(lam=-0.1), r"lam=-0.1"),
    (AlgorithmConfig, dict(name="ppo", adaptive_kl_target=0.0), r"adaptive_kl_target=0.0"),
    (AlgorithmConfig, dict(adaptive_kl_target=6.0), r"adaptive_kl_target=6.0.*kl_in='reward'"),
    (AlgorithmConfig, dict(adaptive_kl_horizon=0), r"adaptive_kl_horizon=0"),
    (AlgorithmConfig, dict(name="ppo", dynamic_sampling=True), r"dynamic_sampling=True.*group_size < 2"),
    (AlgorithmConfig, dict(dynamic_sampling=1), r"dynamic_sampling=1.*True or False"),
    (AlgorithmConfig, dict(overlong_buffer=-1), r"overlong_buffer=-1"),
    (AlgorithmConfig, dict(overlong_buffer="half"), r"overlong_buffer='half'.*'auto'"),
    (AlgorithmConfig, dict(overlong_penalty=-1.0), r"overlong_penalty=-1.0"),
    (AlgorithmConfig, dict(max_refill_rounds=-1), r"max_refill_rounds=-1"),
    (AlgorithmConfig, dict(micro_batch_size=-1), r"micro_batch_size=-1"),
    (AlgorithmConfig, dict(num_minibatches=0), r"num_minibatches=0"),
    (AlgorithmConfig, dict(adv_std="std"), r"adv_std='std'"),
    (OptimConfig, dict(b1=1.0), r"OptimConfig.b1=1.0 is invalid; allowed: a finite number in \[0.0, 1.0\)"),
    (OptimConfig, dict(b2=1.0), r"OptimConfig.b2=1.0"),
    (OptimConfig, dict(lr=math.inf), r"OptimConfig.lr=inf"),
    (OptimConfig, dict(eps=0.0), r"OptimConfig.eps=0.0"),
    (OptimConfig, dict(weight_decay=-0.1), r"OptimConfig.weight_decay=-0.1"),
    (OptimConfig, dict(min_lr_ratio=1.5), r"OptimConfig.min_lr_ratio=1.5"),
    (OptimConfig, dict(clip_norm=-1.0), r"OptimConfig.clip_norm=-1.0"),
    (SamplingConfig, dict(temperature=math.inf), r"SamplingConfig.temperature=inf"),
    (SamplingConfig, dict(top_p=0.0), r"SamplingConfig.top_p=0.0"),
    (SamplingConfig, dict(top_k=-1), r"SamplingConfig.top_k=-1"),
    (SamplingConfig, dict(max_new_tokens=0), r"SamplingConfig.max_new_tokens=0"),
    (RLConfig, dict(value_lr_ratio=0.0), r"RLConfig.value_lr_ratio=0.0"),
    (RLConfig, dict(peak_flops=math.inf), r"RLConfig.peak_flops=inf"),
    (RLConfig, dict(logp_chunk=0), r"RLConfig.logp_chunk=0"),
    (RLConfig, dict(remat=1), r"RLConfig.remat=1"),
    (SFTConfig, dict(batch_size=32, micro_batch_size=5), r"SFTConfig.micro_batch_size=5.*divisor of batch_size=32"),
    (SFTConfig, dict(stop_accuracy=1.5), r"SFTConfig.stop_accuracy=1.5"),
    (SFTConfig, dict(stop_loss=math.inf), r"SFTConfig.stop_loss=inf"),
])
def test_out_of_range_fields_fail_at_construction(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_edges_that_are_allowed():
    AlgorithmConfig(clip_low=0.0, clip_high=math.inf, value_clip=math.inf, tis_cap=math.inf)
    AlgorithmConfig(clip_low=1.0, is_mode="mask", is_low=0.5)  # MIS with no upper bound
    AlgorithmConfig(name="ppo", adaptive_kl_target=6.0, overlong_buffer="auto")
    OptimConfig(b1=0.0, clip_norm=math.inf)
    SFTConfig(batch_size=32, micro_batch_size=64)  # larger than the batch: one micro-batch


@pytest.mark.parametrize("filt", [dict(top_k=10), dict(top_p=0.9)])
def test_sampler_logprobs_with_filters_are_rejected(filt):
    sampling = SamplingConfig(**filt)
    with pytest.raises(ValueError, match=r"old_logp='sampler'.*kept probability mass"):
        check_algorithm_sampling(AlgorithmConfig(old_logp="sampler"), sampling)
    with pytest.raises(ValueError, match=r"tis_cap=2.0.*kept probability mass"):
        check_algorithm_sampling(AlgorithmConfig(tis_cap=2.0), sampling)
    with pytest.raises(ValueError, match=r"is_low=0.5 is invalid.*kept probability mass"):
        check_algorithm_sampling(AlgorithmConfig(is_mode="mask", is_low=0.5), sampling)
    # Both sides of the ratio from the full softmax: any filter works.
    for old in ("auto", "recompute"):
        check_algorithm_sampling(AlgorithmConfig(old_logp=old), sampling)
    with pytest.raises(ValueError, match=r"name='distill' is invalid.*full softmax"):
        check_algorithm_sampling(AlgorithmConfig(name="distill"), sampling)
    # No filter: the sampler's log-probs are the policy's.
    check_algorithm_sampling(AlgorithmConfig(old_logp="sampler", tis_cap=2.0), SamplingConfig())


def test_overlong_window_is_checked_against_max_new_tokens():
    with pytest.raises(ValueError, match="overlong_buffer=64 must be < SamplingConfig.max_new_tokens=32"):
        check_algorithm_sampling(AlgorithmConfig(name="dapo", overlong_buffer=64),
                                 SamplingConfig(max_new_tokens=32))
    assert AlgorithmConfig(name="dapo").overlong_tokens(20480) == 4096
    assert AlgorithmConfig(name="grpo").overlong_tokens(20480) == 0


# ------------------------------------------------------------- the run layer (--set, --dry-run)
def _experiment(algorithm):
    from rljax.models import ModelConfig
    from rljax.run.experiment import ExperimentConfig

    model = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                        num_heads=2, num_kv_heads=1)
    return ExperimentConfig(model=model, algorithm=algorithm)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_set_algorithm_name_resolves_to_that_preset_with_explicit_fields_on_top(name):
    from rljax.run.overrides import apply_overrides

    other = "ppo" if name != "ppo" else "grpo"
    teacher = ["teacher=runs/teacher"] if name == "distill" else []  # distill needs one
    cfg = apply_overrides(_experiment(algorithm_preset(other)), [f"algorithm.name={name}"] + teacher)
    assert _values(cfg.algorithm) == PAPER[name] == _values(cfg.resolved().algorithm)
    # Explicit in the experiment, and with --set, both stay on top of the new preset.
    cfg = apply_overrides(_experiment(algorithm_preset(other, entropy_coef=0.01)),
                          [f"algorithm.name={name}", "algorithm.clip_high=0.5"] + teacher)
    r = cfg.resolved().algorithm
    assert (r.name, r.clip_high, r.entropy_coef) == (name, 0.5, 0.01)
    assert (r.clip_low, r.aggregation, r.kl_in) == (PAPER[name][0], PAPER[name][2], PAPER[name][4])


def test_set_gspo_on_the_grpo_demo_and_dry_run_prints_the_resolved_config(capsys):
    import json

    from rljax.cli import main
    from rljax.run.experiment_files import load_experiment

    demo = load_experiment("arithmetic_grpo")
    cfg = load_experiment("arithmetic_grpo", ["algorithm.name=gspo"]).resolved().algorithm
    assert (cfg.clip_low, cfg.clip_high) == (3e-4, 4e-4)
    assert cfg.group_size == demo.algorithm.group_size  # the demo's explicit fields stay
    assert main(["train", "arithmetic_grpo", "--set", "algorithm.name=dapo", "--dry-run"]) == 0
    alg = json.loads(capsys.readouterr().out)["config"]["algorithm"]
    assert (alg["clip_high"], alg["aggregation"], alg["dynamic_sampling"]) == (0.28, "token-mean", True)
    assert alg["overlong_buffer"] == "auto" and all(alg[f] is not None for f in PRESET_FIELDS)


def test_experiment_rejects_sampler_logprobs_with_filters():
    from rljax.run.overrides import OverrideError, apply_overrides

    cfg = _experiment(algorithm_preset("grpo", old_logp="sampler"))
    with pytest.raises(OverrideError, match=r"old_logp='sampler' is invalid with SamplingConfig.top_k=20"):
        apply_overrides(cfg, ["sampling.top_k=20"])


def test_distill_needs_a_teacher_and_only_distill_takes_one():
    from rljax.run.overrides import OverrideError, apply_overrides

    with pytest.raises(ValueError, match=r"teacher=None is invalid.*algorithm.name='distill'"):
        _experiment(algorithm_preset("distill"))
    with pytest.raises(OverrideError, match=r"teacher='t' is invalid.*else None.*'grpo'"):
        apply_overrides(_experiment(algorithm_preset("grpo")), ["teacher=t"])
    cfg = apply_overrides(_experiment(algorithm_preset("grpo")),
                          ["algorithm.name=distill", "teacher=runs/t", "algorithm.distill_discount=1"])
    assert (cfg.teacher, cfg.algorithm.distill_discount) == ("runs/t", 1.0)
