"""PNG plots of a run's metrics (matplotlib, Agg backend: no display needed).

`plot_metrics(records, out_dir)` takes the per-step dicts of `metrics.jsonl` and draws one
PNG per family of metrics that is present — reward, accuracy, KL, entropy, response length,
zero-variance group fraction, throughput — plus `overview.png` with all of them. A metric
belongs to a family by its name (e.g. `reward_mean`, `eval/accuracy`, `kl_ref`,
`response_length_mean`, `zero_variance_fraction`, `rollout_tokens_per_s`); metrics that
appear on only some steps (evaluations) are drawn at the steps where they exist.
"""

from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["PANELS", "metric_series", "plot_metrics"]


def _has(*words: str) -> Callable[[str], bool]:
    pats = [re.compile(rf"(^|[^a-z]){w}", re.IGNORECASE) for w in words]
    return lambda key: any(p.search(key) for p in pats)


# (file stem, title, which metric names belong to it). Order = overview order.
PANELS: tuple[tuple[str, str, Callable[[str], bool]], ...] = (
    ("reward", "Reward", _has("reward", "score")),
    ("accuracy", "Accuracy", _has("acc", "pass")),
    ("kl", "KL", _has("kl")),
    ("entropy", "Entropy", _has("entropy")),
    ("response_length", "Response length (tokens)", _has("response_len", "resp_len", "length", "len_")),
    ("zero_variance", "Zero-variance group fraction", _has("zero_var", "zero_std", "no_signal")),
    ("throughput", "Throughput (tokens/s)", _has("tokens_per_s", "tok_per_s", "tok_s", "tok/s", "throughput")),
)


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def metric_series(records: Iterable[dict[str, Any]], step_key: str = "step") -> dict[str, tuple[list, list]]:
    """`{metric: (steps, values)}` for every finite numeric metric in `records`."""
    series: dict[str, tuple[list, list]] = {}
    for i, rec in enumerate(records):
        step = rec.get(step_key, i)
        for key, value in rec.items():
            if key == step_key or not _finite_number(value):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(step)
            ys.append(float(value))
    return series


def _panel_keys(series: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    out = []
    for stem, title, belongs in PANELS:
        keys = sorted(k for k in series if belongs(k))
        if stem != "zero_variance":  # the zero-variance fraction gets its own panel only
            keys = [k for k in keys if not PANELS[5][2](k)]
        if keys:
            out.append((stem, title, keys))
    return out


def _draw(ax, title: str, keys: Sequence[str], series) -> None:
    for key in keys:
        xs, ys = series[key]
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot_metrics(records: Sequence[dict[str, Any]], out_dir: str | pathlib.Path,
                 *, step_key: str = "step") -> list[pathlib.Path]:
    """Write one PNG per metric family present in `records` and `overview.png`.

    Returns the written paths (empty when no known metric is present).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    series = metric_series(records, step_key)
    panels = _panel_keys(series)
    written = []
    for stem, title, keys in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, title, keys, series)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if panels:
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
        for ax, (stem, title, keys) in zip(axes.flat, panels):
            _draw(ax, title, keys, series)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        fig.tight_layout()
        path = out_dir / "overview.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
