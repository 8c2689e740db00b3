"""The RL micro-batch loss of the learning program (``RLTrainer``'s updates).

``rl_loss`` turns a micro-batch and the current parameters into the objective's
``(loss_sum, count, metrics)``: the policy's log-probs and entropies (and PPO's values),
the ``ObjectiveBatch``, the objective, the sampler-gap metric. With a token-separable
objective (``rljax.objectives.token_separable``) and ``RLConfig.one_pass_head`` the
policy's linear head forms its gradient in the forward pass (``rljax.train.learn.onepass``);
the trainer decides that once (``rljax.train.programs.paths``) and passes ``one_pass``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax import objectives as obj
from rljax.train.learn import router
from rljax.train.learn.layout import Layout, Padded, head_logprobs, head_one_pass
from rljax.train.learn.micro import loss_mask

sg = jax.lax.stop_gradient
__all__ = ["rl_loss"]


def _old_logp(mb: dict, logp, self_old: bool):
    """pi_old's log-probs: the current ones, stop-gradient (``self_old``: one update per
    batch; and where ``self_old_BxT`` is 1: the first update of a batch whose pi_old was
    recomputed, ``rljax.train.learn._updates``), else the batch's ``old_logp_BxT``. Where
    they are the current ones, log r = logp - sg(logp) is exactly 0."""
    if self_old:
        return sg(logp)
    if "self_old_BxT" not in mb:
        return mb["old_logp_BxT"]
    return jnp.where(mb["self_old_BxT"] > 0, sg(logp), mb["old_logp_BxT"])


def _objective_batch(mb: dict, logp, ent, values, *, self_old: bool, use_sampler: bool,
                     entropy_grad: bool) -> obj.ObjectiveBatch:
    """The objective's batch from a micro-batch and the current log-probs / entropies."""
    return obj.ObjectiveBatch(
        logp_BxT=logp, old_logp_BxT=_old_logp(mb, logp, self_old),
        mask_BxT=loss_mask(mb), adv_BxT=mb["adv_BxT"],
        ref_logp_BxT=mb.get("ref_logp_BxT"),
        sampler_logp_BxT=mb["sampler_logp_BxT"] if use_sampler else None,
        values_BxT=values, old_values_BxT=mb.get("old_values_BxT"),
        returns_BxT=mb.get("returns_BxT"), entropy_BxT=ent if entropy_grad else sg(ent),
        cov_select_BxT=mb.get("cov_select_BxT"), teacher_logp_BxT=mb.get("teacher_logp_BxT"),
    )


def _current(params, mb: dict, coef, *, policy_gd, value_gd, objective, chunk, temperature,
             remat, layout, one_pass, **fields):
    """``(values, surrogate, logp, ent)`` of the current parameters on a micro-batch, in
    ``[B, T]`` (forwards on ``layout``'s rows)."""
    policy, values = params["policy"], None
    if value_gd is not None:
        values = layout.rows(layout.values(value_gd, params["value"], mb, remat), mb)
    head = dict(chunk=chunk, temperature=temperature, remat=remat)
    if one_pass:  # log-probs as values; their gradient enters through the surrogate
        def loss_of(aux, lp, en):
            arrays, values, coef = aux
            return objective(_objective_batch(arrays, lp, en, values, **fields), coef)[0]

        arrays = {k: v for k, v in mb.items() if k.endswith("_BxT") and not k.startswith("pack_")}
        grads, aux = layout.token_grads(loss_of, (arrays, sg(values), coef), mb, chunk)
        surrogate, logp, ent = head_one_pass(layout, policy_gd, policy, mb, grads, aux,
                                             with_entropy=fields["entropy_grad"], **head)
    else:
        surrogate, (logp, ent) = 0.0, head_logprobs(layout, policy_gd, policy, mb, **head)
    return values, surrogate, layout.rows(logp, mb), layout.rows(ent, mb)


def rl_loss(params, mb: dict, coef, *, policy_gd, value_gd, objective, chunk, temperature,
            remat, self_old: bool, use_sampler: bool, entropy_grad: bool,
            layout: Layout = Padded(), one_pass: bool = False):
    """The RL micro-batch loss: current log-probs (and values) -> ``ObjectiveBatch`` ->
    the objective's ``(loss_sum, count, metrics)`` plus the sampler-gap metric.
    ``layout``: the batch's rows (``rljax.train.learn.layout``: padded, shared prompts,
    packed); ``mb`` is one micro-batch of it and its loss terms are its rows'.
    ``one_pass``: the head form "one-pass" (``rljax.train.programs.paths.ForwardPaths.head``;
    module docstring): the same loss and, to rounding, the same gradients. An MoE
    policy adds its router losses and metrics (``rljax.train.learn.router``)."""
    mb = layout.micro(mb)
    m = loss_mask(mb)
    fields = dict(self_old=self_old, use_sampler=use_sampler, entropy_grad=entropy_grad)
    with router.recording() as records:  # an MoE policy's router records
        values, surrogate, logp, ent = _current(
            params, mb, coef, policy_gd=policy_gd, value_gd=value_gd, objective=objective,
            chunk=chunk, temperature=temperature, remat=remat, layout=layout,
            one_pass=one_pass, **fields)
    loss_sum, count, metrics = objective(_objective_batch(mb, logp, ent, values, **fields), coef)
    metrics = dict(metrics, **obj.behaviour_gap(logp, mb["sampler_logp_BxT"], m))
    router_sum, router_metrics = router.loss_terms(records, count, sg(logp),
                                                   mb["sampler_logp_BxT"], m)
    metrics.update(router_metrics)
    return loss_sum + surrogate + router_sum, count, metrics
