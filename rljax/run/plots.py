"""PNG plots of a run's metrics (matplotlib, Agg backend: no display needed).

`plot_metrics(records, out_dir)` takes the per-step dicts of `metrics.jsonl` and draws one
PNG per family of metrics that is present — reward, accuracy, loss, gradient norm,
learning rate, clip fraction, KL, entropy, response length, zero-variance group fraction,
throughput, a multi-turn run's episode metrics and their seconds — plus `overview.png`
with all of them. A metric belongs to a family by its name (e.g. `reward_mean`,
`eval/accuracy`, `loss`, `grad_norm`, `lr`, `clip_frac_high`, `kl_ref`,
`response_length_mean`, `zero_variance_fraction`, `rollout_tokens_per_s`, `env/turns`,
`env/tool_s`; `env/tool_tokens_mean` is a length);
timings (`time_*`) belong to none. Metrics that appear on only some steps (evaluations)
are drawn at the steps where they exist. Records of a phase that counts its own steps (the
SFT warm-up, `phase: "sft"`) get panels of their own (`sft_accuracy.png`, ...), so its
steps never share an axis with the RL steps. Records with a `seed` field (a several-seed
run, `rljax.run.seed_runs`) give one curve per seed (`reward_mean [seed 1]`). A curve
equal to another in its panel at every step (`reward/accuracy` and `reward_mean` with one
reward term) is drawn once, labelled with both names (`reward/accuracy, reward_mean
(identical)`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from etils import epath

__all__ = ["OWN_STEP_PHASES", "PANELS", "SEED_KEY", "metric_series", "plot_metrics"]


def _has(*words: str) -> Callable[[str], bool]:
    pats = [re.compile(rf"(^|[^a-z]){w}", re.IGNORECASE) for w in words]
    return lambda key: any(p.search(key) for p in pats)


_ENV = re.compile(r"(^|/)env/")  # multi-turn episode metrics (rljax.envs), eval/env/... too
_ENV_SECONDS = re.compile(r"(^|/)env/\w+_s\b")  # env/env_s, env/tool_s


def _env_counts(key: str) -> bool:
    return bool(_ENV.search(key)) and not _ENV_SECONDS.search(key) and "tool_tokens" not in key


# (file stem, title, which metric names belong to it). Order = overview order.
PANELS: tuple[tuple[str, str, Callable[[str], bool]], ...] = (
    ("reward", "Reward", _has("reward", "score")),
    ("accuracy", "Accuracy", _has("acc", "pass")),
    ("loss", "Loss", _has("loss")),
    ("grad_norm", "Gradient norm", _has("grad_norm")),
    ("lr", "Learning rate", _has("lr")),
    ("clip_fraction", "Clip fraction", _has("clip_frac")),
    ("kl", "KL", _has("kl")),
    ("entropy", "Entropy", _has("entropy")),
    ("response_length", "Response length (tokens)",
     _has("response_len", "resp_len", "length", "len_", "tool_tokens")),
    ("zero_variance", "Zero-variance group fraction", _has("zero_var", "zero_std", "no_signal")),
    ("throughput", "Throughput (tokens/s)", _has("tokens_per_s", "tok_per_s", "tok_s", "tok/s", "throughput")),
    ("env", "Environment (per episode)", _env_counts),
    ("env_time", "Environment time (s)", lambda key: bool(_ENV_SECONDS.search(key))),
)


# Phases whose records count their own steps (``RunDir.log(..., phase="sft")``): plotted apart.
OWN_STEP_PHASES: tuple[str, ...] = ("sft",)


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


SEED_KEY = "seed"  # a several-seed run's records name their seed (not a metric)


def metric_series(records: Iterable[dict[str, Any]], step_key: str = "step") -> dict[str, tuple[list, list]]:
    """`{metric: (steps, values)}` for every finite numeric metric in `records`; a record
    with a `seed` field gives the series `"<metric> [seed <seed>]"`."""
    series: dict[str, tuple[list, list]] = {}
    for i, rec in enumerate(records):
        step = rec.get(step_key, i)
        tag = f" [seed {rec[SEED_KEY]}]" if SEED_KEY in rec else ""
        for key, value in rec.items():
            if key in (step_key, SEED_KEY) or not _finite_number(value):
                continue
            xs, ys = series.setdefault(key + tag, ([], []))
            xs.append(step)
            ys.append(float(value))
    return series


def _is_timing(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith("time_")


def _panel_keys(series: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    out, zero_variance = [], next(b for s, _, b in PANELS if s == "zero_variance")
    for stem, title, belongs in PANELS:
        keys = sorted(k for k in series if belongs(k) and not _is_timing(k))
        if stem != "zero_variance":  # the zero-variance fraction gets its own panel only
            keys = [k for k in keys if not zero_variance(k)]
        if keys:
            out.append((stem, title, keys))
    return out


def _distinct(keys: Sequence[str], series) -> list[tuple[str, str]]:
    """`(key, label)` of the panel's curves, a curve equal to an earlier one dropped and
    its name added to that one's label, `"a, b (identical)"` (duplicates would hide each
    other; `a = b` read as an equation between the metrics)."""
    kept: list[tuple[str, list[str]]] = []
    for key in keys:
        same = next((names for k, names in kept if series[k] == series[key]), None)
        if same is None:
            kept.append((key, [key]))
        else:
            same.append(key)
    return [(k, names[0] if len(names) == 1 else ", ".join(names) + " (identical)")
            for k, names in kept]


def _panels(records: Sequence[dict[str, Any]], step_key: str):
    """``(stem, title, keys, series, x label)`` per panel: the run's own steps first, then
    each phase of ``OWN_STEP_PHASES`` present."""
    groups = [("", "", step_key, [r for r in records if r.get("phase") not in OWN_STEP_PHASES])]
    for phase in OWN_STEP_PHASES:
        recs = [r for r in records if r.get("phase") == phase]
        groups.append((f"{phase}_", f"{phase.upper()}: ", f"{phase} {step_key}", recs))
    panels = []
    for stem_prefix, title_prefix, xlabel, recs in groups:
        series = metric_series(recs, step_key)
        for stem, title, keys in _panel_keys(series):
            panels.append((stem_prefix + stem, title_prefix + title, keys, series, xlabel))
    return panels


def _draw(ax, title: str, keys: Sequence[str], series, xlabel: str) -> None:
    for key, label in _distinct(keys, series):
        xs, ys = series[key]
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, path: epath.Path) -> epath.Path:
    """Write `fig` to `path` as a PNG, with fixed margins in inches (room for a title, tick
    labels and an axis label) instead of `tight_layout`, which measures every tick label:
    a 16-panel run's plots took 6.4 s with it, 4.2 s with these."""
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, bottom=0.5 / height,
                        top=1 - 0.35 / height, wspace=0.25, hspace=0.45)
    with path.open("wb") as fh:
        fig.savefig(fh, format="png", dpi=100)
    return path


def plot_metrics(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike,
                 *, step_key: str = "step") -> list[epath.Path]:
    """Write the PNGs of the module docstring into `out_dir`; returns their paths (none when
    no known metric is present)."""
    # Figures made directly, not through pyplot: no GUI backend and no global state to
    # switch. Imported here, where a plot is drawn: matplotlib takes ~0.3 s to import.
    from matplotlib.figure import Figure

    out_dir = epath.Path(out_dir)  # a local folder or a bucket (gs://...)
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = _panels(records, step_key)
    written = []
    for stem, title, keys, series, xlabel in panels:
        fig = Figure(figsize=(6, 4))
        _draw(fig.subplots(), title, keys, series, xlabel)
        written.append(_save(fig, out_dir / f"{stem}.png"))
    if panels:
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig = Figure(figsize=(5 * cols, 3.6 * rows))
        axes = fig.subplots(rows, cols, squeeze=False)
        for ax, (_, title, keys, series, xlabel) in zip(axes.flat, panels):
            _draw(ax, title, keys, series, xlabel)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        written.append(_save(fig, out_dir / "overview.png"))
    return written
