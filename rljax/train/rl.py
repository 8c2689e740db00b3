"""``RLTrainer``: the colocated RL step as one SPMD program over all processes:

  prompts (own block) -> sampler (global) -> own rows' texts -> rewards (global array)
  -> one jitted learning program (``rljax.train.learn``) -> one dict of scalars.

The trainer chooses its rollout source once (``rljax.train.sources``: host rewards, a
device reward, environment episodes, each wrapped in DAPO's ``Refill`` when dynamic
sampling is on) and runs every step through the one driver, ``rljax.train.driver.rl_step``.

One ``RLTrainer`` serves every algorithm in ``rljax.train.config.ALGORITHMS``: the
algorithm config picks the objective, the advantage estimator, where the KL goes and
whether a value model is trained (see ``rljax.train.learn.algorithms``). Prompts come from a
*prompt source*, ``source(start, n) -> (prompts: list[str], metadata: list[dict])``,
addressed by global position, so a resumed run, or a run on another number of
processes, reads exactly the same prompts. Rewards are host functions
``(completions, metadata) -> float32[B]`` or item rewards for ``rljax.rewards.score_batch``.

Only named transfers cross the host boundary inside a step (``rljax.train.hosts``): the
data position and prompt ids in, own rows' token ids out, rewards in, DAPO's kept-group
count out, and the metrics dict out.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from rljax.rewards.device import is_device_reward
from rljax.sharding import check_process_blocks, output_shardings
from rljax.train import hosts
from rljax.train import throughput
from rljax.train.batch import PromptSource
from rljax.train.config import (AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig,
                                check_algorithm_sampling, check_packing)
from rljax.train.config.checks import corrects_sampler
from rljax.train.async_driver import async_step
from rljax.train.driver import rl_step
from rljax.train.learn import algorithms as alg
from rljax.train.learn.loss import rl_loss
from rljax.train.learn.layout import Layout
from rljax.models.lora import trainable_of
from rljax.train.learn.reference import lora_base, make_reference
from rljax.train.learn.update import (NonFiniteError, TrainState, init_opt_state, new_train_state,
                                      num_micro_batches)
from rljax.train.multiturn import MultiTurnConfig, MultiTurnRollouts
from rljax.train.programs.paths import graph_model_config, resolve_layout, resolve_paths
from rljax.train.programs.step import StepSpec, optimizers, schedule_updates
from rljax.train.sources import Window
from rljax.train.sources.device import DeviceRewardSource
from rljax.train.sources.episodes import Episodes
from rljax.train.sources.evaluate import evaluate
from rljax.train.sources.host import Rollouts
from rljax.train.sources.refill import Refill
from rljax.train.throughput import PhaseTimes

__all__ = ["PhaseTimes", "PromptSource", "RLTrainer", "rl_loss"]


def _check_async(rl: RLConfig, algorithm: AlgorithmConfig, device_reward) -> None:
    """An asynchronous step's needs (``RLConfig.max_staleness >= 1``)."""
    if not rl.max_staleness:
        return
    if device_reward is not None:
        raise ValueError("RLConfig.max_staleness >= 1 overlaps the host's scoring with "
                         "learning; a device reward's step is one program with no host work "
                         "to overlap: use max_staleness=0, or a host reward")
    if not algorithm.loss.ratio and algorithm.objective is None and not corrects_sampler(
            algorithm):
        raise ValueError(f"RLConfig.max_staleness={rl.max_staleness} learns from samples up "
                         f"to {rl.max_staleness} updates old, and algorithm "
                         f"{algorithm.name!r}'s loss (A log pi) has no importance ratio: "
                         "set algorithm.tis_cap (the behaviour-policy correction) or use a "
                         "clipped ratio (name='grpo', 'ppo')")
    if algorithm.old_logp == "sampler":
        raise ValueError("RLConfig.max_staleness >= 1 takes the ratio against the proximal "
                         "policy (the weights before the update) and corrects the sampler's "
                         "with tis_cap / is_mode; algorithm.old_logp='sampler' would take "
                         "it against the stale sampler: use old_logp='auto' or 'recompute'")


def _check_multiturn(multiturn, reward_fns, algorithm) -> None:
    """A multi-turn trainer's arguments: its rewards are the environments' returns."""
    if not isinstance(multiturn, MultiTurnConfig):
        raise TypeError(f"RLTrainer: multiturn must be a MultiTurnConfig, got "
                        f"{type(multiturn).__name__}")
    if reward_fns is not None:
        raise ValueError("RLTrainer: with multiturn the environments' episode returns are "
                         "the rewards; pass reward_fns=None")


class RLTrainer:
    """RL post-training of a decoder ``(policy_graphdef, params)`` on one device mesh.

    The forward paths (attention, head form, prompt layout, layers) are resolved once,
    here (``rljax.train.programs.paths.resolve_paths``): ``paths`` holds them, ``share_group`` is
    their prompt group, and every step's spec carries them.

    Args:
      policy_graphdef: ``nnx.split(model)[0]`` of the policy (and frozen reference).
      tokenizer: encodes prompts and decodes completions (needs ``eos_token_id``).
      reward_fns: a batch reward ``(completions, metadata) -> float32[B]``, a list of
        item rewards ``(completion, meta) -> float`` (summed; see ``score_batch``), or a
        device reward (``rljax.rewards.device.DeviceReward``): then each step is one
        compiled program, sample -> score -> learn (``rljax.train.programs.device``).
      algorithm, optim, sampling, rl: configs (``algorithm`` is resolved against its
        name's preset).
      prompt_len: prompt width cap in tokens (longer prompts are an error naming the index).
      value_graphdef: the value model's graphdef (``algorithm.needs_value_model``: PPO).
      accuracy_fn: optional verifier ``(completion, meta) -> bool`` for the accuracy metric.
      mesh: device mesh (all processes' devices), or None for one device.
      reward_pool, reward_timeout_s: a ``rljax.rewards.RewardPool`` and the per-item time
        limit of item rewards (a call past it scores 0 and is logged).
      prompt_multiple: prompts are padded to a multiple of this (the compiled buckets).
      multiturn: a ``rljax.train.multiturn.MultiTurnConfig``: episodes with an
        environment per row (``rljax.train.multiturn.MultiTurnRollouts``; observation
        tokens get loss mask 0); the episode return is the reward, so ``reward_fns``
        must be None. With dynamic sampling, DAPO's rounds are rounds of episodes.
      teacher: ``(graphdef, params)`` of a frozen teacher decoder that shares the
        tokenizer (``algorithm.needs_teacher`` only, and required there; see
        ``rljax.run.teacher.load_teacher``): its log-probs are computed inside the
        learning program; the trainer keeps it, it is not part of the ``TrainState``.
    """

    def __init__(self, policy_graphdef, tokenizer, reward_fns, *, algorithm: AlgorithmConfig,
                 optim: OptimConfig, sampling: SamplingConfig, rl: RLConfig, prompt_len: int,
                 value_graphdef=None, accuracy_fn=None, mesh=None, reward_pool=None,
                 reward_timeout_s: float | None = None, prompt_multiple: int = 16,
                 teacher: tuple | None = None, multiturn: MultiTurnConfig | None = None):
        for name, val, cls in (("algorithm", algorithm, AlgorithmConfig),
                               ("optim", optim, OptimConfig),
                               ("sampling", sampling, SamplingConfig), ("rl", rl, RLConfig)):
            if not isinstance(val, cls):
                raise TypeError(f"RLTrainer: {name} must be a {cls.__name__}, got "
                                f"{type(val).__name__}")
        algorithm = algorithm.resolve()  # the preset of algorithm.name under explicit fields
        est = (f"(algorithm={algorithm.name!r}, "
               f"advantage_estimator={algorithm.advantage_estimator!r})")
        if algorithm.needs_value_model != (value_graphdef is not None):
            raise ValueError("RLTrainer: value_graphdef is required for algorithm 'ppo' "
                             f"(advantage_estimator='gae') and not allowed otherwise {est}")
        if algorithm.needs_teacher != (teacher is not None):
            raise ValueError("RLTrainer: teacher=(graphdef, params) is required for algorithm "
                             f"'distill' (advantage_estimator='teacher') and not allowed "
                             f"otherwise {est}")
        if multiturn is not None:
            _check_multiturn(multiturn, reward_fns, algorithm)
        self.device_reward = reward_fns if is_device_reward(reward_fns) else None
        self.teacher_gd, self.teacher_params = teacher if teacher is not None else (None, None)
        if mesh is not None:  # a mesh from jax.make_mesh on a TPU slice would mis-score
            check_process_blocks(mesh)
        self.gd, self.value_gd, self.mesh = policy_graphdef, value_graphdef, mesh
        self.alg, self.optim, self.sampling, self.rl = algorithm, optim, sampling, rl
        self.batch_size = rl.prompts_per_step * algorithm.group_size
        num_micro = self._check_divisions()
        self.old_mode = ("self" if algorithm.old_logp == "auto" and algorithm.single_update
                         else ("sampler" if algorithm.old_logp == "sampler" else "recompute"))
        self.uses_ref = algorithm.kl_in != "none" and algorithm.kl_coef > 0
        # The response budget: a multi-turn episode's is its model tokens over every turn.
        budget = (sampling.max_new_tokens if multiturn is None
                  else multiturn.response_budget(sampling.max_new_tokens))
        check_algorithm_sampling(algorithm, sampling, budget)
        overlong = alg.resolve_overlong_buffer(algorithm, budget)
        check_packing(rl, algorithm, self.device_reward is not None)
        _check_async(rl, algorithm, self.device_reward)
        self.last_layout: Layout | None = None  # the latest step's (a packed one sized)
        self.num_params = 0  # the policy's parameter count (init_state): the step's FLOPs
        # What of the policy trains (every parameter, or its adapters): decided here, once.
        self.trainable = trainable_of(policy_graphdef)
        self.paths = resolve_paths(
            policy_graphdef, objective=alg.make_objective(algorithm, budget),
            one_pass_head=rl.one_pass_head,
            share_prompts=rl.share_prompts, tokens_per_micro_batch=rl.tokens_per_micro_batch,
            group_size=algorithm.group_size, remat=rl.remat,
            rows_per_micro=self.batch_size // algorithm.num_minibatches // num_micro,
            other_gds=(self.teacher_gd,) if self.teacher_gd is not None else (),
            backend=jax.default_backend())
        self.share_group = self.paths.prompt_group
        kw = dict(sampling=sampling, prompt_len=prompt_len, group_size=algorithm.group_size,
                  mesh=mesh, prompt_multiple=prompt_multiple)
        self.rollouts, self.multiturn = None, None  # the single-turn / episode source
        if multiturn is not None:
            self.multiturn = MultiTurnRollouts(
                policy_graphdef, tokenizer, multiturn.make_env, limits=multiturn.limits,
                pool=multiturn.pool, return_mode=multiturn.return_mode, gamma=multiturn.gamma,
                obs_multiple=multiturn.obs_multiple, chat=multiturn.chat,
                max_model_tokens=budget, **kw)
            self.source = Episodes(self.multiturn)
        elif self.device_reward is not None:
            self.rollouts = self.source = DeviceRewardSource(
                policy_graphdef, tokenizer, reward_fns, accuracy_fn=accuracy_fn, **kw)
        else:
            self.rollouts = self.source = Rollouts(
                policy_graphdef, tokenizer, reward_fns, accuracy_fn=accuracy_fn,
                reward_pool=reward_pool, reward_timeout_s=reward_timeout_s, **kw)
        if algorithm.dynamic_sampling:  # DAPO's rounds around whichever host source
            self.source = Refill(self.source, max_refill_rounds=algorithm.max_refill_rounds)
        total = rl.steps * algorithm.num_epochs * algorithm.num_minibatches
        self.base_spec = StepSpec(
            algorithm.spec(), self.old_mode, self.uses_ref,
            resolve_layout(self.paths, num_micro, self._batch_shards()), rl.logp_chunk,
            sampling.temperature, budget, overlong, policy_graphdef,
            value_graphdef, self.teacher_gd, optim, schedule_updates(optim, total),
            rl.value_lr_ratio if value_graphdef is not None else 1.0, rl.remat, self.paths,
            self.device_reward, mesh, trainable=self.trainable)
        self.txs = {k: v[0] for k, v in optimizers(self.base_spec).items()}

    def _batch_shards(self) -> int:
        """The batch shards (data x fsdp; 1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def _check_divisions(self) -> int:
        a = self.alg
        if self.batch_size % a.num_minibatches:
            raise ValueError(f"AlgorithmConfig.num_minibatches={a.num_minibatches} does not "
                             f"divide the batch of {self.batch_size} completions "
                             f"(prompts_per_step x group_size)")
        mb = self.batch_size // a.num_minibatches
        if a.micro_batch_size and mb % a.micro_batch_size:
            raise ValueError(f"AlgorithmConfig.micro_batch_size={a.micro_batch_size} does not "
                             f"divide the minibatch of {mb} completions")
        num_micro = num_micro_batches(mb, a.micro_batch_size, "minibatch")
        n_dev = self._batch_shards()
        if (mb // num_micro) % n_dev:
            raise ValueError(f"micro-batches of {mb // num_micro} completions do not split over "
                             f"the data x fsdp = {n_dev} devices; choose prompts_per_step, "
                             f"num_minibatches and micro_batch_size so they are a multiple "
                             f"of {n_dev}")
        return num_micro

    def step_spec(self, state: TrainState) -> StepSpec:
        """The spec of this trainer's step programs for ``state``: ``base_spec`` with, on a
        mesh, the shardings of the state's parameters and optimiser state (what the
        programs return). Everything the programs read is in it; JAX's cache keys the
        compiled programs by it (``rljax.train.programs.step``)."""
        if self.mesh is None:
            return self.base_spec
        return dataclasses.replace(self.base_spec, out_shardings=output_shardings(
            self.mesh, (state.params, state.opt_state)))

    def init_state(self, policy_params, seed: int = 0, value_params=None) -> TrainState:
        """Fresh state: new optimiser moments; the reference is a frozen copy of the
        policy as it is now, the start of RL (only kept when a KL term is used), stored as
        ``rl.ref_dtype`` (see ``rljax.train.learn.reference``); scalars are replicated
        global arrays. A policy with LoRA adapters trains only them, keeps its base in
        the compute dtype, and its reference copies only the adapters (on its own base).
        The state takes ownership of ``policy_params`` / ``value_params``: updates donate
        their buffers, so do not use the passed arrays afterwards (copy them first)."""
        self.num_params = sum(x.size for x in jax.tree.leaves(policy_params))
        params = {"policy": lora_base(self.gd, policy_params, self.trainable)}
        if self.value_gd is not None:
            if value_params is None:
                raise ValueError("RLTrainer.init_state: value_params is required for PPO")
            params["value"] = value_params
        ref = (make_reference(self.gd, policy_params, self.rl.ref_dtype,
                              trainable=self.trainable) if self.uses_ref else None)
        opt_state = init_opt_state(self.txs, params, self.mesh, {"policy": self.trainable})
        return new_train_state(params, opt_state, seed,
                               ref_params=ref, kl_coef=self.alg.kl_coef, mesh=self.mesh)

    # ------------------------------------------------------------------ one RL step
    def step(self, state: TrainState, source: PromptSource):
        """One RL step on prompts ``source(state.data_pos, prompts_per_step)`` (more when
        dynamic sampling refills; ``rljax.train.driver.rl_step``), or with
        ``rl.max_staleness >= 1`` on the oldest in-flight batch while the next is
        collected (``rljax.train.async_driver.async_step``). Returns ``(state, metrics:
        dict[str, float])``."""
        n = self.rl.prompts_per_step
        if self.rl.max_staleness:
            out = async_step(self.step_spec(state), self.source, state, source, n,
                             self.rl.max_staleness, teacher_params=self.teacher_params)
        else:
            window = Window(source, int(hosts.fetch_scalars(state.data_pos)), n)
            out = rl_step(self.step_spec(state), self.source, state, window,
                          teacher_params=self.teacher_params)
        self.last_layout = out.spec.layout
        return out.state, self.finish_metrics(out.metrics, out.times, out.state.params)

    def finish_metrics(self, m: dict, ph: PhaseTimes, params: dict | None = None,
                       run: str = "") -> dict:
        """The end of every RL step (one run's, or one seed's of ``rljax.train.seeds``):
        throughput and MFU added (:meth:`add_throughput`), the program's bookkeeping
        removed, and ``NonFiniteError`` once ``rl.max_nonfinite_steps`` consecutive updates
        were skipped (the message names ``run``, e.g. a seed, and the step)."""
        self.add_throughput(m, ph, params)
        done = int(m.pop("done_steps"))
        if m.pop("nonfinite_run") >= self.rl.max_nonfinite_steps:
            raise NonFiniteError(
                f"{run}step {done - 1}: {self.rl.max_nonfinite_steps} or more consecutive "
                f"updates had a non-finite loss or gradient (limit max_nonfinite_steps="
                f"{self.rl.max_nonfinite_steps}); stopping")
        return m

    def add_throughput(self, m: dict, ph: PhaseTimes, params: dict | None = None) -> None:
        """Tokens/s (whole mesh and per chip), phase times, model FLOP/s and MFU
        (``rljax.train.throughput``; ``rl.peak_flops`` overrides the chip's table peak).
        The FLOPs count every pass of the step once (``step_model_flops``), each group's
        prompt once where the forwards (and the sampler's prefill) share it; the token
        rates count every row's prompt. ``params``: the step's parameters (the value
        model's count in PPO); None for a step without a value model."""
        gen, seq = m["completion_tokens"], m["completion_tokens"] + m["prompt_tokens"]
        # DAPO samples rounds it drops: the sampler's FLOPs and rate count all of them.
        gen = m.get("dyn_sampled_tokens", gen)
        prefill = m.get("dyn_sampled_prompt_tokens", m["prompt_tokens"]) / self.alg.group_size
        computed = m["completion_tokens"] + m["prompt_tokens"] / self.share_group
        fwd = (self.uses_ref + (self.old_mode == "recompute" or (
            self.alg.needs_value_model and self.old_mode == "self"))
            + (alg.cov_rule(self.alg) is not None) * self.alg.num_epochs)
        size = lambda t: 0 if t is None else sum(x.size for x in jax.tree.leaves(t))
        # An MoE model computes with its active parameters (the k experts a token uses).
        active = lambda gd, n: n if gd is None else throughput.active_count(
            n, graph_model_config(gd))
        policy = None if params is None else params.get("policy")
        lora = policy is not None and self.trainable.adapters  # weight gradients: adapters
        flops = throughput.step_model_flops(
            active(self.gd, self.num_params or size(policy)), gen_tokens=gen,
            seq_tokens=computed, extra_forwards=fwd, epochs=self.alg.num_epochs,
            teacher_params=active(self.teacher_gd, size(self.teacher_params)),
            prefill_tokens=prefill, value_params=active(
                self.value_gd, size(None if params is None else params.get("value"))),
            trainable_params=size(self.trainable.split(policy)[0]) if lora else None)
        chips, kind = throughput.chips_and_kind(self.mesh)
        m.update(throughput.step_throughput(
            gen_tokens=gen, seq_tokens=seq, epochs=self.alg.num_epochs, times=ph.times,
            flops=flops, num_chips=chips,
            peak_per_chip=self.rl.peak_flops or throughput.peak_flops_per_chip(kind)))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, state_or_params, prompts: Sequence[str], metadata: Sequence[dict],
                 *, batch_size: int = 256) -> dict:
        """Greedy decoding on held-out prompts: ``{"accuracy", "reward_mean", ...}``."""
        params = (state_or_params.params["policy"] if isinstance(state_or_params, TrainState)
                  else state_or_params)
        return evaluate(self.source, params, prompts, metadata, batch_size=batch_size)
