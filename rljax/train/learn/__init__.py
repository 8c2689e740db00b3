"""The RL step's learning program: one ``jax.jit`` from a rollout batch to updated weights.

Everything between the rewards and the metrics runs in one compiled program over the
global batch (every process calls it with the same shapes):

1. reference / old-policy / value / teacher forwards (micro-batched, chunked log-probs);
2. advantages: group-normalised, RLOO, REINFORCE, or PPO's GAE on KL-penalised token
   rewards (whitened), all as pure functions of arrays (``rljax.objectives``);
3. ``num_epochs x num_minibatches`` optimiser updates as a ``lax.scan`` over an in-graph
   permutation of the rows, each with exact micro-batch accumulation
   (``rljax.train.learn.update.make_update``); with a recomputed pi_old the first
   update takes its own forward's log-probs, stop-gradient, as pi_old (ratio exactly 1:
   ``_updates``);
4. the adaptive KL controller (Ziegler et al. 2019 §2.2) and the step's metrics, reduced
   to replicated scalars.

Parameters, optimiser state and the batch are donated. Rows whose ``weight_B`` is 0
(padding groups of DAPO's dynamic sampling) get an all-zero completion mask, so they
change no loss, gradient or denominator in any aggregation mode; with
``mask_truncated`` so do truncated completions, after the advantages (they still count
in their group's baseline). Clip-Cov / KL-Cov select their tokens once per minibatch,
from the current policy's log-probs over the whole minibatch, before the objective.
On-policy distillation's teacher (``spec.teacher_gd``, its parameters an argument of the
program like the reference's) scores the batch here too, at the sampling temperature; its
advantages come from the teacher in the objective (``rljax.objectives.distill``), so the
task-reward advantages are zeros.

The package holds the program's pieces: ``loss`` (the micro-batch loss, ``rl_loss``),
``algorithms`` (config -> objective, coefficients, advantages), ``ppo``, ``logprobs``,
``linear_head`` and ``onepass`` (the output head), ``layout`` (``spec.layout``: padded
rows, shared prompts or packed rows, with the head's entry points), ``micro`` and
``packing`` (the layouts' arrays), ``reference`` (the frozen KL reference) and ``update``
(the jitted update and ``TrainState``, shared with SFT; its trainable filter).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from rljax import objectives as obj
from rljax.train.learn import algorithms as alg
from rljax.train.learn import ppo as ppo_lib
from rljax.train.learn import router
from rljax.train.learn.layout import frozen_logprobs
from rljax.train.learn.reference import reference_model
from rljax.train.learn.update import make_update
from rljax.train.batch import REPLAY_KEY, Rollout

Array = Any


def _logprobs(spec, graphdef, params, seqs: dict) -> Array:
    """``frozen_logprobs`` of the decoder ``(graphdef, params)`` on ``spec.layout``."""
    return frozen_logprobs(spec.layout, graphdef, params, seqs, chunk=spec.chunk,
                           temperature=spec.temperature)


def _prepare(spec, params, ref_params, ro: Rollout, kl_coef, teacher_params=None):
    """Reference / old / value / teacher forwards and advantages -> ``(batch, extra
    metrics)``."""
    a, layout = spec.alg, spec.layout
    seqs, extra = layout.plan(ro.seqs())
    mask_BxT = ro.loss_mask()  # what is trained on; seqs' completion mask is what is attended
    batch = dict(seqs, sampler_logp_BxT=ro.sampler_logp_BxT, loss_mask_BxT=mask_BxT)
    if spec.uses_ref:  # a LoRA policy's reference: its base with the reference's adapters
        batch["ref_logp_BxT"] = _logprobs(spec, *reference_model(
            spec.policy_gd, params["policy"], ref_params, spec.trainable), seqs)
    if spec.teacher_gd is not None:
        batch["teacher_logp_BxT"] = _logprobs(spec, spec.teacher_gd, teacher_params, seqs)
    if spec.old_mode == "recompute" or (a.needs_value_model and spec.old_mode == "self"):
        batch["old_logp_BxT"] = _logprobs(spec, spec.policy_gd, params["policy"], seqs)
    elif spec.old_mode == "sampler":
        batch["old_logp_BxT"] = ro.sampler_logp_BxT
    rewards_B = ro.rewards_B
    if spec.overlong:
        # The model's own tokens (the loss mask) against the response budget: an
        # environment's output in a multi-turn completion is not the model's length.
        rewards_B = rewards_B + alg.overlong_shaping(jnp.sum(mask_BxT, axis=1),
                                                     spec.max_new_tokens, spec.overlong,
                                                     a.overlong_penalty)
    if a.needs_value_model:  # advantage_estimator="gae"
        values_BxT = layout.over_micro(
            lambda mb: layout.values(spec.value_gd, params["value"], mb), seqs)
        adv, ret, _ = ppo_lib.ppo_advantages(
            rewards_B, batch["old_logp_BxT"], batch.get("ref_logp_BxT"), values_BxT, mask_BxT,
            kl_coef=kl_coef, kl_kind=a.kl_kind, gamma=a.gamma, lam=a.lam,
            whiten_adv=a.whiten_advantages)
        batch.update(adv_BxT=adv, returns_BxT=ret, old_values_BxT=values_BxT)
        # How much of the returns' variance the value model predicted (before updates).
        extra["value_explained_var"] = obj.explained_variance(values_BxT, ret, mask_BxT)
    elif a.needs_teacher:  # the teacher's per-token advantages, in the objective
        batch["adv_BxT"] = jnp.zeros_like(mask_BxT, jnp.float32)
    else:
        batch["adv_BxT"] = obj.broadcast_to_tokens(alg.sequence_advantages(a, rewards_B), mask_BxT)
    if a.kl_in == "reward" and spec.uses_ref:
        extra["seq_kl"] = ppo_lib.sequence_kl(batch["old_logp_BxT"], batch["ref_logp_BxT"],
                                              mask_BxT)
    if spec.overlong:  # the reward the advantages saw, after DAPO's length shaping
        w_B = ro.weight_B
        extra["reward_shaped_mean"] = jnp.sum(rewards_B * w_B) / jnp.maximum(jnp.sum(w_B), 1.0)
    return batch, extra


def _token_metrics(ro: Rollout) -> dict:
    """With a loss mask (a multi-turn rollout: the completion holds the environment's
    observations too) ``response_len_mean`` / ``_max`` and ``completion_tokens`` count the
    model's tokens, and ``env/tool_tokens_mean`` / ``_max`` the rest of the completion, over
    real rows; without one the completion is the model's and ``Rollout.metrics`` stands."""
    if ro.loss_mask_BxT is None:
        return {}
    w_B = (ro.weight_B > 0).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w_B), 1.0)
    model_B = jnp.sum(ro.loss_mask_BxT, axis=1) * w_B
    tool_B = jnp.sum(ro.completion_mask_BxT, axis=1) * w_B - model_B
    return {"response_len_mean": jnp.sum(model_B) / n, "response_len_max": jnp.max(model_B),
            "completion_tokens": jnp.sum(model_B),
            "env/tool_tokens_mean": jnp.sum(tool_B) / n, "env/tool_tokens_max": jnp.max(tool_B)}


def _minibatch_rows(key, batch_size: int, num_minibatches: int, group: int = 1) -> Array:
    """``[M, B/M]`` row indices: a random permutation split into minibatches (sorted
    within each, so micro-batches keep their strided layout); identity for one. With
    ``group`` G > 1 the permutation is of whole groups of G consecutive rows."""
    if num_minibatches == 1:
        return jnp.arange(batch_size)[None]
    perm = jax.random.permutation(key, batch_size // group)
    groups_MxN = jnp.sort(perm.reshape(num_minibatches, -1), axis=1)
    rows = groups_MxN[:, :, None] * group + jnp.arange(group)
    return rows.reshape(num_minibatches, -1)


#: The unpacked arrays a policy forward reads (`Rollout.seqs`; the router-replay ids too).
SEQ_KEYS = ("prompt_BxP", "prompt_mask_BxP", "completion_BxT", "completion_mask_BxT",
            REPLAY_KEY)


def _cov_selector(spec) -> Callable | None:
    """``select(params, minibatch, key) -> cov_select_BxT`` for Clip-Cov / KL-Cov (None
    for the other algorithms): the current policy's log-probs over the minibatch, then
    ``rljax.objectives.cov_selection`` on the whole minibatch."""
    if alg.cov_rule(spec.alg) is None:
        return None

    def select(params, mb: dict, key) -> Array:
        seqs = {k: v for k, v in mb.items() if k.startswith("pack_") or k in SEQ_KEYS}
        logp_BxT = _logprobs(spec, spec.policy_gd, params["policy"], seqs)
        return alg.cov_tokens(spec.alg, logp_BxT, mb, key)

    return select


def _updates(spec, update, params, opt_state, counters, batch, coef, key,
             select: Callable | None = None):
    """``num_epochs x num_minibatches`` updates as one scan; metrics stacked per update.

    With a recomputed pi_old (``spec.old_mode == "recompute"``) the scan's first update
    runs on the parameters pi_old came from: its minibatch carries ``self_old_BxT`` = 1,
    so the loss takes pi_old as stop_gradient of its own log-probs (``rl_loss``): the
    ratio is exactly 1 there (log r == 0 bitwise), not 1 up to the rounding between two
    forward programs. Later updates read the recomputed ``old_logp_BxT``."""
    a = spec.alg
    b = batch["loss_mask_BxT"].shape[0]
    keys = jax.random.split(key, a.num_epochs)
    rows_UxN = jnp.concatenate([_minibatch_rows(k, b, a.num_minibatches, spec.layout.group)
                                for k in keys])
    # Clip-Cov's draws: their own stream, so the minibatch permutation is unchanged.
    sel_keys_U = jax.random.split(jax.random.fold_in(key, 1), rows_UxN.shape[0])
    first_U = jnp.arange(rows_UxN.shape[0]) == 0

    def one(carry, xs):
        rows_N, sel_key, first = xs
        p, o, c = carry
        # One minibatch is the batch in order: no gather (a gather by traced row indices
        # all-reduced every batch array over the batch shards).
        mb = dict(batch) if a.num_minibatches == 1 else jax.tree.map(lambda x: x[rows_N], batch)
        if spec.old_mode == "recompute":
            mb["self_old_BxT"] = jnp.broadcast_to(first, mb["loss_mask_BxT"].shape).astype(
                jnp.float32)
        if select is not None:
            mb["cov_select_BxT"] = select(p, mb, sel_key)
        p, o, c, m = update(p, o, c, mb, coef)
        return (p, o, c), m

    (params, opt_state, counters), m_U = jax.lax.scan(one, (params, opt_state, counters),
                                                      (rows_UxN, sel_keys_U, first_U))
    skipped_U = m_U.pop("skipped_update")
    metrics = {k: jnp.mean(v) for k, v in m_U.items()}
    # The gap between the behaviour policy and the weights before the updates (the
    # proximal policy; rljax.objectives.behaviour_gap), and an MoE policy's router
    # agreement with the sampler: the first update's.
    first = ("sampler_gap", "mismatch_kl", "is_weight_max", "is_weight_min",
             *router.FIRST_UPDATE)
    for name in first:
        if name in m_U:
            metrics[name] = m_U[name][0]
    metrics["skipped_updates"] = jnp.sum(skipped_U)
    return params, opt_state, counters, metrics


def make_learn(spec, loss_fn, txs: dict, schedules: dict, constrain: Callable | None = None):
    """The pure learning program ``learn(params, opt_state, counters, ref_params, ro,
    kl_coef, key, teacher_params=None) -> (params, opt_state, counters, kl_coef, metrics)``
    of ``spec`` (a ``rljax.train.programs.step.StepSpec``: the algorithm's choices and
    the models' graphdefs).

    ``ro`` is a :class:`~rljax.train.batch.Rollout` with rewards; ``metrics`` is a dict
    of float32 scalars (update means, the first update's sampler gap, rollout statistics).
    With ``spec.teacher_gd`` (on-policy distillation) ``teacher_params`` is the teacher's
    frozen state, global arrays like ``ref_params``.
    """
    layout = spec.layout
    layout.check(spec.alg.num_minibatches)
    update = make_update(loss_fn, txs, schedules, layout.num_micro, constrain, layout.group,
                         layout.split, {"policy": spec.trainable})
    select = _cov_selector(spec)

    def learn(params, opt_state, counters, ref_params, ro: Rollout, kl_coef, key,
              teacher_params=None):
        if (spec.teacher_gd is None) != (teacher_params is None):
            raise ValueError("learn: teacher_params must be given exactly when the spec "
                             "has a teacher_gd (on-policy distillation)")
        tokens = _token_metrics(ro)  # before masking: whether the rollout has a loss mask
        ro = ro.masked_by_weight()
        batch, extra = _prepare(spec, params, ref_params, ro, kl_coef, teacher_params)
        if spec.alg.mask_truncated:
            batch["loss_mask_BxT"] = obj.mask_truncated_completions(
                batch["loss_mask_BxT"], ro.truncated_B)
        coef = alg.make_coef(spec.alg, kl_coef)
        params, opt_state, counters, metrics = _updates(spec, update, params, opt_state,
                                                        counters, batch, coef, key, select)
        seq_kl = extra.pop("seq_kl", None)
        new_kl = kl_coef if seq_kl is None else ppo_lib.adaptive_kl_coef(
            kl_coef, seq_kl, target=spec.alg.adaptive_kl_target,
            horizon=spec.alg.adaptive_kl_horizon, batch_size=ro.rewards_B.shape[0])
        metrics.update(extra)
        metrics.update(ro.metrics())
        metrics.update(tokens)
        metrics["kl_coef"] = kl_coef
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return params, opt_state, counters, jnp.asarray(new_kl, jnp.float32), metrics

    return learn
