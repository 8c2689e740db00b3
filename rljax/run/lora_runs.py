"""LoRA runs: checkpoints that hold the adapters, not the base, and a check of the base.

A LoRA run's base never changes, so its checkpoints (`AdapterCheckpoints`) hold the
adapters, their optimiser state and the step (with the PRNG key, data position and
counters: everything of the `TrainState` but the frozen base), plus the base's
fingerprint in the metadata. A resume rebuilds the base as the run did (its `hf_path`,
or the random init of `run.seed`), checks its fingerprint and merges the adapters back:
the same state, bit for bit, as the run had. A different base is refused with an error.
An export or evaluation of the run reads its adapters the same way
(`restore_lora_policy`).

A several-seed run (`rljax.run.seed_runs`) saves its seeds' adapters stacked, with the
stacked bases' fingerprint; reading one seed rebuilds every seed's base. A run whose
warm-up trained the base (`sft.full_parameters`, through `base_model`) cannot rebuild it:
its checkpoints hold the whole state (`lora_checkpoints` picks the kind).

The fingerprint is a wrapping uint32 sum of each weight's bits times a position hash:
integer addition is associative, so it is the same on any mesh or process count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models import Decoder
from rljax.models.lora import ADAPTERS
from rljax.sharding import state_shardings
from rljax.train.checkpoint import pure_params
from rljax.train.hosts import fetch_small
from rljax.train.learn.reference import lora_base
from rljax.train.seeds import stack_states

__all__ = ["AdapterCheckpoints", "adapters_only", "base_fingerprint", "base_model",
           "lora_checkpoints", "restore_lora_policy", "saved_target"]

BASE_KEY = "lora_base"  # the checkpoint metadata's fingerprint of the base


@jax.jit
def _fingerprint(leaves: list) -> jax.Array:
    total = jnp.zeros((), jnp.uint32)
    for i, x in enumerate(leaves):
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
        pos = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
        salt = jnp.uint32((i + 1) * 0x9E3779B1 % 2**32)
        total = total + jnp.sum(bits.astype(jnp.uint32) * (pos * jnp.uint32(2654435761) + salt),
                                dtype=jnp.uint32)
    return total


def base_fingerprint(base) -> str:
    """The frozen base's fingerprint (hex), equal across meshes and process counts."""
    leaves = jax.tree.leaves(base)
    return f"{int(fetch_small(_fingerprint(leaves))):08x}"


def adapters_only(state):
    """A `TrainState` with its policy reduced to the adapters (what is saved)."""
    adapters = ADAPTERS.split(state.params["policy"])[0]
    return dataclasses.replace(state, params=dict(state.params, policy=adapters))


def _check_base(meta: dict, base, where: str) -> None:
    want, got = meta.get(BASE_KEY), base_fingerprint(base)
    if want != got:
        raise ValueError(f"{where}: the checkpoint's adapters were trained on a base with "
                         f"fingerprint {want}, but this run's base (hf_path or the seed's "
                         f"random init) has {got}: refusing to put them on another base")


class AdapterCheckpoints:
    """A `rljax.train.checkpoint.Checkpointer` for a run whose policy has adapters: saves
    the state without the frozen base (fingerprint in the metadata); `restore(target)`
    reads the adapters into ``target`` (a fresh state on the run's base), after checking
    the base. Everything else is the wrapped checkpointer's."""

    def __init__(self, ck) -> None:
        self._ck = ck

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ck, name)

    def save(self, step: int, state, meta: dict | None = None, **kw):
        base = ADAPTERS.split(state.params["policy"])[1]
        meta = dict(meta or {}, **{BASE_KEY: base_fingerprint(base)})
        return self._ck.save(step, adapters_only(state), meta, **kw)

    def restore(self, target, step: int | None = None):
        base = ADAPTERS.split(target.params["policy"])[1]
        state, meta = self._ck.restore(adapters_only(target), step)
        _check_base(meta, base, f"resume from {self._ck.directory}")
        policy = ADAPTERS.merge(state.params["policy"], base)
        return dataclasses.replace(state, params=dict(state.params, policy=policy)), meta


def lora_checkpoints(cfg, ck):
    """``ck`` as a run of ``cfg`` checkpoints: `AdapterCheckpoints` for a LoRA policy on
    its rebuildable base, else ``ck`` (the whole state: no adapters, or a base that its
    warm-up trained, `sft.full_parameters`)."""
    return AdapterCheckpoints(ck) if cfg.lora.enabled and not cfg.warms_up_base else ck


def base_model(graphdef, params) -> tuple[Any, Any, Any]:
    """``(graphdef, state, adapters)``: the model ``(graphdef, params)`` without its
    adapters (its base as a model of its own, for a phase that trains every weight of it)
    and the adapters set aside; ``ADAPTERS.merge(adapters, state)`` puts them back."""
    adapters, base = ADAPTERS.split(params)
    config = dataclasses.replace(nnx.merge(graphdef, params).config, lora=None)
    plain = nnx.graphdef(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    return plain, base, adapters


def saved_target(state, mesh, lead: tuple[int, ...] = ()) -> dict:
    """``state``'s leaves as saved (string keys, ``{"value": leaf}``), abstract, placed per
    the logical rules on ``mesh`` (or this process's first device), with the leading axes
    ``lead`` (a several-seed checkpoint's stack) before each leaf's own."""
    flat = nnx.to_flat_state(state)
    sh = dict(nnx.to_flat_state(state_shardings(state, mesh))) if mesh is not None else {}
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    tree: dict = {}
    for path, var in flat:
        node = tree
        for key in path:
            node = node.setdefault(str(key), {})
        leaf = var.get_value()
        node["value"] = jax.ShapeDtypeStruct((*lead, *leaf.shape), leaf.dtype,
                                             sharding=sh[path].get_value() if sh else one)
    return tree


def _pure(state) -> dict:
    """An NNX state as nested dicts with string keys (`restore_policy`'s form)."""
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = var.get_value()
    return out


def restore_lora_policy(ck, models: list, step: int | None, mesh=None, index: int = 0,
                        whole: bool = False) -> tuple[dict, dict]:
    """``(policy as nested dicts, meta)``: the adapters of checkpoint ``step`` of ``ck`` on
    the run's rebuilt base (as the run stored it, fingerprint checked), or with ``whole``
    (a run whose warm-up trained the base) base and adapters as saved. ``models``: the
    run's model, or one per seed of a several-seed run (its checkpoint stacks them; read
    on one device, ``mesh=None``), of which seed ``index`` is returned."""
    states = [lora_base(*nnx.split(m), ADAPTERS) for m in models]
    state = states[0] if len(states) == 1 else stack_states(states)
    adapters, base = ADAPTERS.split(state)
    target = saved_target(state if whole else adapters, mesh)
    raw, meta = ck.restore_subtree({"params": {"policy": target}}, step)
    policy = _pure(base)
    if not whole:
        _check_base(meta, base, f"the checkpoint in {ck.directory}")
    _deep_update(policy, pure_params(raw["params"]["policy"]))
    if len(states) > 1:
        policy = jax.jit(lambda tree: jax.tree.map(lambda x: x[index], tree))(policy)
    return policy, meta


def _deep_update(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict):
            _deep_update(into.setdefault(k, {}), v)
        else:
            into[k] = v

