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
from rljax.train.learn import packing as pack
from rljax.train.learn import ppo as ppo_lib
from rljax.train.learn import router
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.learn.micro import loss_mask
from rljax.train.learn.onepass import padded_width, policy_one_pass

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


def _one_pass_logprobs(policy_gd, policy_params, mb: dict, loss_of, aux, *, chunk,
                       temperature, remat, group, with_entropy):
    """``(surrogate, logp, ent)`` by ``rljax.train.learn.onepass.policy_one_pass`` (the
    objective is token-separable; the policy has a linear head), or None without a linear
    head. Each chunk's derivatives come from ``loss_of`` on the whole micro-batch with that
    chunk's values in place (the other columns hold the sampler's log-probs: any finite
    values do for a separable objective), at the chunks' padded width."""
    b, t = mb["completion_mask_BxT"].shape
    c, width = min(chunk, t), padded_width(t, chunk)
    pad = lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, width - t)))
    arrays, values, coef = aux
    wide = ({k: pad(v) for k, v in arrays.items()}, pad(values), coef)

    def token_grads(wide, logp_BxC, ent_BxC, start):
        put = lambda full, x: jax.lax.dynamic_update_slice(full, x, (0, start))
        a, e = jax.grad(lambda lp, en: loss_of(wide, lp, en), argnums=(0, 1))(
            put(wide[0]["sampler_logp_BxT"], logp_BxC),
            put(jnp.zeros((b, width), jnp.float32), ent_BxC))
        cut = lambda x: jax.lax.dynamic_slice(x, (0, start), (b, c))
        return cut(a), cut(e)

    return policy_one_pass(policy_gd, policy_params, mb, token_grads, wide, chunk=chunk,
                           temperature=temperature, remat=remat, group=group,
                           with_entropy=with_entropy)


def _current(params, mb: dict, coef, *, policy_gd, value_gd, objective, chunk, temperature,
             remat, group, one_pass, packing, **fields):
    """``(values, surrogate, logp, ent)`` of the current parameters on a micro-batch (a
    packed one with ``packing``: forwards on its packed rows)."""
    policy, values = params["policy"], None
    if value_gd is not None and packing is None:
        values = ppo_lib.value_predictions(value_gd, params["value"], mb, remat=remat)
    elif value_gd is not None:
        values = pack.micro_values(value_gd, params["value"], mb, packing, remat=remat)
    if one_pass:  # log-probs as values; their gradient enters through the surrogate
        def loss_of(aux, lp, en):
            arrays, values, coef = aux
            return objective(_objective_batch(arrays, lp, en, values, **fields), coef)[0]

        arrays = {k: v for k, v in mb.items() if k.endswith("_BxT") and not k.startswith("pack_")}
        aux = (arrays, sg(values), coef)
        kw = dict(chunk=chunk, temperature=temperature, remat=remat,
                  with_entropy=fields["entropy_grad"])
        if packing is None:
            out = _one_pass_logprobs(policy_gd, policy, mb, loss_of, aux, group=group, **kw)
        else:
            out = pack.micro_one_pass(policy_gd, policy, mb, packing, loss_of, aux, **kw)
        if out is None:  # the head form was resolved with the trainer
            raise ValueError("rl_loss: one_pass=True, but the policy has no linear output "
                             "head; the head form is resolved by rljax.train.programs.paths."
                             "resolve_paths, which would have chosen 'chunked'")
        return (values, *out)
    if packing is not None:
        return (values, 0.0, *pack.micro_logprobs(policy_gd, policy, mb, packing, chunk=chunk,
                                                  temperature=temperature, remat=remat))
    logp, ent = policy_logprobs(policy_gd, policy, mb, chunk=chunk, temperature=temperature,
                                remat=remat, group=group)
    return values, 0.0, logp, ent


def rl_loss(params, mb: dict, coef, *, policy_gd, value_gd, objective, chunk, temperature,
            remat, self_old: bool, use_sampler: bool, entropy_grad: bool, group: int = 1,
            one_pass: bool = False, packing=None):
    """The RL micro-batch loss: current log-probs (and values) -> ``ObjectiveBatch`` ->
    the objective's ``(loss_sum, count, metrics)`` plus the sampler-gap metric. ``group``:
    the micro-batch's rows share prompts in groups of that many (``policy_logprobs``).
    ``one_pass``: the head form "one-pass" (``rljax.train.programs.paths.ForwardPaths.head``;
    module docstring): the same loss and, to rounding, the same gradients.
    ``packing``: the batch's ``rljax.train.learn.packing.PackSpec`` (None: padded rows);
    ``mb`` is then one packed micro-batch and its loss terms are its rows'. An MoE
    policy adds its router losses and metrics (``rljax.train.learn.router``)."""
    if packing is not None:
        mb = pack.this_micro(mb, packing)
    m = loss_mask(mb)
    fields = dict(self_old=self_old, use_sampler=use_sampler, entropy_grad=entropy_grad)
    with router.recording() as records:  # an MoE policy's router records
        values, surrogate, logp, ent = _current(
            params, mb, coef, policy_gd=policy_gd, value_gd=value_gd, objective=objective,
            chunk=chunk, temperature=temperature, remat=remat, group=group,
            one_pass=one_pass, packing=packing, **fields)
    loss_sum, count, metrics = objective(_objective_batch(mb, logp, ent, values, **fields), coef)
    metrics = dict(metrics, **obj.behaviour_gap(logp, mb["sampler_logp_BxT"], m))
    router_sum, router_metrics = router.loss_terms(records, count, sg(logp),
                                                   mb["sampler_logp_BxT"], m)
    metrics.update(router_metrics)
    return loss_sum + surrogate + router_sum, count, metrics
