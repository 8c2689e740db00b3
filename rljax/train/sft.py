"""Supervised fine-tuning: masked next-token loss on completion tokens only.

    L(θ) = - Σ_b Σ_t m_bt log π_θ(y_bt | x_b, y_b<t) / Σ_b Σ_t m_bt

(token-mean over completion tokens; prompt tokens carry no loss). ``m`` is the batch's
``loss_mask_BxT`` where it has one (a multi-turn trace: a tool's output is attended to,
not trained on; ``rljax.train.batching.encode_traces``), else its completion mask. Uses the same
micro-batched, sharded, donated update step as RL (`rljax.train.learn.update.Learner`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from rljax.models.lora import trainable_of
from rljax.sharding import mesh_context, output_shardings, place_outputs, put_on
from rljax.train.config import SFTConfig
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.learn.micro import loss_mask
from rljax.train.learn.update import (Learner, TrainState, batch_constrainer, make_optimizer,
                                      make_update, new_train_state)


def sft_loss(graphdef, params, mb: dict, coef=None, *, chunk: int = 256, remat: bool = False):
    """``(loss_sum, count, metrics)`` of the masked completion NLL for one micro-batch.

    ``params`` is ``{"policy": state}``; metrics (token means): ``nll``, ``p_gt_half``
    (fraction of target tokens given probability > 0.5, a cheap stand-in for argmax
    accuracy without full logits) and ``entropy``.
    """
    logp_BxT, ent_BxT = policy_logprobs(graphdef, params["policy"], mb, chunk=chunk, remat=remat)
    m_BxT = loss_mask(mb)
    nll_sum = -jnp.sum(jnp.where(m_BxT > 0, logp_BxT, 0.0))
    count = jnp.sum(m_BxT)
    confident = jnp.sum(jnp.where(m_BxT > 0, (logp_BxT > jnp.log(0.5)).astype(jnp.float32), 0.0))
    ent = jnp.sum(jnp.where(m_BxT > 0, ent_BxT, 0.0))
    metrics = {"nll": (nll_sum, count), "p_gt_half": (confident, count),
               "entropy": (jax.lax.stop_gradient(ent), count)}
    return nll_sum, count, metrics


def sft_loss_fn(graphdef, cfg: SFTConfig):
    """:func:`sft_loss` of ``graphdef`` with the config's chunk and remat bound."""
    return functools.partial(sft_loss, graphdef, chunk=cfg.logp_chunk, remat=cfg.remat)


def sft_optimizers(cfg: SFTConfig) -> dict:
    """``{"policy": (tx, schedule)}``: the config's optimiser over ``cfg.steps`` updates."""
    return {"policy": make_optimizer(cfg.optim, max(cfg.steps, 1))}


def sft_trainables(graphdef) -> dict:
    """``{"policy": filter}``: what of the model ``graphdef`` trains (its adapters when it
    has them, ``rljax.models.lora.trainable_of``)."""
    return {"policy": trainable_of(graphdef)}


def sft_update_fn(graphdef, cfg: SFTConfig, num_micro: int, mesh=None):
    """The pure SFT update ``(params, opt_state, counters, batch, coef) -> (params,
    opt_state, counters, metrics)`` (``rljax.train.learn.update.make_update`` of :func:`sft_loss`
    with the config's optimiser)."""
    tx, schedule = sft_optimizers(cfg)["policy"]
    return make_update(sft_loss_fn(graphdef, cfg), {"policy": tx}, {"policy": schedule},
                       num_micro, batch_constrainer(mesh), trainables=sft_trainables(graphdef))


@dataclasses.dataclass(frozen=True)
class SFTSpec:
    """Everything the SFT update reads besides its arrays: the model's graphdef, the SFT
    config (loss chunking, remat, optimiser and schedule), the micro-batch count, the mesh
    and, on a mesh, the state's shardings (``rljax.sharding.output_shardings``)."""

    graphdef: Any
    cfg: SFTConfig
    num_micro: int
    mesh: Any = None
    out_shardings: tuple | None = None


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def sft_update(spec: SFTSpec, params, opt_state, counters, batch, coef):
    """One SFT update (``rljax.train.learn.update.make_update`` of :func:`sft_loss`), parameters
    and optimiser state donated: JAX's cache shares it between trainers with equal specs
    (the demo's SFT baseline continues its warm-up with the warm-up's program)."""
    update = sft_update_fn(spec.graphdef, spec.cfg, spec.num_micro, spec.mesh)
    params, opt_state, counters, metrics = update(params, opt_state, counters, batch, coef)
    (params, opt_state), counters, metrics = place_outputs(
        spec.mesh, spec.out_shardings, (params, opt_state), counters, metrics)
    return params, opt_state, counters, metrics


@functools.partial(jax.jit, static_argnums=(0, 1))
def sft_eval(graphdef, cfg: SFTConfig, params, batch):
    """``(loss_sum, count)`` of :func:`sft_loss` on ``batch`` (no update)."""
    return sft_loss_fn(graphdef, cfg)(params, batch)[:2]


class SFTTrainer:
    """SFT of a decoder given as ``(graphdef, params)``.

    Usage::

        tr = SFTTrainer(graphdef, cfg, mesh=mesh)
        state = tr.init_state(params, seed=0)
        state, metrics = tr.step(state, batch)      # batch from batching.encode_pairs
        loss = tr.eval_loss(state, heldout_batch)
    """

    def __init__(self, graphdef, cfg: SFTConfig, *, mesh=None):
        if not isinstance(cfg, SFTConfig):
            raise TypeError(f"SFTTrainer: cfg must be an SFTConfig, got {type(cfg).__name__}")
        self.graphdef, self.cfg, self.mesh = graphdef, cfg, mesh
        self.learner = Learner(sft_loss_fn(graphdef, cfg), sft_optimizers(cfg),
                               micro_batch_size=cfg.micro_batch_size,
                               max_nonfinite=cfg.max_nonfinite_steps, mesh=mesh,
                               program_for=self._program, trainables=sft_trainables(graphdef))

    def _program(self, state: TrainState, num_micro: int):
        """The update of ``state`` (``sft_update`` of this trainer's spec), its arguments
        placed as the program returns them."""
        spec = SFTSpec(self.graphdef, self.cfg, num_micro, self.mesh,
                       output_shardings(self.mesh, (state.params, state.opt_state)))

        def update(params, opt_state, counters, batch, coef):
            params, opt_state = put_on((params, opt_state), spec.out_shardings)
            with mesh_context(self.mesh):
                return sft_update(spec, params, opt_state, counters, batch, coef)
        return update

    def init_state(self, params, seed: int = 0) -> TrainState:
        """A fresh state (new AdamW moments) around the policy ``params``; it takes
        ownership of them (updates donate their buffers)."""
        p = {"policy": params}
        # On a mesh the counters are replicated global arrays, as the update returns them:
        # plain arrays made the second step compile the update a second time.
        return new_train_state(p, self.learner.init_opt_state(p), seed, mesh=self.mesh)

    def step(self, state: TrainState, batch: dict):
        """One SFT update; returns ``(state, metrics: dict[str, float])``."""
        state, m = self.learner.update(state, batch, None, what="SFT batch")
        state = dataclasses.replace(state, step=state.step + 1)
        return state, {k: float(v) for k, v in m.items()}

    def eval_loss(self, state_or_params, batch: dict) -> float:
        """Token-mean completion NLL of ``batch`` (no update)."""
        params = state_or_params.params if isinstance(state_or_params, TrainState) else (
            {"policy": state_or_params})
        with mesh_context(self.mesh):
            s, c = sft_eval(self.graphdef, self.cfg, params, self.learner.put_batch(batch))
        return float(s) / max(float(c), 1.0)
