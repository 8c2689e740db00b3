"""An MoE policy's router in the RL update: the router losses and the routing metrics.

The update's policy forward (``rljax.train.learn.logprobs.completion_hidden``, the packed
forward of ``rljax.train.learn.packing``) hands its MoE layers' stacked
`rljax.models.moe.RouterRecord` to :func:`note` while ``rl_loss`` holds a
:func:`recording` open; ``rl_loss`` then adds :func:`loss_terms`: the router losses
(``MoeConfig.aux_loss_coef`` x Switch load balance + ``z_loss_coef`` x z-loss, both 0 by
default, as in verl and slime) and the metrics. Nothing is recorded outside a recording
(reference, old-policy and value forwards), nor for a dense policy.

The losses are means over a micro-batch's tokens, so each micro-batch adds
``term x count`` to the loss sum: the update's loss gains the count-weighted mean of
the micro-batches' router losses (statistics per micro-batch, as Megatron's load
balancing computes them).

| metric | what |
| --- | --- |
| ``moe/aux_loss``, ``moe/z_loss`` | the Switch load-balance loss and the z-loss (whatever their coefficients), means over updates |
| ``moe/load_max_over_mean`` | the busiest expert's share of the routed choices x E (1: balanced), all MoE layers |
| ``moe/load_max_over_mean_l{i}`` | the same in decoder layer ``i`` |
| ``moe/load_e{j}`` | expert ``j``'s share of the routed choices over all MoE layers (the load histogram) |
| ``moe/routing_agreement`` | routed choices the learner's own top-k holds (1 without replay); first update |
| ``moe/kl_sampler_learner``, ``moe/kl_learner_sampler`` | `rljax.models.moe.mismatch_kl`; first update |

The first update's value of the last three is reported, as for ``sampler_gap``: later
updates measure the policy's own change.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax.numpy as jnp

from rljax.models.moe import aux_loss, mismatch_kl, router_loss, z_loss

__all__ = ["FIRST_UPDATE", "loss_terms", "note", "recording", "wanted"]

#: Metrics whose first update's value the step reports (``_updates``).
FIRST_UPDATE = ("moe/routing_agreement", "moe/kl_sampler_learner", "moe/kl_learner_sampler")

_RECORDS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "rljax_router_records", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collect the ``(record, model config)`` pairs :func:`note` receives inside."""
    records: list = []
    token = _RECORDS.set(records)
    try:
        yield records
    finally:
        _RECORDS.reset(token)


def wanted(model) -> bool:
    """Whether a forward of ``model`` should hand its router record to :func:`note`: a
    recording is open and ``model`` is an MoE decoder."""
    config = getattr(model, "config", None)
    return (_RECORDS.get() is not None and getattr(config, "moe", None) is not None
            and hasattr(model, "routed_hidden_states"))


def note(rec, config) -> None:
    """Hand a forward's stacked `RouterRecord` (and its ``ModelConfig``) to the open
    recording; nothing without one or without a record."""
    records = _RECORDS.get()
    if records is not None and rec is not None:
        records.append((rec, config))


def _share(load_xE):
    return load_xE / jnp.maximum(jnp.sum(load_xE, axis=-1, keepdims=True), 1.0)


def _metrics(rec, config, logp_BxT, sampler_logp_BxT, mask_BxT) -> dict:
    """The module's metrics as ``(sum, count)`` pairs of one micro-batch."""
    one = jnp.float32(1.0)
    load_E = jnp.sum(rec.load_E, axis=0)
    e, k = load_E.shape[-1], rec.ids_BxTxK.shape[-1]
    out = {"moe/aux_loss": (aux_loss(rec), one), "moe/z_loss": (z_loss(rec), one),
           "moe/load_max_over_mean": (jnp.max(_share(load_E)) * e, one),
           "moe/routing_agreement": (jnp.sum(rec.agree), k * jnp.sum(rec.tokens))}
    layers = [i for i, is_moe in enumerate(config.moe_layers) if is_moe]
    per_layer = jnp.max(_share(rec.load_E), axis=-1) * e
    out.update({f"moe/load_max_over_mean_l{i}": (per_layer[n], one)
                for n, i in enumerate(layers)})
    total = jnp.sum(load_E)
    out.update({f"moe/load_e{j}": (load_E[j], total) for j in range(e)})
    n = jnp.sum(mask_BxT)
    out.update({name: (v * n, n) for name, v in
                mismatch_kl(sampler_logp_BxT, logp_BxT, mask_BxT).items()})
    return out


def loss_terms(records: list, count, logp_BxT, sampler_logp_BxT,
               mask_BxT) -> tuple[Any, dict]:
    """``(loss sum to add, metrics)`` of one micro-batch from its recording: the router
    losses x ``count`` (the objective's count) and the module's metrics; ``(0.0, {})``
    for a dense policy. ``logp_BxT``: the policy's log-probs of the sampled tokens."""
    if not records:
        return 0.0, {}
    if len(records) > 1:
        raise ValueError(f"router.loss_terms: {len(records)} policy forwards were recorded "
                         "in one micro-batch loss; expected one")
    rec, config = records[0]
    term = router_loss(rec, config.moe) * count
    return term, _metrics(rec, config, logp_BxT, sampler_logp_BxT, mask_BxT)
