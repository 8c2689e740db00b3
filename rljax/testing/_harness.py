"""The pieces of ``check_objective`` that its 8-device subprocess
(``rljax.testing._mesh8``) runs too: the jitted harness around an objective, its output
contract, micro-batch outputs and their magnitudes, and the sharded comparison."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax.objectives.batch import DIFFERENTIABLE_FIELDS, ObjectiveBatch
from rljax.testing._compare import check_failure, compare_outputs, scalar_values

__all__ = ["Harness", "check_mesh", "check_structure", "magnitudes", "micro_outputs"]

Objective = Callable[[ObjectiveBatch, Any], tuple[Any, Any, dict]]


class Harness:
    """One jitted (loss pieces, gradient of loss_sum) function, with a trace counter."""

    def __init__(self, fn: Objective):
        self.traces = 0

        def loss_sum(diff, batch, coef):
            self.traces += 1  # runs only while tracing: counts (re)compilations
            out = fn(dataclasses.replace(batch, **diff), coef)
            check_structure(out)
            loss_sum, count, metrics = out
            return loss_sum, (loss_sum, count, metrics)

        self.jitted = jax.jit(jax.grad(loss_sum, has_aux=True))

    def __call__(self, batch: ObjectiveBatch, coef: Any):
        diff = {n: getattr(batch, n) for n in DIFFERENTIABLE_FIELDS  # those present
                if getattr(batch, n) is not None}
        grads, (loss_sum, count, metrics) = self.jitted(diff, batch, coef)
        to_np = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)  # noqa: E731
        return to_np(loss_sum), to_np(count), to_np(metrics), to_np(grads)


def check_structure(out: Any) -> None:
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], dict)):
        raise check_failure("contract", f"must return (loss_sum, count, metrics: dict); got {type(out).__name__}")
    for name, x in (("loss_sum", out[0]), ("count", out[1])):
        if jnp.shape(x) != ():
            raise check_failure("contract", f"{name} must be a scalar; got shape {jnp.shape(x)}")
    for k, v in out[2].items():
        if not (isinstance(v, tuple) and len(v) == 2 and all(jnp.shape(x) == () for x in v)):
            raise check_failure("contract", f"metric {k!r} must be a (sum, count) pair of scalars")


def magnitudes(parts: list, ref) -> dict[str, float]:
    """Each output's scale for the tolerance: the sum over the micro-batch `parts` of
    |the part's output|, at least |the full batch's output|. A loss sum whose parts cancel
    is then compared at the size of its terms, where float32 rounds, not at the size of
    its small total."""
    sums = [scalar_values(p) for p in parts]
    return {k: max(abs(float(v)), sum(abs(float(p[k])) for p in sums))
            for k, v in scalar_values(ref).items()}


def micro_outputs(h: Harness, batch, coef, n_micro: int) -> list:
    B = batch.logp_BxT.shape[0]
    if B % n_micro:
        raise ValueError(f"micro_batches entry {n_micro} does not divide B={B}")
    return [h(jax.tree.map(lambda x: x[i * B // n_micro:(i + 1) * B // n_micro], batch), coef)
            for i in range(n_micro)]


def check_mesh(h: Harness, batch, coef, ref, mesh, rtol: float, scale: dict) -> None:
    """`ref` is the unsharded run (one device); the sharded run must match it."""
    B = batch.logp_BxT.shape[0]
    if B % mesh.size:
        raise ValueError(f"batch size B={B} must be divisible by the mesh's {mesh.size} devices")
    rows = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    sharded = (jax.device_put(batch, rows), jax.device_put(coef, NamedSharding(mesh, P())))
    compare_outputs(f"mesh ({mesh.size} devices)", ref, h(*sharded), rtol, scale)
