"""check_objective: every library objective passes it; a user objective passes; broken ones fail."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import rljax.objectives as ro
from rljax.testing import check_objective, default_batch

# Every library objective, each under different static options, coefficients and fields.
# The fourth entry: the optional fields the objective needs (a KL kind needs the reference).
LIBRARY_CASES = {
    "reinforce-seqsum-k1-minimal-fields": (
        functools.partial(ro.reinforce, aggregation="seq-mean-token-sum", kl_kind="k1"),
        ro.Coef(kl=0.1),
        dict(sampler=False, entropy=False, values=False),
        ("ref_logp_BxT",),
    ),
    "grpo": (ro.grpo, ro.Coef(), {}, ("ref_logp_BxT",)),
    "dapo": (
        functools.partial(ro.grpo, aggregation="token-mean", kl_kind=None),
        ro.Coef(kl=0.0, clip_high=0.28, dual_clip=3.0, entropy=0.01),
        {},
        ("entropy_BxT",),
    ),
    "dr-grpo-k2-clamped": (
        functools.partial(ro.grpo, aggregation="seq-mean-token-sum-norm", norm_const=16.0, kl_kind="k2", kl_clamp=10.0),
        ro.Coef(tis_cap=2.0),
        {},
        ("ref_logp_BxT",),
    ),
    "gspo": (ro.gspo, ro.Coef(clip_low=3e-4, clip_high=4e-4), {}, ()),
    "ppo-seqmean-k3-entropy": (
        functools.partial(ro.ppo, aggregation="seq-mean-token-mean", kl_kind="k3"),
        ro.Coef(entropy=0.01, value_clip=0.5, dual_clip=3.0),
        {},
        ("ref_logp_BxT", "values_BxT", "old_values_BxT", "returns_BxT", "entropy_BxT"),
    ),
}


@pytest.mark.parametrize("name", list(LIBRARY_CASES))
def test_library_objectives_pass(name, mesh8):
    fn, coef, fields, requires = LIBRARY_CASES[name]
    out = check_objective(fn, coef, batch=default_batch(1, **fields), mesh=mesh8,
                          requires=requires)
    assert out["count"] > 0 and not out["skipped"] and out["mesh"] == "8 devices"
    assert out["token_separable"] == ro.token_separable(fn)  # checked where it is marked


def my_objective(batch: ro.ObjectiveBatch, coef: ro.Coef):
    """A user's objective: clipped surrogate, k3 KL, token-mean, written from building blocks."""
    mask = batch.mask_BxT > 0
    logp = jnp.where(mask, batch.logp_BxT, 0.0)
    old = jnp.where(mask, batch.old_logp_BxT, 0.0)
    # No reference in a run without a KL term: the KL is then 0.
    ref = logp if batch.ref_logp_BxT is None else jnp.where(mask, batch.ref_logp_BxT, 0.0)
    adv = jnp.where(mask, batch.adv_BxT, 0.0)
    ratio = jnp.exp(logp - old)
    obj = ro.ppo_clip_objective(ratio, adv, eps_low=coef.clip_low, eps_high=coef.clip_high)
    per_token = -obj + coef.kl * ro.kl_estimate(logp, ref, "k3")
    loss_sum, count = ro.aggregate(per_token, batch.mask_BxT, "token-mean")
    kl_sum, n = ro.aggregate(jax.lax.stop_gradient(ro.kl_estimate(logp, ref, "k3")), batch.mask_BxT, "token-mean")
    return loss_sum, count, {"kl": (kl_sum, n)}


def test_user_objective_passes():
    # Default batch and mesh; micro-batches of both 2 and 4.
    check_objective(my_objective, micro_batches=(2, 4))


def _ignores_mask(batch, coef):
    loss = -(batch.adv_BxT * batch.logp_BxT).sum()
    return loss, jnp.float32(batch.logp_BxT.size), {}


def _batch_mean(batch, coef):
    loss_sum, count = ro.aggregate(-batch.adv_BxT * batch.logp_BxT, batch.mask_BxT, "token-mean")
    return loss_sum / count, jnp.float32(1.0), {}


def _per_padded_width(batch, coef):
    s, _ = ro.aggregate(-batch.adv_BxT * batch.logp_BxT, batch.mask_BxT, "seq-mean-token-sum")
    return s / batch.logp_BxT.shape[1], jnp.float32(batch.logp_BxT.shape[0]), {}


def _python_branch(batch, coef):
    kl = float(coef.kl)  # concretises a traced coefficient
    s, n = ro.aggregate(-batch.adv_BxT * batch.logp_BxT * (1 + kl), batch.mask_BxT, "token-mean")
    return s, n, {}


def _not_a_pair(batch, coef):
    s, n = ro.aggregate(-batch.adv_BxT * batch.logp_BxT, batch.mask_BxT, "token-mean")
    return s, n, {"x": s / n}


def _no_policy_gradient(batch, coef):
    s, n = ro.aggregate(jnp.zeros_like(batch.logp_BxT), batch.mask_BxT, "token-mean")
    return s + 0.0 * batch.logp_BxT.sum() * 0.0, n, {}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaticCoef:
    """A broken coefficient pytree: `kl` is static metadata, so each value recompiles."""

    kl: float = dataclasses.field(default=0.1, metadata=dict(static=True))
    clip: float = 0.2


def _uses_static_coef(batch, coef):
    s, n = ro.aggregate(-batch.adv_BxT * batch.logp_BxT * coef.kl, batch.mask_BxT, "token-mean")
    return s, n, {}


@pytest.mark.parametrize(
    "fn,coef,check",
    [
        (_ignores_mask, None, r"\[mask\]"),
        (_batch_mean, None, r"\[micro-batch x4\]"),
        (_per_padded_width, None, r"\[padding\]"),
        (_python_branch, None, r"\[jit\]"),
        (_not_a_pair, None, r"\[contract\].*'x'"),
        (_no_policy_gradient, None, r"\[gradient\]"),
        (_uses_static_coef, StaticCoef(), r"\[recompile\]"),
    ],
)
def test_broken_objectives_fail(fn, coef, check):
    with pytest.raises(AssertionError, match=check):
        check_objective(fn, coef)


def test_ppo_without_value_fields_is_a_clear_error():
    with pytest.raises(ValueError, match="values_BxT"):
        check_objective(ro.ppo, batch=default_batch(0, values=False))


def test_batch_validation_names_the_field():
    b = default_batch(0)
    bad = dataclasses.replace(b, adv_BxT=b.adv_BxT[:, :-1])
    with pytest.raises(ValueError, match="adv_BxT"):
        ro.grpo(bad, ro.Coef())
    with pytest.raises(ValueError, match="aggregation.*'token-mean'"):
        ro.grpo(b, ro.Coef(), aggregation="sum")
    with pytest.raises(ValueError, match="kl_kind.*'k1', 'k2', 'k3'"):
        ro.ppo(b, ro.Coef(), kl_kind="k5")
    with pytest.raises(ValueError, match="Coef.dual_clip"):
        ro.Coef(dual_clip=1.0)
    with pytest.raises(ValueError, match="Coef.clip_low"):
        ro.Coef(clip_low=1.5)


# --- the batches a run gives, float32 tolerances, one device -----------------------------

def readme_objective(batch: ro.ObjectiveBatch, coef: ro.Coef):
    """README.md's objective: clipped surrogate plus k3 KL, token mean (no KL without a
    reference: a run with kl_coef=0 passes ref_logp_BxT=None)."""
    ratio = jnp.exp(batch.logp_BxT - batch.old_logp_BxT)
    obj = ro.ppo_clip_objective(ratio, batch.adv_BxT, eps_low=coef.clip_low, eps_high=coef.clip_high)
    ref = batch.logp_BxT if batch.ref_logp_BxT is None else batch.ref_logp_BxT
    kl = ro.kl_estimate(batch.logp_BxT, ref, "k3")
    loss_sum, count = ro.aggregate(-obj + coef.kl * kl, batch.mask_BxT, "token-mean")
    return loss_sum, count, {"kl": ro.aggregate(kl, batch.mask_BxT, "token-mean")}


def _ratio_times_adv(batch, coef):
    ratio = jnp.exp(batch.logp_BxT - batch.old_logp_BxT)
    return ro.aggregate(-ratio * batch.adv_BxT, batch.mask_BxT, "token-mean") + ({},)


def _needs_reference(batch, coef):  # README's objective before it handled a run without KL
    kl = ro.kl_estimate(batch.logp_BxT, batch.ref_logp_BxT, "k3")
    return ro.aggregate(-batch.adv_BxT * batch.logp_BxT + coef.kl * kl, batch.mask_BxT, "token-mean") + ({},)


@pytest.mark.parametrize("fn", [readme_objective, _ratio_times_adv])
def test_correct_objectives_pass_at_100_seeds(fn, mesh8):
    # At the former rtol=1e-6, ratio x advantage failed at seed 0 and README's at seed 12.
    out = check_objective(fn, seed=range(100), mesh=mesh8)
    assert out["batches"] == ["as given", "without " + ", ".join(
        f for f in ro.batch.OPTIONAL_FIELDS if f not in ("cov_select_BxT", "teacher_logp_BxT"))]


def test_objective_needing_a_reference_fails_like_a_run_without_kl():
    with pytest.raises(AssertionError, match=r"\[batch without ref_logp_BxT\].*kl_coef=0.*requires="):
        check_objective(_needs_reference)
    check_objective(_needs_reference, requires=("ref_logp_BxT",))  # declared: passes
    with pytest.raises(ValueError, match="not optional"):
        check_objective(_needs_reference, requires=("logp_BxT",))


def test_one_device_runs_the_mesh_check_on_8_emulated_devices():
    """A one-device process (here: a one-device mesh) still compares 8 devices with 1, in a
    child process; an objective that cannot be sent there (it does not pickle) is skipped
    with a warning that says why."""
    one = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                        devices=jax.devices()[:1])
    out = check_objective(readme_objective, mesh=one)
    assert out["mesh"] == "8 emulated CPU devices in a subprocess" and not out["skipped"]
    local = lambda batch, coef: readme_objective(batch, coef)  # noqa: E731
    with pytest.warns(UserWarning, match="mesh check skipped.*do not pickle"):
        out = check_objective(local, mesh=one)
    assert out["mesh"] == "not run" and "top level" in out["skipped"]["mesh"]


def _marked(fn, **kw):
    marked = functools.partial(fn, **kw)
    marked.token_separable = True
    return marked


def test_token_separable_is_checked_not_trusted(mesh8):
    """A flag that routes a sequence-level objective through the one-pass head fails; the
    library's separable objectives and a correctly marked user objective pass."""
    for fn in (_marked(ro.gspo), _marked(ro.grpo, is_level="sequence")):
        with pytest.raises(AssertionError, match=r"\[token_separable\].*marked token-separable"
                           r".*chunks of 4 of 12 columns.*Remove the token_separable flag"):
            check_objective(fn, mesh=mesh8)
    assert check_objective(_marked(my_objective), mesh=mesh8)["token_separable"]
    assert not check_objective(my_objective, mesh=mesh8)["token_separable"]
