"""The colocated RL loop: rollout -> rewards -> reference / old log-probs (-> values, GAE)
-> advantages -> epochs x minibatches of jitted updates -> metrics.

One ``RLTrainer`` serves every algorithm in ``rljax.train.config.ALGORITHMS``: the
algorithm config picks the objective, the advantage estimator, where the KL goes and
whether a value model is trained (see ``rljax.train.algorithms``). Prompts come from a
*prompt source*, ``source(start, n) -> (prompts: list[str], metadata: list[dict])``,
addressed by position so a resumed run reads exactly the prompts the original would.
Rewards are host functions ``(completions, metadata) -> float32[B]`` or item rewards
for ``rljax.rewards.score_batch``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax import objectives as obj
from rljax.train import algorithms as alg
from rljax.train import ppo as ppo_lib
from rljax.train.config import AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig
from rljax.train.logprobs import policy_logprobs
from rljax.train.rollout import Rollout, Rollouts
from rljax.train.step import Learner, TrainState, make_optimizer, new_train_state

sg = jax.lax.stop_gradient
PromptSource = Callable[[int, int], tuple[Sequence[str], Sequence[dict]]]


def rl_loss(params, mb: dict, coef, *, policy_gd, value_gd, objective, chunk, temperature,
            remat, self_old: bool, use_sampler: bool, entropy_grad: bool):
    """The RL micro-batch loss: current log-probs (and values) -> ``ObjectiveBatch`` ->
    the objective's ``(loss_sum, count, metrics)`` plus the sampler-gap metric."""
    logp, ent = policy_logprobs(policy_gd, params["policy"], mb, chunk=chunk,
                                temperature=temperature, remat=remat)
    m = mb["completion_mask_BxT"]
    values = None
    if value_gd is not None:
        values = ppo_lib.value_predictions(value_gd, params["value"], mb, remat=remat)
    batch = obj.ObjectiveBatch(
        logp_BxT=logp, old_logp_BxT=sg(logp) if self_old else mb["old_logp_BxT"], mask_BxT=m,
        adv_BxT=mb["adv_BxT"], ref_logp_BxT=mb.get("ref_logp_BxT"),
        sampler_logp_BxT=mb["sampler_logp_BxT"] if use_sampler else None,
        values_BxT=values, old_values_BxT=mb.get("old_values_BxT"),
        returns_BxT=mb.get("returns_BxT"), entropy_BxT=ent if entropy_grad else sg(ent),
    )
    loss_sum, count, metrics = objective(batch, coef)
    n = jnp.sum(m)
    gap = jnp.where(m > 0, jnp.abs(sg(logp) - mb["sampler_logp_BxT"]), 0.0)
    metrics = dict(metrics)
    metrics["sampler_gap"] = (jnp.sum(gap), n)
    return loss_sum, count, metrics


@dataclasses.dataclass
class _Phase:
    """Wall-clock seconds per phase of one step."""

    times: dict = dataclasses.field(default_factory=dict)

    def timed(self, name: str, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        jax.block_until_ready(out)
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        return out


class RLTrainer:
    """RL post-training of a decoder ``(policy_graphdef, params)`` on one device mesh.

    Args:
      policy_graphdef: ``nnx.split(model)[0]`` of the policy (and frozen reference).
      tokenizer: encodes prompts and decodes completions (needs ``eos_token_id``).
      reward_fns: a batch reward ``(completions, metadata) -> float32[B]`` or a list of
        item rewards ``(completion, meta) -> float`` (summed; see ``score_batch``).
      algorithm, optim, sampling, rl: configs.
      prompt_len: prompt width in tokens (longer prompts are an error naming the index).
      value_graphdef: the value model's graphdef (PPO only).
      accuracy_fn: optional verifier ``(completion, meta) -> bool`` for the accuracy metric.
      mesh: device mesh, or None for one device.
    """

    def __init__(self, policy_graphdef, tokenizer, reward_fns, *, algorithm: AlgorithmConfig,
                 optim: OptimConfig, sampling: SamplingConfig, rl: RLConfig, prompt_len: int,
                 value_graphdef=None, accuracy_fn=None, mesh=None):
        for name, val, cls in (("algorithm", algorithm, AlgorithmConfig),
                               ("optim", optim, OptimConfig),
                               ("sampling", sampling, SamplingConfig), ("rl", rl, RLConfig)):
            if not isinstance(val, cls):
                raise TypeError(f"RLTrainer: {name} must be a {cls.__name__}, got "
                                f"{type(val).__name__}")
        if (algorithm.name == "ppo") != (value_graphdef is not None):
            raise ValueError("RLTrainer: value_graphdef is required for algorithm 'ppo' "
                             f"and not allowed otherwise (algorithm={algorithm.name!r})")
        self.gd, self.value_gd, self.mesh = policy_graphdef, value_graphdef, mesh
        self.alg, self.optim, self.sampling, self.rl = algorithm, optim, sampling, rl
        self.batch_size = rl.prompts_per_step * algorithm.group_size
        self._check_divisions()
        self.old_mode = ("self" if algorithm.old_logp == "auto" and algorithm.single_update
                         else ("sampler" if algorithm.old_logp == "sampler" else "recompute"))
        self.uses_ref = algorithm.kl_in != "none" and algorithm.kl_coef > 0
        self.overlong = (alg.resolve_overlong_buffer(algorithm, sampling.max_new_tokens)
                         if algorithm.name == "dapo" or algorithm.overlong_buffer else 0)
        self.kl_ctl = ppo_lib.AdaptiveKLController(algorithm.adaptive_kl_target,
                                                   algorithm.adaptive_kl_horizon)
        self.rollouts = Rollouts(policy_graphdef, tokenizer, reward_fns, sampling=sampling,
                                 prompt_len=prompt_len, group_size=algorithm.group_size,
                                 accuracy_fn=accuracy_fn, mesh=mesh)
        self._build_learner()
        fwd = functools.partial(policy_logprobs, policy_graphdef, chunk=rl.logp_chunk,
                                temperature=sampling.temperature)
        self._logp = jax.jit(lambda p, s: fwd(p, s)[0])
        if value_graphdef is not None:
            self._values = jax.jit(functools.partial(ppo_lib.value_predictions, value_graphdef))

    def _check_divisions(self):
        a = self.alg
        if self.batch_size % a.num_minibatches:
            raise ValueError(f"AlgorithmConfig.num_minibatches={a.num_minibatches} does not "
                             f"divide the batch of {self.batch_size} completions "
                             f"(prompts_per_step x group_size)")
        mb = self.batch_size // a.num_minibatches
        if a.micro_batch_size and mb % a.micro_batch_size:
            raise ValueError(f"AlgorithmConfig.micro_batch_size={a.micro_batch_size} does not "
                             f"divide the minibatch of {mb} completions")

    def _build_learner(self):
        a, total = self.alg, max(self.rl.steps * self.alg.num_epochs * self.alg.num_minibatches, 1)
        optims = {"policy": make_optimizer(self.optim, total)}
        if self.value_gd is not None:
            optims["value"] = make_optimizer(self.optim, total, self.rl.value_lr_ratio)
        loss = functools.partial(
            rl_loss, policy_gd=self.gd, value_gd=self.value_gd,
            objective=alg.make_objective(a, self.sampling.max_new_tokens),
            chunk=self.rl.logp_chunk, temperature=self.sampling.temperature, remat=self.rl.remat,
            self_old=self.old_mode == "self",
            use_sampler=bool(np.isfinite(a.tis_cap)) or a.old_logp == "sampler",
            entropy_grad=a.entropy_coef != 0.0,
        )
        self.learner = Learner(loss, optims, micro_batch_size=a.micro_batch_size,
                               max_nonfinite=self.rl.max_nonfinite_steps, mesh=self.mesh)

    def init_state(self, policy_params, seed: int = 0, value_params=None) -> TrainState:
        """Fresh state: new optimiser moments; the reference is a frozen copy of the
        policy (only kept when a KL term is used). The state takes ownership of
        ``policy_params`` / ``value_params``: updates donate their buffers, so do not
        use the passed arrays afterwards (copy them first if you need them)."""
        params = {"policy": policy_params}
        if self.value_gd is not None:
            if value_params is None:
                raise ValueError("RLTrainer.init_state: value_params is required for PPO")
            params["value"] = value_params
        ref = jax.tree.map(jnp.copy, policy_params) if self.uses_ref else None
        return new_train_state(params, self.learner.init_opt_state(params), seed,
                               ref_params=ref, kl_coef=self.alg.kl_coef)

    # ------------------------------------------------------------------ one RL step
    def step(self, state: TrainState, source: PromptSource):
        """One RL step on prompts ``source(state.data_pos, prompts_per_step)`` (more when
        dynamic sampling refills). Returns ``(state, metrics: dict[str, float])``."""
        ph = _Phase()
        key, k_roll, k_perm = jax.random.split(jax.random.wrap_key_data(state.key), 3)
        ro, data_pos, extra = self._collect(state, source, k_roll, ph)
        batch = self._prepare(state, ro, ph)
        kl_coef = float(state.kl_coef)
        state, upd_metrics = self._updates(state, batch, kl_coef, k_perm, ph)
        metrics = self._metrics(ro, batch, upd_metrics, ph, extra, state)
        if self.alg.kl_in == "reward" and self.uses_ref:
            kl = ppo_lib.sequence_kl(batch["old_logp_BxT"], batch["ref_logp_BxT"],
                                     batch["completion_mask_BxT"])
            kl_coef = self.kl_ctl.update(kl_coef, kl, self.batch_size)
        metrics["kl_coef"] = kl_coef
        state = dataclasses.replace(
            state, step=state.step + 1, key=jax.random.key_data(key),
            data_pos=jnp.asarray(data_pos, jnp.int32), kl_coef=jnp.asarray(kl_coef, jnp.float32))
        return state, metrics

    def _collect(self, state, source, key, ph):
        """Rollouts and rewards; DAPO's dynamic sampling drops zero-variance groups and
        samples further prompts until the batch is full (or rounds run out)."""
        pos, n = int(state.data_pos), self.rl.prompts_per_step
        params = state.params["policy"]
        kept: list[Rollout] = []
        spare: list[Rollout] = []  # dropped groups, used as padding if refills run out
        rounds, dropped, zero_var_first = 0, 0, None
        while True:
            key, k = jax.random.split(key)
            prompts, meta = source(pos, n)
            pos += n
            ro = self.rollouts.sample(params, list(prompts), list(meta), k, ph)
            if self.overlong:
                ro.rewards_B = ro.rewards_B + alg.overlong_shaping(
                    ro.lengths_B, self.sampling.max_new_tokens, self.overlong,
                    self.alg.overlong_penalty)
            zv = ro.zero_variance_groups()
            zero_var_first = float(zv.mean()) if zero_var_first is None else zero_var_first
            if not self.alg.dynamic_sampling:
                return ro, pos, {"zero_var_frac": zero_var_first}
            dropped += int(zv.sum())
            kept.append(ro.select_groups(~zv))
            spare.append(ro.select_groups(zv))
            have = sum(r.num_groups for r in kept)
            if have >= n or rounds >= self.alg.max_refill_rounds:
                break
            rounds += 1
        # Zero-variance groups have zero advantage: as padding they only fill the shape.
        ro = Rollout.concat(kept + spare).first_groups(n)
        short = max(0, n - have)
        return ro, pos, {"zero_var_frac": zero_var_first, "dyn_refill_rounds": rounds,
                         "dyn_dropped_groups": dropped, "dyn_short_groups": short}

    def _prepare(self, state, ro: Rollout, ph) -> dict:
        """Reference / old log-probs, values and advantages -> the update batch (host)."""
        seqs = ro.seqs()
        batch = dict(seqs)
        batch["sampler_logp_BxT"] = ro.sampler_logp_BxT
        dev = self.learner.put_batch(seqs)
        if self.uses_ref:
            batch["ref_logp_BxT"] = np.asarray(ph.timed("ref_logp", self._logp, state.ref_params, dev))
        if self.old_mode == "recompute":
            batch["old_logp_BxT"] = np.asarray(
                ph.timed("old_logp", self._logp, state.params["policy"], dev))
        elif self.old_mode == "sampler":
            batch["old_logp_BxT"] = ro.sampler_logp_BxT
        mask = seqs["completion_mask_BxT"]
        if self.alg.name == "ppo":
            old = batch.get("old_logp_BxT")
            if old is None:  # single update: the rollout policy is the current one
                old = np.asarray(ph.timed("old_logp", self._logp, state.params["policy"], dev))
                batch["old_logp_BxT"] = old
            values = np.asarray(ph.timed("values", self._values, state.params["value"], dev))
            adv, ret, _ = ppo_lib.ppo_advantages(
                ro.rewards_B, old, batch.get("ref_logp_BxT"), values, mask,
                kl_coef=float(state.kl_coef), kl_kind=self.alg.kl_kind, gamma=self.alg.gamma,
                lam=self.alg.lam, whiten_adv=self.alg.whiten_advantages)
            batch.update(adv_BxT=np.asarray(adv), returns_BxT=np.asarray(ret),
                         old_values_BxT=values)
        else:
            adv_B = alg.sequence_advantages(self.alg, ro.rewards_B)
            batch["adv_BxT"] = np.asarray(obj.broadcast_to_tokens(adv_B, mask))
        return {k: np.asarray(v) for k, v in batch.items()}

    def _updates(self, state, batch, kl_coef, key, ph):
        """``num_epochs`` passes of ``num_minibatches`` shuffled minibatch updates."""
        a = self.alg
        coef = alg.make_coef(a, kl_coef)
        sums: dict[str, float] = {}
        first: dict[str, float] = {}
        n_upd = 0
        t0 = time.perf_counter()
        for epoch in range(a.num_epochs):
            key, k = jax.random.split(key)
            order = (np.asarray(jax.random.permutation(k, self.batch_size))
                     if a.num_minibatches > 1 else np.arange(self.batch_size))
            for idx in np.array_split(order, a.num_minibatches):
                mb = {kk: v[np.sort(idx)] for kk, v in batch.items()}
                state, m = self.learner.update(state, mb, coef, what="minibatch")
                m = {kk: float(v) for kk, v in m.items()}
                first = first or m
                for kk, v in m.items():
                    sums[kk] = sums.get(kk, 0.0) + v
                n_upd += 1
        ph.times["update"] = time.perf_counter() - t0
        out = {k: v / n_upd for k, v in sums.items()}
        # The gap is between the sampler and the weights it sampled with: first update.
        out["sampler_gap"] = first.get("sampler_gap", float("nan"))
        out["skipped_updates"] = out.pop("skipped_update", 0.0) * n_upd
        return state, out

    def _metrics(self, ro: Rollout, batch, upd, ph, extra, state) -> dict:
        """The per-step metrics (see issue 5 item 6)."""
        m = dict(upd)
        m.update(extra)
        m.update(ro.metrics())
        tokens = float(batch["completion_mask_BxT"].sum())
        seq_tokens = tokens + float(batch["prompt_mask_BxP"].sum())
        roll_s = ph.times.get("rollout", 0.0)
        m["rollout_tok_s"] = tokens / roll_s if roll_s > 0 else 0.0
        upd_s = ph.times.get("update", 0.0)
        passes = self.alg.num_epochs
        m["train_tok_s"] = passes * seq_tokens / upd_s if upd_s > 0 else 0.0
        for k, v in ph.times.items():
            m[f"time_{k}"] = v
        flops = self._model_flops(seq_tokens, tokens)
        total_s = sum(ph.times.values())
        m["model_flops_s"] = flops / total_s if total_s > 0 else 0.0
        if self.rl.peak_flops > 0:
            m["mfu"] = m["model_flops_s"] / self.rl.peak_flops
        m["skipped_total"] = float(state.skipped)
        return m

    def _model_flops(self, seq_tokens: float, gen_tokens: float) -> float:
        """Model FLOPs of the step: 2N per generated token, 2N per token per extra forward
        (reference / old / values), 6N per token per training pass (Kaplan et al. 2020)."""
        n = self.rollouts.num_params
        fwd = (self.uses_ref + (self.old_mode == "recompute") + (self.value_gd is not None))
        return 2 * n * gen_tokens + 2 * n * seq_tokens * fwd + 6 * n * seq_tokens * self.alg.num_epochs

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, state_or_params, prompts: Sequence[str], metadata: Sequence[dict],
                 *, batch_size: int = 256) -> dict:
        """Greedy decoding on held-out prompts: ``{"accuracy", "reward_mean", ...}``."""
        params = (state_or_params.params["policy"] if isinstance(state_or_params, TrainState)
                  else state_or_params)
        return self.rollouts.evaluate(params, list(prompts), list(metadata), batch_size)
