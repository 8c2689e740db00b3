"""Conformance kit for objectives: `check_objective(fn)` in any user's own tests.

An objective (see `rljax.objectives`) must behave well under everything the trainer does
to it: jit, grad, masking, padding, micro-batch accumulation, coefficient schedules and
sharding over a mesh. `check_objective` runs each of those and raises AssertionError with
a message naming the failed property. It checks the objective under each batch the
trainer can give it: with every field, and with only the fields it declares it needs
(`requires`): a run without a KL term passes `ref_logp_BxT=None`, one without a value
model no values, and so on. Typical use, in a user's test file:

    from rljax.testing import check_objective
    def test_my_objective():
        check_objective(functools.partial(my_objective, aggregation="token-mean"))
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from rljax.objectives.batch import OPTIONAL_FIELDS, Coef, ObjectiveBatch
from rljax.objectives.separable import token_separable
from rljax.testing._compare import F32_EPS, compare_outputs, check_failure, float32_rtol
from rljax.testing._harness import Harness, check_mesh, magnitudes, micro_outputs
from rljax.testing._mesh8 import DEVICES, run_in_subprocess
from rljax.testing._separable import check_separable

__all__ = ["F32_EPS", "check_objective", "default_batch", "float32_rtol"]

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



def _check_grads(out, batch: ObjectiveBatch, require_logp_grad: bool) -> None:
    loss_sum, count, metrics, grads = out
    if not (np.isfinite(loss_sum) and np.isfinite(count) and count > 0):
        raise check_failure("finite", f"loss_sum={loss_sum} and count={count} must be finite with count > 0")
    for k, (s, n) in metrics.items():
        if not (np.isfinite(s) and np.isfinite(n)):
            raise check_failure("finite", f"metric {k!r} = ({s}, {n}) is not finite")
    masked = np.asarray(batch.mask_BxT) == 0
    for k, g in grads.items():
        if not np.all(np.isfinite(g)):
            raise check_failure("finite", f"gradient w.r.t. {k} has non-finite entries")
        if np.any(g[masked] != 0):
            raise check_failure("mask", f"masked tokens get nonzero gradient w.r.t. {k} "
                        f"(max |g| {np.abs(g[masked]).max():.3g}); the mask must select them away")
    if require_logp_grad and not np.any(grads["logp_BxT"] != 0):
        raise check_failure("gradient", "the gradient w.r.t. logp_BxT is identically zero")


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


def _check_padding(h: Harness, batch, coef, ref, pad: int, seed: int, rtol: float,
                   scale: dict) -> None:
    T = batch.logp_BxT.shape[1]
    got = h(_pad(batch, pad, seed), coef)
    unpadded = {k: g[:, :T] for k, g in got[3].items()}
    compare_outputs("padding", ref, (*got[:3], unpadded), rtol, scale)
    if any(np.any(g[:, T:] != 0) for g in got[3].values()):
        raise check_failure("padding", "padded (masked) columns get nonzero gradient")


def _check_micro_batches(ref, outs: list, rtol: float, scale: dict) -> None:
    total = (
        sum(o[0] for o in outs),
        sum(o[1] for o in outs),
        {k: (sum(o[2][k][0] for o in outs), sum(o[2][k][1] for o in outs)) for k in ref[2]},
        {k: np.concatenate([o[3][k] for o in outs], axis=0) for k in ref[3]},
    )
    compare_outputs(f"micro-batch x{len(outs)}", ref, total, rtol, scale)


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


def _check_no_recompile(h: Harness, batch, coef) -> None:
    before = h.traces, _cache_size(h.jitted)
    h(batch, _perturb(coef))
    if (h.traces, _cache_size(h.jitted)) != before:
        raise check_failure("recompile", "changing a coefficient's value retraced the objective; "
                    "coefficients must be traced arrays, never Python branches or static values")


#: Why the trainer leaves each optional field None (the message of a failed variant).
_ABSENT_WHEN = {
    "ref_logp_BxT": "a run without a KL term (kl_coef=0 or kl_in='none')",
    "sampler_logp_BxT": "a run without the sampler importance correction",
    "values_BxT": "a run without a value model (every algorithm but PPO)",
    "old_values_BxT": "a run without a value model", "returns_BxT": "a run without a value model",
    "entropy_BxT": "an objective that does not declare it",
    "cov_select_BxT": "algorithms other than clip_cov / kl_cov",
    "teacher_logp_BxT": "a run without a teacher (every algorithm but distill)",
}


def _without(batch: ObjectiveBatch, names: Sequence[str]) -> ObjectiveBatch:
    return dataclasses.replace(batch, **{n: None for n in names})


def _no_kl(coef: Any) -> Any:
    """`coef` as a run without a KL term passes it (`Coef.kl` = 0)."""
    return dataclasses.replace(coef, kl=0.0) if isinstance(coef, Coef) else coef


def _check_batch(h: Harness, batch, coef, mesh, *, micro_batches, pad, rtol, seed,
                 require_logp_grad, recompile: bool = True) -> tuple:
    """Every check on one batch (the mesh check unless `mesh` is None, the recompile
    check if `recompile`); returns the full batch's outputs."""
    try:
        ref = h(batch, coef)
    except _TRACING_ERRORS as e:
        raise check_failure("jit", "the objective fails under jax.jit/jax.grad: "
                    f"{type(e).__name__}: {e}") from e
    _check_grads(ref, batch, require_logp_grad)
    if recompile:
        _check_no_recompile(h, batch, coef)
    tol = float32_rtol(batch) if rtol is None else rtol
    parts = {n: micro_outputs(h, batch, coef, n) for n in micro_batches}
    scale = magnitudes(parts[max(parts)] if parts else [], ref)  # the finest split
    _check_padding(h, batch, coef, ref, pad, seed, tol, scale)
    for n in micro_batches:
        _check_micro_batches(ref, parts[n], tol, scale)
    if mesh is not None:
        check_mesh(h, batch, coef, ref, mesh, tol, scale)
    return ref


def _minimal_fails(h: Harness, batch, coef, absent: Sequence[str], e: Exception) -> AssertionError:
    """The failure of the batch without `absent`, naming the fields whose absence breaks it."""
    culprits = []
    for name in absent:
        try:
            h(_without(batch, [name]), _no_kl(coef) if name == "ref_logp_BxT" else coef)
        except Exception:  # noqa: BLE001 - any failure names the field
            culprits.append(name)
    why = "; ".join(f"{n}=None in {_ABSENT_WHEN[n]}" for n in culprits or absent)
    return check_failure(f"batch without {', '.join(culprits or absent)}",
                 f"{type(e).__name__}: {e}. The trainer passes {why}: handle None, or "
                 f"declare the fields the objective needs, requires={tuple(culprits or absent)} "
                 "(a run must then provide them)")


def check_objective(
    fn: Objective,
    coef: Any = None,
    *,
    batch: ObjectiveBatch | None = None,
    mesh: Any = None,
    micro_batches: tuple[int, ...] = (4,),
    pad: int = 5,
    rtol: float | None = None,
    seed: int | Sequence[int] = 0,
    require_logp_grad: bool = True,
    requires: Sequence[str] = (),
) -> dict[str, Any]:
    """Check that `fn(batch, coef) -> (loss_sum, count, metrics)` honours the contract.

    Checks, in order (each failure is an AssertionError naming the check):
      contract: returns (scalar loss_sum, scalar count, {name: (sum, count)});
      jit: it traces and compiles under `jax.jit` and `jax.grad`;
      finite: loss, count (> 0), metrics and gradients w.r.t. logp_BxT (and values_BxT,
        entropy_BxT when present) are finite;
      mask: masked tokens get exactly zero gradient; gradient: logp_BxT gets some
        (unless require_logp_grad=False);
      recompile: calling with every coefficient changed does not retrace;
      padding: appending `pad` masked columns of junk changes neither the outputs nor
        the gradients;
      micro-batch xN: splitting the batch into N parts along B (N in `micro_batches`,
        default 4) and summing loss sums, counts and metric pairs equals the full batch,
        gradients included;
      mesh: the batch sharded along B over every device of `mesh` (default: all devices
        on one "data" axis) gives the unsharded (one-device) outputs and gradients. In a
        process with one device (or given a one-device mesh) it runs in a child process
        with 8 emulated CPU devices (`rljax.testing._mesh8`; the objective must then
        pickle, i.e. be importable: else the check is skipped with a warning and the
        result's "skipped" says why);
      token_separable: an objective marked token-separable
        (`rljax.objectives.token_separable`: the trainer then takes its gradient in one
        pass over the output head, chunk by chunk) gives the two-pass gradients w.r.t.
        logp_BxT and entropy_BxT when each chunk of ceil(T/3) columns is differentiated
        with the other columns holding other values (the sampler's log-probs, zero
        entropies), as the one-pass head does.
    They run on `batch` (token_separable on the first batch), and all but mesh,
    recompile and token_separable again on `batch` without the
    optional fields the objective does not declare in `requires` (as the trainer passes
    them: no `ref_logp_BxT` in a run without a KL term, where `Coef.kl` is 0 as well, no
    values without a value model, no sampler log-probs without the importance
    correction, no entropy unless declared). A failure there is `[batch without FIELD]`.
    Outputs compare to `rtol` times their magnitude (the sum over the finest micro-batch
    split of each part's |output|, so a total whose parts cancel is judged at the size of
    its terms), gradients
    to `rtol` times the gradient's global norm. `rtol=None` is `float32_rtol(batch)`:
    (B*T) * float32 eps, the worst-case rounding of a float32 sum of the batch's terms.

    Args:
      fn: the objective, static options already bound (functools.partial).
      coef: its coefficients (default `Coef()`); any pytree of numeric leaves.
      batch: an `ObjectiveBatch` (default `default_batch(seed)`: B=16, T=12, all fields).
        B must be divisible by every `micro_batches` entry and by the mesh size.
      seed: the default batch's seed, or several seeds: each batch is checked, sharing
        the compiled programs.
      requires: the optional `ObjectiveBatch` fields the objective needs (e.g.
        ("ref_logp_BxT",) for a KL term it always takes; a run must then provide them).
    Returns:
      {"loss": loss_sum / count, "count": count} of the (first) full batch, "batches":
      the batches checked, "mesh": where the mesh check ran, "token_separable": whether
      the objective is marked so (then checked), "skipped": {check: why} for checks not
      run.
    """
    coef = Coef() if coef is None else coef
    unknown = sorted(set(requires) - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValueError(f"requires={tuple(requires)}: {unknown} are not optional "
                         f"ObjectiveBatch fields; they are {OPTIONAL_FIELDS}")
    seeds = [seed] if isinstance(seed, (int, np.integer)) else list(seed)
    batches = [default_batch(s) for s in seeds] if batch is None else [batch]
    if mesh is None:
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    in_process, skipped = mesh.size > 1, {}
    opts = dict(micro_batches=micro_batches, pad=pad, rtol=rtol,
                require_logp_grad=require_logp_grad)
    h = Harness(fn)
    names, first = [], None
    for s, b in zip(seeds, batches):
        ref = _check_batch(h, b, coef, mesh if in_process else None, seed=s, **opts)
        first = ref if first is None else first
        absent = [n for n in OPTIONAL_FIELDS if getattr(b, n) is not None and n not in requires]
        if not absent:
            continue
        small, small_coef = _without(b, absent), _no_kl(coef) if "ref_logp_BxT" in absent else coef
        try:
            h(small, small_coef)
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001 - named below, with the field that broke it
            raise _minimal_fails(h, b, coef, absent, e) from e
        # The fields present change neither the sharding nor how coefficients are
        # traced: the mesh and recompile checks of the full batch stand for this one.
        _check_batch(h, small, small_coef, None, seed=s, recompile=False, **opts)
        names.append(f"without {', '.join(absent)}")
    separable = token_separable(fn)
    if separable:
        check_separable(h, batches[0], coef, rtol)
    where = f"{mesh.size} devices"
    if not in_process:
        where = f"{DEVICES} emulated CPU devices in a subprocess"
        why = run_in_subprocess(fn, coef, batches, micro_batches=micro_batches, rtol=rtol)
        if why is not None:
            skipped["mesh"], where = why, "not run"
            warnings.warn(f"check_objective: mesh check skipped: {why}", stacklevel=2)
    return {"loss": float(first[0] / first[1]), "count": float(first[1]),
            "batches": ["as given"] + sorted(set(names)), "mesh": where,
            "token_separable": separable, "skipped": skipped}
