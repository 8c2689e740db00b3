"""The jitted update step shared by SFT and RL: exact micro-batch accumulation, optax
update, non-finite skipping, and the train state pytree.

A *loss function* here has the objective contract lifted to parameters:
``loss_fn(params, micro_batch, coef) -> (loss_sum, count, metrics)`` with metrics a dict
``name -> (sum, count)``. Accumulation over M micro-batches is exact:

    loss = (sum_m loss_sum_m) / (sum_m count_m)
    grad = (sum_m d loss_sum_m / d params) / (sum_m count_m)

because ``d(sum/count)/dθ = (d sum/dθ)/count`` when the count does not depend on θ.

What of each model trains is its filter in ``trainables`` (``rljax.models.lora.Trainable``,
chosen once per model; every parameter by default): gradients, the optimiser and its state
see that part alone (:func:`trainable`); a frozen base passes through bitwise unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax.models.lora import ALL_PARAMETERS, Trainable
from rljax.sharding import batch_sharding, mesh_context, on_mesh, output_shardings, replicated
from rljax.train.config import OptimConfig
from rljax.train.learn.micro import combine_metrics, extreme, num_micro_batches, split_micro

Array = Any
LossFn = Callable[[Any, dict, Any], tuple[Array, Array, dict]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a checkpoint must hold to continue a run identically.

    Fields:
      params: dict name -> NNX state of each trained model ("policy", and "value" for PPO).
      opt_state: dict name -> optax state, same keys as ``params``.
      step: int32, loop steps completed (RL steps or SFT updates attempted).
      updates: int32, optimiser updates applied (the learning-rate schedule's clock).
      nonfinite_run: int32, consecutive updates skipped for a non-finite loss/gradient.
      skipped: int32, total skipped updates.
      key: uint32[2] PRNG key data (raw, so checkpoints need no key type).
      data_pos: int32, index of the next prompt/example to read from the data source.
      kl_coef: float32, the current KL coefficient (adaptive controller state).
      ref_params: NNX state of the frozen reference policy (of a LoRA policy: a copy of
        its adapters, ``rljax.train.learn.reference.make_reference``), or None.
      inflight: an asynchronous run's batches sampled but not yet learned from (a tuple
        of ``rljax.train.async_driver.InFlight``, oldest first), or None (a synchronous
        run's state).
    """

    params: dict
    opt_state: dict
    step: Array
    updates: Array
    nonfinite_run: Array
    skipped: Array
    key: Array
    data_pos: Array
    kl_coef: Array
    ref_params: Any = None
    inflight: Any = None


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to ``cfg.lr`` then constant / cosine / linear decay to
    ``cfg.lr * cfg.min_lr_ratio`` at update ``total_steps``."""
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"make_schedule: total_steps must be an int >= 1, got {total_steps!r}")
    warm = min(cfg.warmup_steps, total_steps)
    end = cfg.lr * cfg.min_lr_ratio
    decay = max(total_steps - warm, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.min_lr_ratio)
    else:
        after = optax.linear_schedule(cfg.lr, end, decay)
    if warm == 0:
        return after
    # Warm-up starts at lr / warm (not 0) so that the first update moves the weights.
    ramp = optax.linear_schedule(cfg.lr / warm, cfg.lr, warm - 1) if warm > 1 else (
        optax.constant_schedule(cfg.lr))
    return optax.join_schedules([ramp, after], [warm])


def make_optimizer(cfg: OptimConfig, total_steps: int, lr_scale: float = 1.0):
    """AdamW with global-norm clipping and the schedule; returns ``(tx, schedule)``."""
    base = make_schedule(cfg, total_steps)
    schedule = (lambda n: base(n) * lr_scale) if lr_scale != 1.0 else base
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts), schedule


def accumulate(loss_fn: LossFn, params, batch: dict, coef, num_micro: int,
               constrain: Callable | None = None, group: int = 1,
               split: Callable | None = None):
    """Sum of loss sums, counts, metric pairs and loss-sum gradients over micro-batches.

    Returns ``(grads_sum, loss_sum, count, metrics)`` (all sums; divide once).
    ``constrain`` re-applies the batch sharding to each micro-batch slice; ``group``
    keeps groups of that many consecutive rows whole (:func:`split_micro`). ``split``:
    ``(batch, num_micro) -> (micro-batches stacked, arrays every micro-batch sees whole)``
    in place of splitting every array (a packed batch: ``rljax.train.learn.packing``).
    """

    def one(mb):
        if constrain is not None:
            mb = constrain(mb)

        def f(p):
            loss_sum, count, metrics = loss_fn(p, mb, coef)
            return loss_sum, (count, metrics)

        (loss_sum, (count, metrics)), grads = jax.value_and_grad(f, has_aux=True)(params)
        metrics = {k: (jnp.asarray(s, jnp.float32), jnp.asarray(c, jnp.float32))
                   for k, (s, c) in metrics.items()}
        return grads, loss_sum, jnp.asarray(count, jnp.float32), metrics

    if num_micro == 1:
        return one(batch)
    if split is None:
        micro, shared = jax.tree.map(lambda x: split_micro(x, num_micro, group), batch), {}
    else:
        micro, shared = split(batch, num_micro)
    first = jax.tree.map(lambda x: x[0], micro)
    rest = jax.tree.map(lambda x: x[1:], micro)
    init = one({**shared, **first})

    def body(carry, mb):
        grads, loss_sum, count, metrics = one({**shared, **mb})
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return (add(carry[0], grads), carry[1] + loss_sum, carry[2] + count,
                combine_metrics(carry[3], metrics)), None

    out, _ = jax.lax.scan(body, init, rest)
    return out


def trainable(params: dict, trainables: dict | None = None) -> tuple[dict, dict]:
    """``(trainable, frozen)`` per model of ``params`` by its filter in ``trainables`` (name
    -> ``rljax.models.lora.Trainable``; a model not named: every parameter, frozen None)."""
    pairs = {k: (trainables or {}).get(k, ALL_PARAMETERS).split(v) for k, v in params.items()}
    return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}


def with_frozen(train: dict, frozen: dict) -> dict:
    """The models' states from :func:`trainable`'s two halves."""
    return {k: Trainable.merge(train[k], frozen[k]) for k in train}


def make_update(loss_fn: LossFn, txs: dict, schedules: dict, num_micro: int,
                constrain: Callable | None = None, group: int = 1,
                split: Callable | None = None, trainables: dict | None = None):
    """Build ``update(params, opt_state, counters, batch, coef) -> (params, opt_state,
    counters, metrics)``, the pure function the trainer jits with donation.

    ``counters`` is ``(updates, nonfinite_run, skipped)`` int32 scalars. A non-finite loss
    or gradient norm leaves params and optimiser state unchanged, does not advance
    ``updates``, increments ``nonfinite_run`` and ``skipped``; a finite one resets
    ``nonfinite_run``. Metrics: ``loss``, ``grad_norm`` (before clipping), ``lr`` (of the
    first model), ``skipped_update``, and each loss metric's mean. ``group``: micro-batches
    keep groups of that many consecutive rows whole (:func:`split_micro`); ``split`` as in
    :func:`accumulate`; ``trainables`` as in :func:`trainable`.
    """

    def update(all_params, opt_state, counters, batch, coef):
        updates, run, skipped = counters
        params, frozen = trainable(all_params, trainables)
        loss = lambda p, mb, c: loss_fn(with_frozen(p, frozen), mb, c)
        grads, loss_sum, count, msums = accumulate(loss, params, batch, coef, num_micro,
                                                   constrain, group, split)
        denom = jnp.where(count > 0, count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = loss_sum / denom
        gnorm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        # Zero non-finite gradients so the (discarded) candidate update stays finite.
        safe = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
        new_params, new_opt = {}, {}
        for name in params:
            upd, new_opt[name] = txs[name].update(safe[name], opt_state[name], params[name])
            new_params[name] = optax.apply_updates(params[name], upd)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        params_out, opt_out = keep(new_params, params), keep(new_opt, opt_state)
        first = next(iter(params))
        metrics = {k: s if extreme(k) else s / jnp.where(c > 0, c, 1.0)
                   for k, (s, c) in msums.items()}
        metrics.update(
            loss=loss, grad_norm=gnorm, lr=jnp.asarray(schedules[first](updates), jnp.float32),
            skipped_update=(~finite).astype(jnp.float32),
        )
        if len(params) > 1:
            metrics.update({f"grad_norm_{k}": optax.tree.norm(grads[k]) for k in params})
        counters = (
            updates + finite.astype(jnp.int32),
            jnp.where(finite, 0, run + 1).astype(jnp.int32),
            skipped + (~finite).astype(jnp.int32),
        )
        return with_frozen(params_out, frozen), opt_out, counters, metrics

    return update


def jit_update(update, mesh, params, opt_state, batch_example: dict):
    """``jax.jit`` the update with explicit shardings; params and optimiser state donated.

    Params and optimiser state keep the shardings they already have; batch arrays are
    split over ("data", "fsdp") on their leading axis; coefficients and counters are
    replicated. Without a mesh, plain ``jax.jit`` with donation.
    """
    if mesh is None:
        return jax.jit(update, donate_argnums=(0, 1))

    rep = replicated(mesh)
    p_sh = jax.tree.map(lambda x: x.sharding, params)
    o_sh = jax.tree.map(lambda x: x.sharding, opt_state)
    b_sh = jax.tree.map(lambda x: batch_sharding(mesh, max(x.ndim, 1)), batch_example)
    return on_mesh(jax.jit(
        update,
        in_shardings=(p_sh, o_sh, rep, b_sh, rep),
        out_shardings=(p_sh, o_sh, rep, rep),
        donate_argnums=(0, 1),
    ), mesh)


def batch_constrainer(mesh):
    """A function re-applying the batch sharding to a micro-batch dict (None without mesh)."""
    if mesh is None:
        return None
    return lambda mb: jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh, max(x.ndim, 1))), mb)


def opt_state_shardings(txs: dict, params: dict, mesh, trainables: dict | None = None) -> dict:
    """Shardings of ``init_opt_state``'s result: each moment sharded like its parameter,
    everything else (step counts) replicated. ``params``' leaves carry ``.sharding``
    (arrays or abstract arrays); ``trainables`` as in :func:`trainable`."""
    params = trainable(params, trainables)[0]
    abstract = jax.eval_shape(lambda p: {k: txs[k].init(p[k]) for k in p}, params)
    p_sh = jax.tree.map(lambda x: x.sharding, params)
    rep = replicated(mesh)
    return {k: optax.tree_map_params(txs[k], lambda _, s: s, abstract[k], p_sh[k],
                                     transform_non_params=lambda _: rep) for k in abstract}


def init_opt_state(txs: dict, params: dict, mesh=None, trainables: dict | None = None) -> dict:
    """Optimiser states for the trainable part of ``params`` (dict name -> NNX state;
    ``trainables`` as in :func:`trainable`); on a mesh each moment is sharded like its
    parameter (a jit left to choose placed the zeros replicated: every chip held all of
    Adam's moments, 3.7 GiB per chip for Qwen2.5-0.5B). The init is a module-level jit with
    the optimisers and the result's shardings static: JAX's cache compiles it once per
    optimiser set and layout (one state per seed, or a resumed run's template, compiles it
    once). An optimiser that cannot be hashed is jitted afresh."""
    shardings = None
    if mesh is not None:
        shardings = output_shardings(mesh, opt_state_shardings(txs, params, mesh, trainables),
                                     of_shardings=True)
    items = tuple(sorted(txs.items()))
    params = trainable(params, trainables)[0]
    try:
        hash(items)
    except TypeError:
        return jax.jit(lambda p: _opt_init(items, p, shardings))(params)
    with mesh_context(mesh):
        return _opt_init_jit(items, params, shardings)


def _opt_init(items: tuple, params: dict, shardings):
    txs = dict(items)
    state = {k: txs[k].init(params[k]) for k in params}
    if shardings is None:
        return state
    return jax.lax.with_sharding_constraint(state, jax.tree.unflatten(*shardings))


_opt_init_jit = jax.jit(_opt_init, static_argnums=(0, 2))


def new_train_state(params: dict, opt_state: dict, seed: int, *, ref_params=None,
                    kl_coef: float = 0.0, mesh=None) -> TrainState:
    """A fresh ``TrainState`` at step 0 with PRNG key ``seed``; with a ``mesh`` its
    scalars are replicated global arrays (what orbax saves on every process)."""
    put = jnp.asarray if mesh is None else lambda x: jax.device_put(x, replicated(mesh))
    z = lambda: put(np.zeros((), np.int32))
    return TrainState(
        params=params, opt_state=opt_state, step=z(), updates=z(), nonfinite_run=z(),
        skipped=z(), key=put(np.asarray(jax.random.key_data(jax.random.key(seed)))),
        data_pos=z(), kl_coef=put(np.asarray(kl_coef, np.float32)), ref_params=ref_params,
    )


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class Learner:
    """Applies jitted, donated, micro-batched updates of a loss function to a TrainState.

    Args:
      loss_fn: ``(params, micro_batch, coef) -> (loss_sum, count, metrics)``.
      optims: dict name -> ``(optax tx, schedule)``, one per entry of ``state.params``.
      micro_batch_size: rows per micro-batch (0 = whole batch).
      max_nonfinite: stop after this many consecutive skipped updates.
      mesh: device mesh or None (one device).
      program_for: optional ``(state, num_micro) -> update(params, opt_state, counters,
        batch, coef)``: the caller's own compiled update (``rljax.train.sft``: a
        module-level jit of a frozen spec); by default the learner jits ``loss_fn``'s
        update itself, once per micro-batch count.
      trainables: name -> ``rljax.models.lora.Trainable`` (:func:`trainable`; default:
        every parameter of every model trains).
    """

    def __init__(self, loss_fn: LossFn, optims: dict, *, micro_batch_size: int = 0,
                 max_nonfinite: int = 5, mesh=None, program_for: Callable | None = None,
                 trainables: dict | None = None):
        self.loss_fn, self.program_for, self.trainables = loss_fn, program_for, trainables
        self.txs = {k: v[0] for k, v in optims.items()}
        self.schedules = {k: v[1] for k, v in optims.items()}
        self.micro_batch_size = micro_batch_size
        self.max_nonfinite = max_nonfinite
        self.mesh = mesh
        self._jitted: dict[int, Callable] = {}

    def init_opt_state(self, params: dict) -> dict:
        """Fresh optimiser states for ``params``."""
        return init_opt_state(self.txs, params, self.mesh, self.trainables)

    def put_batch(self, batch: dict) -> dict:
        """Place host arrays on the mesh, leading axis over ("data", "fsdp")."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, batch)

        n = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        for k, v in batch.items():
            if v.shape[0] % n:
                raise ValueError(
                    f"batch field {k!r} has {v.shape[0]} rows, not divisible by the "
                    f"data x fsdp = {n} devices it is split over"
                )
        return {k: jax.device_put(v, batch_sharding(self.mesh, max(v.ndim, 1)))
                for k, v in batch.items()}

    def _fn(self, state: TrainState, batch: dict, num_micro: int):
        if self.program_for is not None:
            return self.program_for(state, num_micro)
        if num_micro not in self._jitted:
            upd = make_update(self.loss_fn, self.txs, self.schedules, num_micro,
                              batch_constrainer(self.mesh), trainables=self.trainables)
            self._jitted[num_micro] = jit_update(upd, self.mesh, state.params,
                                                 state.opt_state, batch)
        return self._jitted[num_micro]

    def update(self, state: TrainState, batch: dict, coef, *, what: str = "batch"):
        """One optimiser update on ``batch``; returns ``(state, metrics)`` (device scalars).

        Raises NonFiniteError naming the step when ``max_nonfinite`` consecutive updates
        were skipped.
        """
        b = next(iter(batch.values())).shape[0]
        num_micro = num_micro_batches(b, self.micro_batch_size, what)
        if self.mesh is not None:
            n = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
            if (b // num_micro) % n:
                raise ValueError(
                    f"micro-batches of {b // num_micro} rows do not split over the data x "
                    f"fsdp = {n} devices; choose micro_batch_size as a multiple of {n}"
                )
        batch = self.put_batch(batch)
        fn = self._fn(state, batch, num_micro)
        counters = (state.updates, state.nonfinite_run, state.skipped)
        params, opt_state, counters, metrics = fn(state.params, state.opt_state, counters,
                                                   batch, coef)
        state = dataclasses.replace(state, params=params, opt_state=opt_state,
                                    updates=counters[0], nonfinite_run=counters[1],
                                    skipped=counters[2])
        run = int(counters[1])
        if run >= self.max_nonfinite:
            raise NonFiniteError(
                f"step {int(state.step)}: {run} consecutive updates had a non-finite loss or "
                f"gradient (limit max_nonfinite_steps={self.max_nonfinite}); stopping"
            )
        return state, metrics
