"""Checkpoints: any pytree of jax arrays plus JSON metadata, saved with orbax.

`Checkpointer` wraps `orbax.checkpoint.CheckpointManager` (orbax-checkpoint 0.12):

- every `save_every` steps it saves `state` (a pytree of jax arrays, sharded or not:
  params, optimiser states, the step, PRNG keys) with `StandardSave` and a JSON dict `meta`
  (step, data-iterator position, PRNG key data, config hash...) with `JsonSave`, as two items
  of one `Composite` checkpoint;
- saves are asynchronous: `save` returns once the arrays are copied off the devices, and the
  write to disk finishes in a background thread (`wait_until_finished` blocks on it);
- only the last `keep` checkpoints are kept;
- orbax writes each step into a temporary directory and renames it when complete, so a run
  killed mid-save leaves the previous checkpoint intact and the half-written one is ignored.
  Restores also skip any step directory that lacks orbax's finalisation metadata;
- used as a context manager, leaving the block (normally, or by an exception such as the
  KeyboardInterrupt of Ctrl-C) waits for the pending save before closing, so a Ctrl-C never
  loses the save that was in flight.

`restore(target)` reads the latest valid step into `target`, a pytree of arrays or
`jax.ShapeDtypeStruct`s whose `.sharding` says where each restored array goes
(`abstract_like(state)` builds one from a live state), so a checkpoint written on one
topology (say 2 processes x 4 devices) restores on another (1 x 8) and vice versa.

On several processes every process makes the same calls with the same global arrays;
each writes its own shards. The directory is an `etils.epath` path (local or `gs://...`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

__all__ = ["Checkpointer", "abstract_like", "key_from_json", "key_to_json", "pure_params"]

_ITEMS = ("state", "meta")
# Orbax writes this file last in a step directory (after the rename from the tmp dir).
_FINAL_MARKER = "_CHECKPOINT_METADATA"


def abstract_like(tree: Any) -> Any:
    """A pytree of `jax.ShapeDtypeStruct`s (with shardings) matching `tree`'s arrays."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        x = jax.numpy.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(one, tree)


def key_to_json(key: jax.Array) -> dict[str, Any]:
    """JSON-able form of a typed PRNG key (`jax.random.key`): implementation name and data."""
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise TypeError(f"key must be a typed PRNG key (jax.random.key), got dtype {key.dtype}")
    data = np.asarray(jax.random.key_data(key))
    return {"impl": str(jax.random.key_impl(key)), "shape": list(data.shape),
            "data": data.reshape(-1).tolist()}


def key_from_json(obj: dict[str, Any]) -> jax.Array:
    """Inverse of `key_to_json`."""
    try:
        data = np.asarray(obj["data"], dtype=np.uint32).reshape(obj["shape"])
        return jax.random.wrap_key_data(data, impl=obj["impl"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a saved PRNG key (needs impl, shape, data): {e}") from None


def pure_params(tree: Any) -> Any:
    """Collapse NNX variable wrappers `{"value": x}` of a raw-restored state into `x`."""
    if isinstance(tree, dict):
        if set(tree) == {"value"} and not isinstance(tree["value"], dict):
            return tree["value"]
        return {k: pure_params(v) for k, v in tree.items()}
    return tree


class Checkpointer:
    """Asynchronous orbax checkpoints of `(state pytree, JSON meta)`, keeping the last `keep`.

    Args:
      directory: where step directories `0/`, `10/`, ... are written (created if absent).
      save_every: save only steps divisible by this (`save(..., force=True)` overrides).
      keep: number of most recent checkpoints kept (older ones are deleted).
      async_save: write in a background thread (True) or block in `save` (False).
    """

    def __init__(self, directory: str | os.PathLike, *, save_every: int = 1, keep: int = 3,
                 async_save: bool = True):
        for name, value in (("save_every", save_every), ("keep", keep)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        text = os.fspath(directory)
        self.directory = epath.Path(text if "://" in text else os.path.abspath(text))
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_every,
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
        self._closed = False

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None, *,
             force: bool = False) -> bool:
        """Start saving `state` and `meta` as checkpoint `step`; True if a save was started.

        `meta` must be JSON-serialisable (checked here, before any write); `step` is added
        to it. Returns False when `step` is not a multiple of `save_every` (unless `force`)
        or is already saved.
        """
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        step = int(step)
        meta = dict(meta or {})
        meta["step"] = step
        try:
            json.dumps(meta)
        except TypeError as e:
            raise TypeError(f"meta must be JSON-serialisable: {e}") from None
        if step in self._mgr.all_steps():
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return bool(self._mgr.save(step, args=args, force=force))

    def wait_until_finished(self) -> None:
        """Block until every started save is on disk and finalised (a Ctrl-C meanwhile is
        held until then, `_ctrl_c_held`)."""
        _ctrl_c_held(self._mgr.wait_until_finished)

    # -- reading --------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Steps with a complete (finalised) checkpoint, ascending."""
        self._mgr.reload()  # see steps written by another process (or before a restart)
        return sorted(int(step) for step in self._mgr.all_steps()
                      if (self.directory / str(step) / _FINAL_MARKER).exists())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Read checkpoint `step` (default: the latest complete one) into `target`.

        `target` is a pytree with the saved structure whose leaves are arrays or
        `jax.ShapeDtypeStruct`s; each restored array gets that leaf's dtype and sharding
        (a live array that was never explicitly placed comes back likewise uncommitted).
        Returns `(state, meta)`. Raises FileNotFoundError when there is nothing to restore.
        """
        state, meta = self._read(step, ocp.args.StandardRestore(abstract_like(target)))
        # Uncommitted as its target leaf (e.g. a PRNG key or a counter made with jnp), so
        # jit may move it next to sharded arguments exactly as it did before the checkpoint.
        state = jax.tree.map(
            lambda r, t: jax.numpy.asarray(np.asarray(r))
            if isinstance(t, jax.Array) and not t.committed else r,
            state, target)
        return state, meta

    def _read(self, step: int | None, state_args) -> tuple[Any, dict[str, Any]]:
        """`(state, meta)` of checkpoint `step` (default: the latest complete one), the state
        read with orbax's `state_args`; FileNotFoundError when the step is not complete."""
        self.wait_until_finished()
        steps = self.all_steps()
        step = (steps[-1] if steps else None) if step is None else step
        if step is None or step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint {'' if step is None else f'for step {step} '}"
                f"in {self.directory}; have {steps}")
        out = self._mgr.restore(step, args=ocp.args.Composite(state=state_args,
                                                              meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def restore_raw(self, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Read checkpoint `step` (default latest) without a target: nested dicts of arrays.

        NNX states come back as `{name: {"value": array}}`; `pure_params` turns them into
        the pure dicts `flax.nnx.replace_by_pure_dict` takes. Use `restore` with a target
        when the layout (shardings, dtypes) matters.
        """
        return self._read(step, ocp.args.StandardRestore())

    def restore_subtree(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Read only the arrays named by `target` from checkpoint `step` (default latest).

        `target` is nested dicts as saved (string keys; NNX variables as `{"value": leaf}`)
        covering part of the state, e.g. `{"params": {"policy": ...}}`, with
        `jax.ShapeDtypeStruct` leaves whose shardings say where each array goes (any
        topology, e.g. all devices of all processes). Nothing else is read: an export reads
        the policy without the optimiser moments. Returns `(subtree, meta)`.
        """
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        return self._read(step, ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                       partial_restore=True))

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON metadata of checkpoint `step` (default latest), without the arrays."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        path = self.directory / str(step) / "meta" / "metadata"
        if path.exists():
            return json.loads(path.read_text())
        out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending saves and release orbax's threads (idempotent)."""
        if not self._closed:
            self.wait_until_finished()
            self._mgr.close()
            self._closed = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


def _ctrl_c_held(fn) -> None:
    """`fn()` with a first Ctrl-C held until it returns, then raised as KeyboardInterrupt:
    one that cut a wait for orbax's background write left the checkpoint unfinalised when
    the process then exited. A second Ctrl-C raises at once. Only in the main thread with
    a Python SIGINT handler (a process that ignores SIGINT keeps ignoring it)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        return fn()
    hit: list[int] = []

    def hold(signum, frame):
        if hit:  # the second: at once
            raise KeyboardInterrupt
        hit.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        fn()
    finally:
        signal.signal(signal.SIGINT, previous)
    if hit:
        raise KeyboardInterrupt

