"""Several independent runs of one configuration, each step's programs vmapped over a
leading seed axis: PureJaxRL's trick (Lu et al. 2022), brought to language-model RL.

With a device reward the whole RL step is a pure function of arrays
(``rljax.train.programs.device``), so ``seeds_step`` is it vmapped; with a host source
(host rewards, environment episodes, DAPO's refill around either) each seed's batch is
collected with its own parameters and key, and the learning program is vmapped
(``seeds_learn_step``). Every array of the stacked ``TrainState``
has a leading ``[S]`` axis; each seed keeps its own initial weights, PRNG key, prompt
stream and optimiser state, and is exactly the run it would be alone (up to float
rounding: a batched matmul may sum in another order). The batched program has S times
the rows per matmul, which is where small models gain throughput.

- :class:`SeedRL`: the RL step and greedy evaluation, vmapped.
- :class:`SeedSFT`: the SFT warm-up, vmapped, with a per-seed ``active`` flag so each
  seed stops at its own step (a stopped seed's state passes through unchanged).

Host sources run on a mesh too: every seed's arrays carry the single run's shardings
behind the seed axis (a plain ``vmap``; each seed's collectives span the whole mesh).
The device-reward form is one device (``mesh=None``). A packed layout is per batch:
several seeds use padded rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax.train import hosts
from rljax.train.batch import stack_states, unstack, widen_prompts
from rljax.train.config import SFTConfig
from rljax.train.learn.update import TrainState, num_micro_batches
from rljax.train.programs import program_signature
from rljax.train.programs.device import split_step_key
from rljax.train.programs.step import run, seeds_learn_step, seeds_step, state_scalars
from rljax.train.rl import RLTrainer
from rljax.train.sft import SFTTrainer, sft_update_fn
from rljax.train.sources import Window
from rljax.train.sources.evaluate import evaluate, evaluate_seeds
from rljax.train.throughput import PhaseTimes

__all__ = ["SeedRL", "SeedSFT", "stack_states", "unstack"]


_split_keys = jax.jit(jax.vmap(split_step_key))


def _per_seed(m: dict, s: int) -> list[dict]:
    """A dict of ``[S]`` arrays -> one dict of floats per seed."""
    host = hosts.fetch_small(m)
    return [{k: float(v[i]) for k, v in host.items()} for i in range(s)]


def _left_pad(arrays: tuple, width: int, pad_id: int) -> tuple:
    """Packed prompts ``(tokens, mask, positions)`` left-padded to ``width`` columns."""
    tok, mask, pos = arrays
    extra = width - tok.shape[1]
    if extra == 0:
        return arrays
    pad = lambda x, v: np.pad(x, ((0, 0), (extra, 0)), constant_values=v)
    return pad(tok, pad_id), pad(mask, False), pad(pos, 0)


class SeedRL:
    """``trainer``'s RL step and evaluation for ``S`` seeds in one program each.

    Any rollout source; a device reward needs one device (``mesh=None``), packing is
    refused. States come from :meth:`init_state`; ``step`` takes one prompt source per seed.
    """

    def __init__(self, trainer: RLTrainer):
        if trainer.device_reward is not None and trainer.mesh is not None:
            raise ValueError("SeedRL: with a device reward seeds are vmapped on one device "
                             "(mesh=None); on a mesh use a host reward or run each seed "
                             "alone")
        if trainer.rl.tokens_per_micro_batch:
            raise ValueError(f"SeedRL: RLConfig.tokens_per_micro_batch="
                             f"{trainer.rl.tokens_per_micro_batch} packs each batch to its "
                             "own shape; several seeds share one program: use "
                             "tokens_per_micro_batch=0 (padded rows)")
        if trainer.rl.max_staleness:
            raise ValueError(f"SeedRL: RLConfig.max_staleness={trainer.rl.max_staleness}: "
                             "several seeds learn in one vmapped program once every seed's "
                             "batch is collected, so there is no per-seed in-flight batch; "
                             "use max_staleness=0, or run each seed alone (run.seeds=1)")
        self.tr = trainer
        self._programs: set = set()  # the RL step's signatures (compiled)
        self._one = None  # one seed's parameters: the model's config and size

    def init_state(self, policy_params: Sequence, seeds: Sequence[int],
                   value_params: Sequence | None = None) -> TrainState:
        """Stacked fresh states, seed ``seeds[i]`` around ``policy_params[i]`` (and
        ``value_params[i]`` for PPO's value model)."""
        if len(policy_params) != len(seeds) or not seeds:
            raise ValueError(f"SeedRL.init_state: {len(policy_params)} parameter sets for "
                             f"{len(seeds)} seeds; give one per seed (at least one)")
        values = [None] * len(seeds) if value_params is None else list(value_params)
        if len(values) != len(seeds):
            raise ValueError(f"SeedRL.init_state: {len(values)} value parameter sets for "
                             f"{len(seeds)} seeds; give one per seed")
        return stack_states([self.tr.init_state(p, seed=int(s), value_params=v)
                             for p, s, v in zip(policy_params, seeds, values)])

    def _inputs(self, params_S, sources: Sequence, pos_S) -> tuple:
        """Every seed's packed prompts and task arrays, stacked (one bucket width)."""
        if self._one is None:
            self._one = unstack(params_S["policy"], 0)
        n = self.tr.rl.prompts_per_step
        per = [self.tr.source.inputs(self._one, src, int(p), n, on_host=True)
               for src, p in zip(sources, pos_S)]
        widest = max(range(len(per)), key=lambda i: per[i][1][0].shape[1])
        spec, width = per[widest][0], per[widest][1][0].shape[1]
        prompts = [_left_pad(x[1], width, self.tr.source.pad_id) for x in per]
        stacked = tuple(jnp.asarray(np.stack(cols)) for cols in zip(*prompts))
        task = {k: jnp.asarray(np.stack([x[2][k] for x in per])) for k in per[0][2]}
        return spec, stacked, task

    def step(self, state: TrainState, sources: Sequence) -> tuple[TrainState, list[dict]]:
        """One RL step of every seed (seed ``i`` reads ``sources[i]``); returns the
        stacked state and one metrics dict per seed."""
        s = int(state.step.shape[0])
        if len(sources) != s:
            raise ValueError(f"SeedRL.step: {len(sources)} prompt sources for {s} seeds")
        pos_S = hosts.fetch_small(state.data_pos)
        if not self.tr.source.on_device:
            return self._collected(state, sources, pos_S)
        spec, prompts, task = self._inputs(state.params, sources, pos_S)
        scalars = state_scalars(state)
        ph = PhaseTimes()
        args = (state.params, state.opt_state, scalars, state.ref_params, prompts, task,
                state.key, self.tr.teacher_params)
        self._programs.add(program_signature((self.tr.base_spec, spec), args))
        params, opt_state, out, m = ph.timed("step", seeds_step, self.tr.base_spec, spec, *args)
        n = self.tr.rl.prompts_per_step
        state = dataclasses.replace(state, params=params, opt_state=opt_state,
                                    data_pos=jnp.asarray(pos_S + n, jnp.int32), **out)
        metrics = [self.tr.finish_metrics(mi, ph, run=f"seed index {i}, ")
                   for i, mi in enumerate(_per_seed(m, s))]
        return state, metrics

    def _collected(self, state: TrainState, sources: Sequence, pos_S) -> tuple:
        """A host source's step: each seed's batch collected with its parameters and
        its key (split as a single run splits it), the batches stacked in one prompt
        bucket, and one vmapped learning program."""
        ph, n, src = PhaseTimes(), self.tr.rl.prompts_per_step, self.tr.source
        nxt_S, k_roll_S, k_learn_S = _split_keys(state.key)
        got = [src.collect(unstack(state.params["policy"], i), Window(prompts, int(p), n),
                           k_roll_S[i], ph)
               for i, (prompts, p) in enumerate(zip(sources, pos_S))]
        width = max(c.rollout.prompt_BxP.shape[1] for c in got)
        ro = stack_states([widen_prompts(c.rollout, width, src.pad_id) for c in got])
        spec = self.tr.step_spec(state)
        args = (state.params, state.opt_state, state_scalars(state), state.ref_params, ro,
                k_learn_S, self.tr.teacher_params)
        self._programs.add(program_signature(spec, args))
        params, opt_state, out, m = ph.timed("learn", run, seeds_learn_step, spec, *args)
        state = dataclasses.replace(
            state, params=params, opt_state=opt_state, key=nxt_S,
            data_pos=hosts.put_replicated([c.next_pos for c in got], self.tr.mesh, np.int32),
            **out)
        metrics = []
        for i, (mi, c) in enumerate(zip(_per_seed(m, len(got)), got)):
            mi.update(c.metrics)
            metrics.append(self.tr.finish_metrics(mi, ph, run=f"seed index {i}, "))
        return state, metrics

    def compiled(self) -> dict[str, int]:
        """How many programs the RL step and the evaluation needed: distinct static specs
        and argument shapes, each compiled once per process (one per prompt bucket and
        batch shape; a run whose shapes never change needs one of each). A host source's
        evaluation is the sampler's (``rljax.sampling``), not counted here."""
        out = {"rl_step": len(self._programs)}
        if self.tr.source.on_device:
            out["evaluate"] = len(self.tr.source.seed_programs)
        return out

    def evaluate(self, params_S, prompts: Sequence[Sequence[str]],
                 metadata: Sequence[Sequence[dict]], *, batch_size: int = 256) -> list[dict]:
        """Each seed's greedy results on its held-out prompts (``prompts[i]``, equally many
        per seed; ``params_S``: e.g. ``state.params["policy"]``), one dict per seed: with a
        device reward all seeds in one program (``evaluate_seeds``), else the one
        evaluator per seed (``rljax.train.sources.evaluate.evaluate``)."""
        if self.tr.source.on_device:
            return evaluate_seeds(self.tr.source, params_S, prompts, metadata,
                                  batch_size=batch_size)
        return [evaluate(self.tr.source, unstack(params_S, i), p, m, batch_size=batch_size)
                for i, (p, m) in enumerate(zip(prompts, metadata))]


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
def seeds_sft_update(graphdef, cfg: SFTConfig, num_micro: int, active_S, params, opt_state,
                     counters, batch):
    """One SFT update of every seed (leading seed axis; ``graphdef``, the SFT config and
    the micro-batch count static); a seed whose ``active_S`` flag is False passes
    through unchanged."""
    update = sft_update_fn(graphdef, cfg, num_micro)

    def one(active, params, opt_state, counters, batch):
        new = update(params, opt_state, counters, batch, None)
        keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(active, x, y), a, b)
        return keep(new[0], params), keep(new[1], opt_state), keep(new[2], counters), new[3]

    return jax.vmap(one)(active_S, params, opt_state, counters, batch)


class SeedSFT:
    """The SFT update for ``S`` seeds in one program; ``step(state, batch_S, active_S)``
    leaves seeds whose ``active`` flag is False unchanged."""

    def __init__(self, graphdef, cfg: SFTConfig):
        self.sft = SFTTrainer(graphdef, cfg)
        self.cfg = cfg
        self._programs: set = set()

    def compiled(self) -> int:
        """How many update programs this warm-up needed (distinct micro-batch counts and
        argument shapes; each compiled once per process)."""
        return len(self._programs)

    def init_state(self, policy_params: Sequence, seeds: Sequence[int]) -> TrainState:
        """Stacked fresh SFT states, seed ``seeds[i]`` around ``policy_params[i]``."""
        return stack_states([self.sft.init_state(p, seed=int(s))
                             for p, s in zip(policy_params, seeds)])

    def step(self, state: TrainState, batches: Sequence[dict], active: Sequence[bool]):
        """One SFT update of each active seed on its own batch (``batches[i]``, from
        ``rljax.train.batching.encode_pairs``); returns ``(state, metrics per seed)``."""
        b = next(iter(batches[0].values())).shape[0]
        num_micro = num_micro_batches(b, self.cfg.micro_batch_size, "SFT batch")
        batch = {k: jnp.asarray(np.stack([x[k] for x in batches])) for k in batches[0]}
        act = jnp.asarray(np.asarray(active, bool))
        counters = (state.updates, state.nonfinite_run, state.skipped)
        args = (act, state.params, state.opt_state, counters, batch)
        self._programs.add(program_signature(num_micro, args))
        params, opt_state, counters, m = seeds_sft_update(self.sft.graphdef, self.cfg,
                                                          num_micro, *args)
        step = state.step + act.astype(jnp.int32)
        state = dataclasses.replace(state, params=params, opt_state=opt_state, step=step,
                                    updates=counters[0], nonfinite_run=counters[1],
                                    skipped=counters[2])
        return state, _per_seed(m, len(batches))
