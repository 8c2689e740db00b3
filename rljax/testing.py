"""Conformance kit for objectives: `check_objective(fn)` in any user's own tests.

An objective (see `rljax.objectives`) must behave well under everything the trainer does
to it: jit, grad, masking, padding, micro-batch accumulation, coefficient schedules and
sharding over a mesh. `check_objective` runs each of those and raises AssertionError with
a message naming the failed property. Typical use, in a user's test file:

    from rljax.testing import check_objective
    def test_my_objective():
        check_objective(functools.partial(my_objective, aggregation="token-mean"))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from rljax.objectives.batch import DIFFERENTIABLE_FIELDS, Coef, ObjectiveBatch

__all__ = ["check_objective", "default_batch"]

Objective = Callable[[ObjectiveBatch, Any], tuple[Any, Any, dict]]


# Errors that mean "this code is not jit-compatible" (Python control flow on traced
# values, leaked tracers); ValueError/TypeError from bad input pass through unchanged.
_TRACING_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.UnexpectedTracerError,
)


def _fail(check: str, msg: str) -> AssertionError:
    return AssertionError(f"check_objective [{check}]: {msg}")


def default_batch(seed: int = 0, *, B: int = 16, T: int = 12, values: bool = True,
                  ref: bool = True, sampler: bool = True, entropy: bool = True) -> ObjectiveBatch:
    """A random `ObjectiveBatch` with right-padded masks and junk at masked positions.

    Sequence lengths are 1..T (several rows have masked tails, one is full). Ratios
    pi/pi_old spread over about [0.5, 2] so clipping is exercised; advantages are mixed in
    sign. Masked positions hold finite junk, unrelated to the real values, so an objective
    that reads them is caught. Optional fields are present unless switched off.
    """
    rng = np.random.default_rng(seed)
    len_B = rng.integers(1, T + 1, size=B)
    len_B[0] = T
    mask = (np.arange(T)[None, :] < len_B[:, None]).astype(np.float32)

    def field(x):  # real values where mask is 1, junk elsewhere
        junk = rng.normal(0.0, 3.0, size=(B, T))
        return jnp.asarray(np.where(mask > 0, x, junk), jnp.float32)

    logp = -np.log1p(np.exp(rng.normal(0.0, 1.5, size=(B, T))))
    noise = lambda s: rng.normal(0.0, s, size=(B, T))  # noqa: E731
    values_BxT = rng.normal(size=(B, T))
    return ObjectiveBatch(
        logp_BxT=field(logp),
        old_logp_BxT=field(logp + noise(0.35)),
        mask_BxT=jnp.asarray(mask),
        adv_BxT=field(rng.normal(size=(B, T))),
        ref_logp_BxT=field(logp + noise(0.3)) if ref else None,
        sampler_logp_BxT=field(logp + noise(0.35) + noise(0.1)) if sampler else None,
        values_BxT=field(values_BxT) if values else None,
        old_values_BxT=field(values_BxT + noise(0.3)) if values else None,
        returns_BxT=field(rng.normal(size=(B, T))) if values else None,
        entropy_BxT=field(np.log1p(np.exp(rng.normal(size=(B, T))))) if entropy else None,
    )


def _split(batch: ObjectiveBatch) -> dict[str, Any]:
    """The fields gradients are taken with respect to (those present)."""
    return {n: getattr(batch, n) for n in DIFFERENTIABLE_FIELDS if getattr(batch, n) is not None}


class _Harness:
    """One jitted (loss pieces, gradient of loss_sum) function, with a trace counter."""

    def __init__(self, fn: Objective):
        self.traces = 0

        def loss_sum(diff, batch, coef):
            self.traces += 1  # runs only while tracing: counts (re)compilations
            out = fn(dataclasses.replace(batch, **diff), coef)
            _check_structure(out)
            loss_sum, count, metrics = out
            return loss_sum, (loss_sum, count, metrics)

        self.jitted = jax.jit(jax.grad(loss_sum, has_aux=True))

    def __call__(self, batch: ObjectiveBatch, coef: Any):
        grads, (loss_sum, count, metrics) = self.jitted(_split(batch), batch, coef)
        to_np = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)  # noqa: E731
        return to_np(loss_sum), to_np(count), to_np(metrics), to_np(grads)


def _check_structure(out: Any) -> None:
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], dict)):
        raise _fail("contract", f"must return (loss_sum, count, metrics: dict); got {type(out).__name__}")
    for name, x in (("loss_sum", out[0]), ("count", out[1])):
        if jnp.shape(x) != ():
            raise _fail("contract", f"{name} must be a scalar; got shape {jnp.shape(x)}")
    for k, v in out[2].items():
        if not (isinstance(v, tuple) and len(v) == 2 and all(jnp.shape(x) == () for x in v)):
            raise _fail("contract", f"metric {k!r} must be a (sum, count) pair of scalars")


def _close(a: np.ndarray, b: np.ndarray, rtol: float) -> bool:
    return bool(np.all(np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b))))


def _compare_outputs(check: str, ref, got, rtol: float) -> None:
    """Loss sum, count and every metric pair must agree to rtol."""
    (l0, c0, m0, _), (l1, c1, m1, _) = ref, got
    pairs = [("loss_sum", l0, l1), ("count", c0, c1)]
    if set(m0) != set(m1):
        raise _fail(check, f"metric names differ: {sorted(m0)} vs {sorted(m1)}")
    for k in m0:
        pairs += [(f"metric {k!r} sum", m0[k][0], m1[k][0]), (f"metric {k!r} count", m0[k][1], m1[k][1])]
    for name, a, b in pairs:
        if not _close(a, b, rtol):
            raise _fail(check, f"{name} is {b!r}, expected {a!r} (rtol {rtol})")


def _compare_grads(check: str, g_ref: dict, g: dict, rtol: float) -> None:
    """Gradients must agree to rtol times the reference gradient's global norm."""
    norm = np.sqrt(sum(np.sum(np.square(x)) for x in g_ref.values()))
    for k in g_ref:
        err = np.max(np.abs(g_ref[k] - g[k]))
        if not err <= rtol * norm:
            raise _fail(check, f"gradient w.r.t. {k} differs by {err:.3g}; allowed {rtol} x |grad| = {rtol * norm:.3g}")


def _check_grads(out, batch: ObjectiveBatch, require_logp_grad: bool) -> None:
    loss_sum, count, metrics, grads = out
    if not (np.isfinite(loss_sum) and np.isfinite(count) and count > 0):
        raise _fail("finite", f"loss_sum={loss_sum} and count={count} must be finite with count > 0")
    for k, (s, n) in metrics.items():
        if not (np.isfinite(s) and np.isfinite(n)):
            raise _fail("finite", f"metric {k!r} = ({s}, {n}) is not finite")
    masked = np.asarray(batch.mask_BxT) == 0
    for k, g in grads.items():
        if not np.all(np.isfinite(g)):
            raise _fail("finite", f"gradient w.r.t. {k} has non-finite entries")
        if np.any(g[masked] != 0):
            raise _fail("mask", f"masked tokens get nonzero gradient w.r.t. {k} "
                        f"(max |g| {np.abs(g[masked]).max():.3g}); the mask must select them away")
    if require_logp_grad and not np.any(grads["logp_BxT"] != 0):
        raise _fail("gradient", "the gradient w.r.t. logp_BxT is identically zero")


def _pad(batch: ObjectiveBatch, pad: int, seed: int) -> ObjectiveBatch:
    """Append `pad` masked columns holding finite junk to every field."""
    rng = np.random.default_rng(seed + 1)

    def one(name, x):
        if x is None:
            return None
        B = x.shape[0]
        extra = np.zeros((B, pad)) if name == "mask_BxT" else rng.normal(0.0, 3.0, (B, pad))
        return jnp.concatenate([x, jnp.asarray(extra, x.dtype)], axis=1)

    return dataclasses.replace(batch, **{f.name: one(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)})


def _rows(batch: ObjectiveBatch, lo: int, hi: int) -> ObjectiveBatch:
    return jax.tree.map(lambda x: x[lo:hi], batch)


def _check_padding(h: _Harness, batch, coef, ref, pad: int, seed: int, rtol: float) -> None:
    T = batch.logp_BxT.shape[1]
    got = h(_pad(batch, pad, seed), coef)
    _compare_outputs("padding", ref, got, rtol)
    _compare_grads("padding", ref[3], {k: g[:, :T] for k, g in got[3].items()}, rtol)
    if any(np.any(g[:, T:] != 0) for g in got[3].values()):
        raise _fail("padding", "padded (masked) columns get nonzero gradient")


def _check_micro_batches(h: _Harness, batch, coef, ref, n_micro: int, rtol: float) -> None:
    B = batch.logp_BxT.shape[0]
    outs = [h(_rows(batch, i * B // n_micro, (i + 1) * B // n_micro), coef) for i in range(n_micro)]
    total = (
        sum(o[0] for o in outs),
        sum(o[1] for o in outs),
        {k: (sum(o[2][k][0] for o in outs), sum(o[2][k][1] for o in outs)) for k in ref[2]},
        {k: np.concatenate([o[3][k] for o in outs], axis=0) for k in ref[3]},
    )
    check = f"micro-batch x{n_micro}"
    _compare_outputs(check, ref, total, rtol)
    _compare_grads(check, ref[3], total[3], rtol)


def _perturb_leaf(x: Any) -> Any:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.ndarray, np.generic, jax.Array)):
        return x
    if isinstance(x, (int, float)):
        return 1.5 * x + 0.05 if np.isfinite(x) else x
    a = np.asarray(x)
    return np.where(np.isfinite(a), 1.5 * a + 0.05, a).astype(a.dtype)


def _perturb(coef: Any) -> Any:
    """Every finite number in `coef` changed (x -> 1.5 x + 0.05), types and dtypes kept.

    Dataclass fields are replaced one by one, so a coefficient a user made static pytree
    metadata (which `tree.map` would not visit) changes too and is caught retracing.
    """
    if dataclasses.is_dataclass(coef) and not isinstance(coef, type):
        fields = {f.name: _perturb(getattr(coef, f.name)) for f in dataclasses.fields(coef) if f.init}
        return dataclasses.replace(coef, **fields)
    if isinstance(coef, (list, tuple, dict)) or coef is None:
        return jax.tree.map(_perturb_leaf, coef)
    return _perturb_leaf(coef)


def _cache_size(jitted) -> int:
    # jax 0.10's jitted functions count their compiled executables in `_cache_size()`
    # (private, hence optional); the trace counter alone already catches retracing.
    size = getattr(jitted, "_cache_size", None)
    return size() if callable(size) else -1


def _check_no_recompile(h: _Harness, batch, coef) -> None:
    before = h.traces, _cache_size(h.jitted)
    h(batch, _perturb(coef))
    if (h.traces, _cache_size(h.jitted)) != before:
        raise _fail("recompile", "changing a coefficient's value retraced the objective; "
                    "coefficients must be traced arrays, never Python branches or static values")


def _default_mesh():
    n = jax.device_count()
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))


def _check_mesh(h: _Harness, batch, coef, ref, mesh, rtol: float) -> None:
    """`ref` is the unsharded run (one device); the sharded run must match it."""
    B = batch.logp_BxT.shape[0]
    if B % mesh.size:
        raise ValueError(f"batch size B={B} must be divisible by the mesh's {mesh.size} devices")
    rows = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    sharded = (jax.device_put(batch, rows), jax.device_put(coef, NamedSharding(mesh, P())))
    got = h(*sharded)
    check = f"mesh ({mesh.size} devices)"
    _compare_outputs(check, ref, got, rtol)
    _compare_grads(check, ref[3], got[3], rtol)


def check_objective(
    fn: Objective,
    coef: Any = None,
    *,
    batch: ObjectiveBatch | None = None,
    mesh: Any = None,
    micro_batches: tuple[int, ...] = (4,),
    pad: int = 5,
    rtol: float = 1e-6,
    seed: int = 0,
    require_logp_grad: bool = True,
) -> dict[str, float]:
    """Check that `fn(batch, coef) -> (loss_sum, count, metrics)` honours the contract.

    Checks, in order (each failure is an AssertionError naming the check):
      contract: returns (scalar loss_sum, scalar count, {name: (sum, count)});
      jit: it traces and compiles under `jax.jit` and `jax.grad`;
      finite: loss, count (> 0), metrics and gradients w.r.t. logp_BxT (and values_BxT,
        entropy_BxT when present) are finite;
      mask: masked tokens get exactly zero gradient; gradient: logp_BxT gets some
        (unless require_logp_grad=False);
      padding: appending `pad` masked columns of junk changes neither the outputs nor
        the gradients (rtol);
      micro-batch xN: splitting the batch into N parts along B (N in `micro_batches`,
        default 4) and summing loss sums, counts and metric pairs equals the full batch,
        gradients included (rtol);
      recompile: calling with every coefficient changed does not retrace;
      mesh: the batch sharded along B over every device of `mesh` (default: all devices
        on one "data" axis) gives the unsharded (one-device) outputs and gradients.
    Outputs compare with relative tolerance `rtol`; gradients to `rtol` times the
    gradient's global norm.

    Args:
      fn: the objective, static options already bound (functools.partial).
      coef: its coefficients (default `Coef()`); any pytree of numeric leaves.
      batch: an `ObjectiveBatch` (default `default_batch(seed)`: B=16, T=12, all fields).
        B must be divisible by every `micro_batches` entry and by the mesh size.
    Returns:
      {"loss": loss_sum / count, "count": count} of the full batch, for information.
    """
    coef = Coef() if coef is None else coef
    batch = default_batch(seed) if batch is None else batch
    h = _Harness(fn)
    try:
        ref = h(batch, coef)
    except _TRACING_ERRORS as e:
        raise _fail("jit", f"the objective fails under jax.jit/jax.grad: {type(e).__name__}: {e}") from e
    _check_grads(ref, batch, require_logp_grad)
    _check_no_recompile(h, batch, coef)
    _check_padding(h, batch, coef, ref, pad, seed, rtol)
    for n in micro_batches:
        if batch.logp_BxT.shape[0] % n:
            raise ValueError(f"micro_batches entry {n} does not divide B={batch.logp_BxT.shape[0]}")
        _check_micro_batches(h, batch, coef, ref, n, rtol)
    _check_mesh(h, batch, coef, ref, _default_mesh() if mesh is None else mesh, rtol)
    return {"loss": float(ref[0] / ref[1]), "count": float(ref[1])}
