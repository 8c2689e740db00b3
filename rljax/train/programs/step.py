"""The RL step's compiled programs: module-level ``jax.jit`` functions of a frozen spec.

Every choice the programs read is a field of :class:`StepSpec` (frozen, hashable; configs,
graphdefs, the mesh and the device reward, never arrays), passed as a static argument, so
JAX's cache keys each program by it and trainers with equal specs share one executable
(``tests/test_program_spec.py``): :func:`learn_step` (a host-reward step's learning
program), :func:`fused_step` (with a device reward, sample -> score -> learn),
:func:`seeds_step` (:func:`fused_step` vmapped over a leading seed axis) and
:func:`seeds_learn_step` (:func:`learn_step` vmapped: several seeds' host-source batches).

Call them inside ``rljax.sharding.mesh_context(spec.mesh)`` (``run``): splash attention and
parameter placement read the mesh while they are traced.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from rljax.models.lora import ALL_PARAMETERS, Trainable
from rljax.sharding import mesh_context, place_outputs
from rljax.train.config import OptimConfig
from rljax.train.config.algorithm import AlgorithmSpec
from rljax.train.learn import make_learn
from rljax.train.learn import algorithms as alg
from rljax.train.learn.layout import Layout
from rljax.train.learn.loss import rl_loss
from rljax.train.learn.update import batch_constrainer, make_optimizer
from rljax.train.programs.device import device_rollout, split_step_key
from rljax.train.programs.paths import ForwardPaths

__all__ = ["StepSpec", "fused_step", "learn_fn", "learn_program", "learn_step", "optimizers",
           "run", "schedule_updates", "seeds_learn_step", "seeds_step", "state_scalars"]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything the RL step's programs read besides their array arguments.

    alg: the resolved algorithm without its name (``AlgorithmConfig.spec()``: the fields,
      and ``loss``, the objective's registry entry), so equal fields give equal specs.
    old_mode: "self" (one update per batch: the ratio's denominator is the current
      policy, stop-gradient), "recompute" (a forward before the updates) or "sampler".
    uses_ref: a KL term needs the frozen reference's log-probs.
    layout: the batch's rows (``rljax.train.learn.layout``: ``Padded`` per row or with
      shared prompts, ``Packed``), their micro-batches per minibatch update (and per
      frozen forward); resolved with the trainer (``rljax.train.programs.paths.
      resolve_layout``), a packed one sized per batch (``Packed.for_rollout``).
    chunk, temperature: the log-prob chunk (``rl.logp_chunk``) and the sampling temperature.
    max_new_tokens: the response budget (Dr.GRPO's constant, overlong shaping): the
      completion width, or a multi-turn episode's model-token budget.
    overlong: DAPO's overlong window in tokens (0 = off).
    policy_gd, value_gd, teacher_gd: the models' graphdefs (value: PPO; teacher: distill).
    optim: the optimiser config; ``schedule_updates`` the updates its schedule spans
      (:func:`schedule_updates`); ``value_lr_ratio`` the value model's learning-rate scale.
    remat: rematerialise each decoder layer in the backward pass.
    paths: the forward paths resolved when the trainer was built
      (:class:`~rljax.train.programs.paths.ForwardPaths`: attention, head form, prompt layout,
      layers); the programs read the head form from it, the prompt layout from ``layout``.
    device_reward: the JAX reward of the one-program step (None: a host reward).
    mesh: the device mesh (None: one device).
    out_shardings: on a mesh, ``(treedef, leaves)`` of the ``(params, opt_state)``
      shardings the program returns (those of the state it updates, so the next step's
      arguments match and their buffers are donated in place).
    trainable: what of the policy trains (``rljax.models.lora.Trainable``: every
      parameter, or its adapters), chosen once with the trainer: its gradients, optimiser
      state and KL reference follow it; the value model trains every parameter.
    """

    alg: AlgorithmSpec
    old_mode: str
    uses_ref: bool
    layout: Layout
    chunk: int
    temperature: float
    max_new_tokens: int
    overlong: int
    policy_gd: Any
    value_gd: Any = None
    teacher_gd: Any = None
    optim: OptimConfig = OptimConfig()
    schedule_updates: int = 1
    value_lr_ratio: float = 1.0
    remat: bool = False
    paths: ForwardPaths = ForwardPaths()
    device_reward: Any = None
    mesh: Any = None
    out_shardings: tuple | None = None
    trainable: Trainable = ALL_PARAMETERS

    @property
    def share_group(self) -> int:
        """G > 1 when rows share their prompt in groups of G and every forward computes it
        once (micro-batches and minibatches then hold whole groups); 1: every row computes
        its prompt (``layout.group``)."""
        return self.layout.group


def schedule_updates(optim: OptimConfig, total: int) -> int:
    """The updates a schedule must span to equal ``make_schedule(optim, total)``: all of
    them for a decay; a constant schedule reads only its warm-up, so runs of any length
    share one program."""
    total = max(int(total), 1)
    return total if optim.schedule != "constant" else max(min(optim.warmup_steps, total), 1)


def optimizers(spec: StepSpec) -> dict:
    """``{"policy": (tx, schedule)[, "value": ...]}`` of the spec (the same objects'
    structure in the trainer's optimiser state and inside the program)."""
    out = {"policy": make_optimizer(spec.optim, spec.schedule_updates)}
    if spec.value_gd is not None:
        out["value"] = make_optimizer(spec.optim, spec.schedule_updates, spec.value_lr_ratio)
    return out


def learn_fn(spec: StepSpec):
    """The pure ``rljax.train.learn.make_learn`` function of the spec: ``(params,
    opt_state, counters, ref_params, ro, kl_coef, key, teacher_params) -> (params,
    opt_state, counters, kl_coef, metrics)``."""
    a = spec.alg
    loss = functools.partial(
        rl_loss, policy_gd=spec.policy_gd, value_gd=spec.value_gd,
        objective=alg.make_objective(a, spec.max_new_tokens), chunk=spec.chunk,
        temperature=spec.temperature, remat=spec.remat, self_old=spec.old_mode == "self",
        use_sampler=alg.uses_sampler_logp(a), entropy_grad=a.entropy_coef != 0.0,
        layout=spec.layout, one_pass=spec.paths.head == "one-pass")
    optims = optimizers(spec)
    return make_learn(spec, loss, {k: v[0] for k, v in optims.items()},
                      {k: v[1] for k, v in optims.items()}, batch_constrainer(spec.mesh))


def state_scalars(state) -> dict:
    """The state's counters, KL coefficient and step: the ``scalars`` argument of every
    step program."""
    return dict(updates=state.updates, nonfinite_run=state.nonfinite_run,
                skipped=state.skipped, kl_coef=state.kl_coef, step=state.step)


def learn_program(spec: StepSpec):
    """The pure learning program ``(params, opt_state, scalars, ref_params, ro, key,
    teacher_params) -> (params, opt_state, scalars, metrics)``: ``scalars`` are the
    state's counters, KL coefficient and step."""
    learn = learn_fn(spec)

    def program(params, opt_state, scalars, ref_params, ro, key, teacher_params):
        counters = (scalars["updates"], scalars["nonfinite_run"], scalars["skipped"])
        params, opt_state, c, kl, m = learn(params, opt_state, counters, ref_params, ro,
                                            scalars["kl_coef"], key, teacher_params)
        m.update(skipped_total=c[2].astype(jnp.float32), nonfinite_run=c[1].astype(jnp.float32))
        out = dict(updates=c[0], nonfinite_run=c[1], skipped=c[2], kl_coef=kl,
                   step=scalars["step"] + 1)
        m["done_steps"] = out["step"].astype(jnp.float32)
        return params, opt_state, out, m

    return program


def _placed(spec: StepSpec, outs: tuple) -> tuple:
    """The program's outputs on the state's shardings (scalars and metrics replicated):
    what ``out_shardings`` would say, from inside the program."""
    params, opt_state, scalars, metrics = outs
    (params, opt_state), scalars, metrics = place_outputs(spec.mesh, spec.out_shardings,
                                                          (params, opt_state), scalars, metrics)
    return params, opt_state, scalars, metrics


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def learn_step(spec: StepSpec, params, opt_state, scalars, ref_params, ro, key,
               teacher_params):
    """The learning program of a host-reward step (parameters and optimiser state
    donated)."""
    return _placed(spec, learn_program(spec)(params, opt_state, scalars, ref_params, ro, key,
                                             teacher_params))


def _fused(spec: StepSpec, decode_spec, params, opt_state, scalars, ref_params, prompts, task,
           key_data, teacher_params):
    """One RL step as a pure function: sample and score with the device reward
    (``rljax.train.programs.device``), then :func:`learn_program`; the returned scalars
    carry the next key data."""
    nxt, k_roll, k_learn = split_step_key(key_data)
    ro = device_rollout(spec.policy_gd, params["policy"], prompts, task, k_roll,
                        spec=decode_spec, reward=spec.device_reward, mesh=spec.mesh)
    params, opt_state, out, m = learn_program(spec)(params, opt_state, scalars, ref_params, ro,
                                                    k_learn, teacher_params)
    return params, opt_state, dict(out, key=nxt), m


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def fused_step(spec: StepSpec, decode_spec, params, opt_state, scalars, ref_params, prompts,
               task, key_data, teacher_params):
    """One RL step with a device reward as one program (``rljax.train.programs.device``;
    ``decode_spec`` is the sampler's static spec)."""
    return _placed(spec, _fused(spec, decode_spec, params, opt_state, scalars, ref_params,
                                prompts, task, key_data, teacher_params))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def seeds_step(spec: StepSpec, decode_spec, params, opt_state, scalars, ref_params, prompts,
               task, key_data, teacher_params):
    """:func:`fused_step` vmapped over a leading seed axis of every argument but the
    teacher's parameters (one device)."""
    step = functools.partial(_fused, spec, decode_spec)
    return jax.vmap(step, in_axes=(0,) * 7 + (None,))(
        params, opt_state, scalars, ref_params, prompts, task, key_data, teacher_params)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def seeds_learn_step(spec: StepSpec, params, opt_state, scalars, ref_params, ro, key,
                     teacher_params):
    """:func:`learn_step` vmapped over a leading seed axis of every argument but the
    teacher's parameters: several seeds' host-source batches learned in one program."""
    learn = jax.vmap(learn_program(spec), in_axes=(0,) * 6 + (None,))
    return _placed(spec, learn(params, opt_state, scalars, ref_params, ro, key, teacher_params))


def run(fn, spec: StepSpec, *args):
    """``fn(spec, *args)`` traced and run under the spec's mesh."""
    with mesh_context(spec.mesh):
        return fn(spec, *args)
