"""check_objective's comparisons: float32-scaled tolerances, relative to each output's
magnitude (outputs) or the gradient's norm (gradients)."""

from __future__ import annotations

import numpy as np

from rljax.objectives.batch import ObjectiveBatch


def check_failure(check: str, msg: str) -> AssertionError:
    return AssertionError(f"check_objective [{check}]: {msg}")


#: float32's machine epsilon: rounding tolerances are multiples of it.
F32_EPS = float(np.finfo(np.float32).eps)


def float32_rtol(batch: ObjectiveBatch) -> float:
    """The default tolerance: float32's worst-case relative rounding of a sum of the batch's
    B*T terms, (B*T) * eps (Higham, "Accuracy and Stability of Numerical Algorithms", §4.2),
    about 2.3e-5 for the default 16 x 12 batch. Outputs are compared relative to their
    magnitude (`_magnitudes`), gradients relative to the gradient's norm."""
    B, T = batch.logp_BxT.shape
    return F32_EPS * B * T


def scalar_values(out) -> dict[str, float]:
    """Loss sum, count and each metric's sum and count of one harness output, by name."""
    loss_sum, count, metrics, _ = out
    d = {"loss_sum": loss_sum, "count": count}
    for k, (m_sum, m_count) in metrics.items():
        d[f"metric {k!r} sum"], d[f"metric {k!r} count"] = m_sum, m_count
    return d


def compare_outputs(check: str, ref, got, rtol: float, scale: dict[str, float]) -> None:
    """Loss sum, count and every metric pair must agree to rtol times their magnitude, and
    the gradients as `compare_grads` says."""
    a, b = scalar_values(ref), scalar_values(got)
    if set(ref[2]) != set(got[2]):
        raise check_failure(check, f"metric names differ: {sorted(ref[2])} vs {sorted(got[2])}")
    for name in a:
        size = max(scale.get(name, 0.0), abs(float(a[name])), abs(float(b[name])))
        if not abs(a[name] - b[name]) <= rtol * size:
            raise check_failure(check, f"{name} is {b[name]!r}, expected {a[name]!r} (allowed "
                        f"{rtol:.3g} x magnitude {size:.4g})")
    compare_grads(check, ref[3], got[3], rtol)


def compare_grads(check: str, g_ref: dict, g: dict, rtol: float) -> None:
    """Gradients must agree to rtol times the reference gradient's global norm."""
    norm = np.sqrt(sum(np.sum(np.square(x)) for x in g_ref.values()))
    for k in g_ref:
        err = np.max(np.abs(g_ref[k] - g[k]))
        if not err <= rtol * norm:
            raise check_failure(check, f"gradient w.r.t. {k} differs by {err:.3g}; allowed {rtol} x |grad| = {rtol * norm:.3g}")
