"""Bounded-staleness asynchronous RL on one mesh (``RLConfig.max_staleness = k >= 1``),
for every host source (``rljax.train.sources``: host rewards, DAPO's ``Refill``,
environment ``Episodes``).

The state carries the batches sampled but not yet learned from (``TrainState.inflight``,
oldest first; ``k`` of them between steps). Step ``t`` (``state.step == t``):

1. fill: while fewer than ``k`` batches are in flight, collect one with the current
   policy (the run's first step only: a checkpoint holds them);
2. split the key as the synchronous step does (``split_step_key``): one key samples
   batch ``t + k`` and one drives the updates on batch ``t``;
3. dispatch the sampling of batch ``t + k`` with the parameters before update ``t``, then,
   as soon as the source says it is dispatched (its ``dispatched`` hook), the learning
   program on batch ``t``: the chips run it after the sampler while the host detokenises,
   scores and steps the environments of batch ``t + k``;
4. wait for both; the new batch joins the in-flight queue with its version ``t``.

So the batch learned at step ``t`` was sampled with the parameters of step
``max(t - k, 0)``: at most ``k`` updates old. Every process dispatches the same programs in
the same order (one thread: no collective can interleave differently across processes).

Memory: the in-flight batches; with a source that samples again after its first dispatch
(episodes' later turns, DAPO's refill rounds: ``samples_after_dispatch``) also one copy of
the policy's weights, which those programs read while the update replaces the originals.
A single-turn source reads the weights only in programs dispatched before the update's,
which JAX orders ahead of the update's donation.

The learning program's ratio denominator is the proximal policy (the weights before the
update; recomputed, or the current log-probs under ``stop_gradient`` for one update per
batch), and the sampler's log-probs are the behaviour policy (decoupled PPO, Hilton et al.
2021; AReaL): ``AlgorithmConfig.tis_cap`` / ``is_mode`` correct behaviour vs proximal,
and ``mismatch_kl`` / ``is_weight_max`` / ``is_weight_min`` measure the gap
(``rljax.objectives.behaviour_gap``). docs/async.md states the convention.

A checkpoint holds the in-flight batches themselves (global arrays in the state; their
versions and host metrics in its JSON metadata, :func:`inflight_meta`; a resume's
restore target from it, :func:`inflight_target`), so a resumed run equals an uninterrupted
one.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.sharding import batch_sharding, put_on
from rljax.train import hosts
from rljax.train.batch import PromptSource, Rollout
from rljax.train.driver import StepOutput
from rljax.train.learn.update import TrainState
from rljax.train.programs.device import split_step_key
from rljax.train.programs.step import StepSpec, learn_step, run, state_scalars
from rljax.train.sources import Window
from rljax.train.throughput import PhaseTimes

__all__ = ["InFlight", "async_step", "inflight_meta", "inflight_target"]

_split_key = jax.jit(split_step_key)
_copy = jax.jit(lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InFlight:
    """A batch sampled but not yet learned from: its ``rollout`` (global arrays),
    ``version`` (``state.step`` when its sampling was dispatched: the parameters of that
    step sampled it) and ``metrics`` (its collection's host metrics, ``((name, value),
    ...)``: reward terms, episode and refill statistics), reported with the step that
    learns from it."""

    rollout: Rollout
    version: int = dataclasses.field(default=0, metadata=dict(static=True))
    metrics: tuple = dataclasses.field(default=(), metadata=dict(static=True))


def _collected(col, version: int, mesh) -> InFlight:
    """A collected batch in flight, its arrays with rows over the mesh's batch shards (as a
    resume restores them, :func:`inflight_target`: the learning program sees the same
    input shardings resumed or not, and compiles once)."""
    ro = col.rollout if mesh is None else _on_rows(col.rollout, mesh)
    return InFlight(ro, version, tuple(sorted(col.metrics.items())))


@functools.partial(jax.jit, static_argnums=1)
def _on_rows(ro: Rollout, mesh) -> Rollout:
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim)), ro)


def async_step(spec: StepSpec, source, state: TrainState, prompts: PromptSource, n: int,
               max_staleness: int, *, teacher_params=None) -> StepOutput:
    """One asynchronous RL step of ``state`` (module docstring): learn from the oldest
    in-flight batch while the batch ``max_staleness`` steps ahead is collected from
    ``prompts`` (``n`` prompts a batch). ``teacher_params``: as
    ``rljax.train.driver.rl_step``; the spec's layout is sized for the learned batch. Metrics: the learning program's on the learned batch,
    its collection's host metrics, ``async/staleness`` (updates between the policy that
    sampled it and the one it updates) and ``async/inflight`` (batches in flight after
    the step)."""
    ph = PhaseTimes()
    params, opt_state = put_on((state.params, state.opt_state), spec.out_shardings)
    state = dataclasses.replace(state, params=params, opt_state=opt_state)
    step, pos = (int(x) for x in hosts.fetch_scalars((state.step, state.data_pos)))
    policy, key = state.params["policy"], state.key
    pending = list(state.inflight or ())
    while len(pending) < max_staleness:  # the run's first step: sampled by this policy
        key, k_roll, _ = _split_key(key)
        col = source.collect(policy, Window(prompts, pos, n), k_roll, ph)
        pending.append(_collected(col, step, spec.mesh))
        pos = col.next_pos
    batch = pending.pop(0)
    key, k_roll, k_learn = _split_key(key)
    # The batch to learn sizes the layout (a packed one's bucket): before any dispatch.
    spec = dataclasses.replace(spec, layout=spec.layout.for_rollout(batch.rollout))
    sampler = _copy(policy) if getattr(source, "samples_after_dispatch", False) else policy
    learned: list = []

    def dispatch():
        learned.append(run(learn_step, spec, state.params, state.opt_state,
                           state_scalars(state), state.ref_params, batch.rollout, k_learn,
                           teacher_params))

    col = source.collect(sampler, Window(prompts, pos, n), k_roll, ph, dispatch)
    if not learned:  # a source that never dispatched (nothing to overlap)
        dispatch()
    t0 = time.perf_counter()
    params, opt_state, out, m = jax.block_until_ready(learned[0])
    ph.add("learn", time.perf_counter() - t0)  # the part not hidden behind the collection
    pending.append(_collected(col, step, spec.mesh))
    out["key"] = key
    state = dataclasses.replace(
        state, params=params, opt_state=opt_state, inflight=tuple(pending),
        data_pos=hosts.put_replicated(col.next_pos, spec.mesh, np.int32), **out)
    metrics = hosts.fetch_scalars(m)
    metrics.update(dict(batch.metrics))
    metrics["async/staleness"] = float(step - batch.version)
    metrics["async/inflight"] = float(len(pending))
    return StepOutput(state, metrics, spec, ph)


def inflight_meta(state: TrainState) -> list:
    """The JSON record of ``state``'s in-flight batches for a checkpoint's metadata:
    per batch its version, host metrics, the rollout's static fields and each array's
    shape and dtype (None: an absent optional array)."""
    out = []
    for b in state.inflight or ():
        arrays = {f.name: (None if (x := getattr(b.rollout, f.name)) is None
                           else [list(x.shape), str(x.dtype)])
                  for f in dataclasses.fields(Rollout) if not f.metadata.get("static")}
        out.append({"version": b.version, "metrics": dict(b.metrics),
                    "group_size": b.rollout.group_size, "has_correct": b.rollout.has_correct,
                    "arrays": arrays})
    return out


def _jit_form(sharding):
    """``sharding`` as a jit output carries it (no trailing None in its spec): JAX keys
    compiled programs by the argument shardings' form, so a restored batch then reuses
    the learning program the uninterrupted run compiled."""
    spec = tuple(sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def inflight_target(records: list, mesh) -> tuple:
    """The restore target of a checkpoint's in-flight batches from their record
    (:func:`inflight_meta`): abstract arrays with rows over the mesh's batch shards."""
    def leaf(spec):
        if spec is None:
            return None
        shape, dtype = tuple(spec[0]), np.dtype(spec[1])
        sharding = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                    else _jit_form(batch_sharding(mesh, len(shape))))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return tuple(InFlight(Rollout(**{k: leaf(v) for k, v in r["arrays"].items()},
                                  group_size=r["group_size"], has_correct=r["has_correct"]),
                          r["version"], tuple(sorted(r["metrics"].items())))
                 for r in records)
