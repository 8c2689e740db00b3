"""check_objective: every library objective passes it; a user objective passes; broken ones fail."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import rljax.objectives as ro
from rljax.testing import check_objective, default_batch

# Every library objective, each under different static options, coefficients and fields.
LIBRARY_CASES = {
    "reinforce-seqsum-k1-minimal-fields": (
        functools.partial(ro.reinforce, aggregation="seq-mean-token-sum", kl_kind="k1"),
        ro.Coef(kl=0.1),
        dict(sampler=False, entropy=False, values=False),
    ),
    "grpo": (ro.grpo, ro.Coef(), {}),
    "dapo": (
        functools.partial(ro.grpo, aggregation="token-mean", kl_kind=None),
        ro.Coef(kl=0.0, clip_high=0.28, dual_clip=3.0, entropy=0.01),
        {},
    ),
    "dr-grpo-k2-clamped": (
        functools.partial(ro.grpo, aggregation="seq-mean-token-sum-norm", norm_const=16.0, kl_kind="k2", kl_clamp=10.0),
        ro.Coef(tis_cap=2.0),
        {},
    ),
    "gspo": (ro.gspo, ro.Coef(clip_low=3e-4, clip_high=4e-4), {}),
    "ppo-seqmean-k3-entropy": (
        functools.partial(ro.ppo, aggregation="seq-mean-token-mean", kl_kind="k3"),
        ro.Coef(entropy=0.01, value_clip=0.5, dual_clip=3.0),
        {},
    ),
}


@pytest.mark.parametrize("name", list(LIBRARY_CASES))
def test_library_objectives_pass(name, mesh8):
    fn, coef, fields = LIBRARY_CASES[name]
    out = check_objective(fn, coef, batch=default_batch(1, **fields), mesh=mesh8)
    assert out["count"] > 0


def my_objective(batch: ro.ObjectiveBatch, coef: ro.Coef):
    """A user's objective: clipped surrogate, k3 KL, token-mean, written from building blocks."""
    mask = batch.mask_BxT > 0
    logp = jnp.where(mask, batch.logp_BxT, 0.0)
    old = jnp.where(mask, batch.old_logp_BxT, 0.0)
    ref = jnp.where(mask, batch.ref_logp_BxT, 0.0)
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
