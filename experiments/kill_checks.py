"""What `experiments/kill_campaign.py` checks after each kill and at the end of a run: the
step an attempt resumed, the complete checkpoints, the metric lines and the final
checkpoint's arrays against the uninterrupted run's (bit for bit)."""

from __future__ import annotations

import pathlib

import numpy as np

from kill_hooks import unfinished_checkpoints

VOLATILE = ("time_", "_tok_s", "flops", "mfu")  # wall-clock metrics


def resumed_step(log: str) -> int | None:
    """The step an attempt's log says it resumed, or None (a fresh start or no log)."""
    for line in log.splitlines():
        if line.startswith("[rljax] resumed ") and " at step " in line:
            return int(line.rsplit(" at step ", 1)[1].split()[0])
    return None


def complete_steps(ckpt: pathlib.Path) -> list[int]:
    """Finalised checkpoint steps (orbax's marker written) in `ckpt`, ascending."""
    if not ckpt.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt.iterdir()
                  if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists())


def metric_rows(run_dir: pathlib.Path) -> dict[tuple[int, int], dict]:
    """RL metric lines by (step, seed) without wall-clock keys (a torn last line is
    skipped; one-seed runs have seed 0)."""
    from rljax.run.run_dir import read_metrics

    if not (run_dir / "metrics.jsonl").exists():
        return {}
    return {(r["step"], r.get("seed", 0)): {k: v for k, v in r.items()
                                            if not any(s in k for s in VOLATILE)}
            for r in read_metrics(run_dir) if r["phase"] == "rl"}


def differences(got: dict[int, dict], want: dict[int, dict]) -> list[str]:
    """Steps of `got` whose metric lines are not exactly `want`'s."""
    return [f"step {s}: " + ", ".join(f"{k} {got[s].get(k)} != {want[s].get(k)}"
                                      for k in sorted(set(got[s]) | set(want.get(s, {})))
                                      if got[s].get(k) != want.get(s, {}).get(k))
            for s in sorted(got) if got[s] != want.get(s)]


def checkpoint_differences(a: pathlib.Path, b: pathlib.Path, step: int) -> list[str]:
    """Arrays of checkpoint `step` that are not bit-identical between run dirs a and b,
    each read onto this process's first device (whatever topology wrote it)."""
    import jax
    import orbax.checkpoint as ocp

    from rljax.train.checkpoint import Checkpointer

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    missing = [str(d) for d in (a, b) if not (d / "checkpoints" / str(step)).is_dir()]
    if missing:  # a failed final attempt: a lost run, reported, not a crash of the campaign
        return [f"no checkpoint {step} in {', '.join(missing)}"]
    flat = []
    for d in (a, b):
        md = ocp.StandardCheckpointer().metadata(d / "checkpoints" / str(step) / "state")
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev),
                              dict(getattr(md, "item_metadata", md)),
                              is_leaf=lambda x: hasattr(x, "shape"))
        with Checkpointer(d / "checkpoints") as ck:
            flat.append(dict(jax.tree_util.tree_flatten_with_path(ck.restore(target, step)[0])[0]))
    bad = [jax.tree_util.keystr(k) for k in flat[0] if k not in flat[1]
           or not np.array_equal(np.asarray(flat[0][k]), np.asarray(flat[1][k]))]
    return bad or ([] if flat[0] else ["no arrays read"])


def fresh_unfinished(ckpt: pathlib.Path, since: float) -> list[str]:
    """Half-written checkpoint directories in `ckpt` changed at or after time `since`
    (orbax reuses a step's temporary name: an older leftover is not this kill's)."""
    return [n for n in unfinished_checkpoints(str(ckpt))
            if (ckpt / n).stat().st_mtime >= since - 1e-3]
