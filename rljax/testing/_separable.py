"""check_objective's token_separable check: an objective marked token-separable gives the
same gradients when taken chunk by chunk, as the trainer's one-pass head takes them."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from rljax.objectives.batch import ObjectiveBatch
from rljax.testing._compare import check_failure, compare_grads, float32_rtol

__all__ = ["check_separable"]


def _chunked(h: Callable, batch: ObjectiveBatch, coef: Any, c: int, fill, self_old: bool):
    """Gradients w.r.t. logp_BxT and entropy_BxT, each chunk of `c` columns taken with the
    other columns holding `fill` (log-probs) and zeros (entropies); with `self_old`, the
    old log-probs are the (substituted) current ones, as in a run's first update."""
    t = batch.logp_BxT.shape[1]
    cols = jnp.arange(t)[None, :]
    out = {}
    for start in range(0, t, c):
        chunk = (cols >= start) & (cols < start + c)
        logp = jnp.where(chunk, batch.logp_BxT, fill)
        ent = None if batch.entropy_BxT is None else jnp.where(chunk, batch.entropy_BxT, 0.0)
        b = dataclasses.replace(batch, logp_BxT=logp, entropy_BxT=ent,
                                old_logp_BxT=logp if self_old else batch.old_logp_BxT)
        for k, g in h(b, coef)[3].items():
            if k in ("logp_BxT", "entropy_BxT"):
                out.setdefault(k, np.zeros_like(g))[:, start:start + c] = g[:, start:start + c]
    return out


def check_separable(h: Callable, batch: ObjectiveBatch, coef: Any, rtol: float | None) -> None:
    """AssertionError unless the objective behind `h` (check_objective's harness:
    `h(batch, coef) -> (loss_sum, count, metrics, grads)`) gives its two-pass gradients
    chunk by chunk. The trainer's one-pass head (`rl.one_pass_head`) takes a chunk's
    gradient from the objective with that chunk's log-probs and entropies in place and the
    other columns not yet computed (the sampler's log-probs, zero entropies there), with
    the old log-probs as given or, in an update on fresh samples, the current ones;
    emulated here on chunks of ceil(T/3) columns, both ways."""
    t = batch.logp_BxT.shape[1]
    c = -(-t // 3)
    fill = batch.old_logp_BxT if batch.sampler_logp_BxT is None else batch.sampler_logp_BxT
    tol = float32_rtol(batch) if rtol is None else rtol
    for self_old in (False, True):
        base = dataclasses.replace(batch, old_logp_BxT=batch.logp_BxT) if self_old else batch
        two = {k: g for k, g in h(base, coef)[3].items() if k in ("logp_BxT", "entropy_BxT")}
        try:
            compare_grads("token_separable", two, _chunked(h, base, coef, c, fill, self_old), tol)
        except AssertionError as e:
            old = "the current log-probs (one update per batch)" if self_old else "as given"
            raise check_failure("token_separable", (
                f"it is marked token-separable, so a run forms its gradient in one pass over "
                f"the head, chunk by chunk, before the other chunks' log-probs exist; emulated "
                f"with chunks of {c} of {t} columns and old log-probs {old}, that gradient is "
                f"not the two-pass one ({str(e).split(']: ', 1)[-1]}): its derivative at a "
                "token depends on other tokens (a sequence-level ratio or weight). Remove the "
                "token_separable flag")) from None
