"""Multi-turn rollouts: the policy takes turns with an environment per row
(``rljax.envs``), one KV cache continued across turns, into one ``Rollout`` whose loss
mask covers the model's tokens only.

Per step (every process runs the same programs on global arrays; each drives only its
own rows' environments, ``rljax.train.hosts.own_rows``):

1. each process resets the environments of its rows (``EnvBatch.reset``: the first
   observation, the prompt, as token ids); the prompt ids of every process reach every
   host (the single-turn rollout's "prompt ids in" transfer) and are left-padded to a
   bucket of ``prompt_multiple``;
2. ``rljax.sampling.turns.start`` prefills them and draws each row's first token; then
   per turn: ``decode_turn`` (until each row's stop id, stop string or budget), "turn
   tokens out" (own rows), ``EnvBatch.step`` on their text, "turn flags" (the
   all-done flag and the widest observation, reduced in a program from global arrays),
   and unless every row is done "observations in" and ``observe`` (only the new ids
   are prefilled, written into the completion with loss mask 0);
3. the completion (model turns and observations), its masks, the sampler's log-probs
   (0 at observation tokens) and the episode returns become a ``Rollout`` with
   ``loss_mask_BxT`` set (and, for an MoE policy, the expert ids of every position fed:
   prompt, drawn tokens and observations, for router replay).

Token in, token out: the completion holds the ids the sampler drew and the ids
``EnvBatch`` returned (``encode`` of each observation, once), never a re-tokenised text.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax.envs import EnvBatch, EnvLimits
from rljax.envs.protocol import check_return_mode
from rljax.sampling.generate import config_of
from rljax.sampling.ops import SamplingParams
from rljax.sampling.prompts import bucket_length
from rljax.sampling.sampler import sampler_weights
from rljax.sampling.turns import (TurnSpec, cache_slots, decode_turn, observe, start,
                                  turn_flags)
from rljax.sharding import mesh_context, mesh_of
from rljax.train import hosts
from rljax.train.batching import encode_text, pad_left, special_ids, stop_ids
from rljax.train.config import SamplingConfig
from rljax.train.batch import PromptSource, Rollout, to_rollout

__all__ = ["MultiTurnConfig", "MultiTurnRollouts", "MultiTurnOutput", "response_budget",
           "stop_sequences"]


def response_budget(max_model_tokens: int | None, limits: EnvLimits, turn_tokens: int) -> int:
    """The model's tokens an episode may hold: ``max_model_tokens``, or
    ``limits.max_turns x turn_tokens`` (the per-turn budget, ``sampling.max_new_tokens``)."""
    if max_model_tokens is not None:
        return max_model_tokens
    return limits.max_turns * int(turn_tokens)


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn episodes for ``RLTrainer(multiturn=...)``: each row's environment
    answers the model's turns, and its episode return is the row's reward.

    make_env: builds one row's environment (``rljax.envs.Environment``). limits:
    ``rljax.envs.EnvLimits`` (``max_total_tokens`` is the completion width).
    pool: a ``rljax.rewards.RewardPool`` for tool calls (required when the environment
    has tools). return_mode, gamma: ``rljax.envs.episode_return`` (``"sum"`` of the
    turns' rewards, or ``"discounted"`` by ``gamma`` per turn). obs_multiple: the
    observation widths' bucket. chat: a ``rljax.envs.ChatRenderer`` (the tokenizer's
    chat template renders the prompt and each observation; the observation ids are the
    template's delta after the sampled ids), or None (observation text as it is).
    max_model_tokens: the whole-response budget, the model's tokens over an episode
    (every turn's, observations not counted): a row whose turns reach it ends, truncated;
    DAPO's overlong penalty and Dr.GRPO's constant measure the model's tokens against it
    (as verl measures a multi-turn response against its response length). None: every
    turn's full budget, ``limits.max_turns x sampling.max_new_tokens`` (the per-turn
    budget).
    """

    make_env: Callable[[], Any]
    limits: EnvLimits = EnvLimits()
    pool: Any = None
    return_mode: str = "sum"
    gamma: float = 1.0
    obs_multiple: int = 16
    chat: Any = None
    max_model_tokens: int | None = None

    def __post_init__(self):
        m = self.max_model_tokens
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"MultiTurnConfig.max_model_tokens must be an int >= 1 or None "
                             f"(the model's tokens over an episode), got {m!r}")

    def response_budget(self, turn_tokens: int) -> int:
        """The model's tokens an episode may hold: ``max_model_tokens``, or
        ``limits.max_turns x turn_tokens`` (``turn_tokens``: ``sampling.max_new_tokens``,
        the per-turn budget). Where a single-turn run reads ``max_new_tokens`` as the
        response budget (the overlong window, Dr.GRPO's constant), a multi-turn run reads
        this."""
        return response_budget(self.max_model_tokens, self.limits, turn_tokens)


def stop_sequences(tokenizer: Any, stop_strings) -> tuple[tuple[int, ...], ...]:
    """Each stop string's token ids (``encode`` without special tokens): a turn ends
    when its last tokens equal one of them. Other tokenisations of the same text are not
    matched (the turn then runs on to its budget; the environment still reads its text)."""
    out = []
    for s in stop_strings:
        ids = tuple(encode_text(tokenizer, s))
        if not ids:
            raise ValueError(f"stop string {s!r} encodes to no tokens")
        out.append(ids)
    return tuple(dict.fromkeys(out))


@dataclasses.dataclass(frozen=True)
class MultiTurnOutput:
    """A multi-turn rollout: the ``Rollout`` (global arrays) and this process's rows'
    host results. ``turn_rewards``: per row, its per-turn rewards; ``info``: per row,
    ``EnvBatch.info``; ``metrics``: the episode metrics over every process's rows
    (``env/turns``, ``env/tool_calls``, ``env/tool_errors``, ``env/tool_timeouts``,
    ``env/truncated``, ``env/env_s``, ``env/tool_s``, ``env/return``; means per episode) plus
    ``env/rollout_turns`` (the turn loop's length)."""

    rollout: Rollout
    lo: int
    hi: int
    turn_rewards: list
    info: list
    metrics: dict


class MultiTurnRollouts:
    """Samples multi-turn episodes: ``group_size`` rows per prompt, each with its own
    environment (``make_env()``), driven by ``rljax.envs.EnvBatch``.

    Args:
      graphdef: the policy's ``nnx.split(model)[0]``.
      tokenizer: ``encode`` (the observations' ids, once) and ``decode`` (each model turn's
        text for its environment); its stop ids end a turn too.
      make_env: builds one row's environment; its ``stop_strings`` (read once from a
        probe instance) end a turn when the turn's last tokens are their ids.
      sampling: the sampling distribution; ``max_new_tokens`` is the per-turn budget.
      limits: ``EnvLimits``; ``max_total_tokens`` is the completion width ``T`` (prompt,
        model turns and observations count toward it, so any episode fits).
      prompt_len: the longest first observation (an error beyond).
      group_size: rows per prompt (GRPO's group: episodes of the same prompt).
      mesh: device mesh, or None. pool: a ``RewardPool`` for tool calls.
      return_mode, gamma: the episode return that becomes ``rewards_B``
        (``rljax.envs.episode_return``: ``"sum"`` or ``"discounted"``).
      prompt_multiple, obs_multiple: bucket sizes of the prompt and observation widths.
      chat: a ``rljax.envs.ChatRenderer`` for ``EnvBatch`` (see ``MultiTurnConfig``).
      max_model_tokens: the model's tokens over an episode (``EnvBatch``'s; see
        ``MultiTurnConfig``); None: no bound beyond the turns' budgets.
    """

    def __init__(self, graphdef, tokenizer, make_env: Callable[[], Any], *,
                 sampling: SamplingConfig, limits: EnvLimits, prompt_len: int,
                 group_size: int, mesh=None, pool=None, return_mode: str = "sum",
                 gamma: float = 1.0, prompt_multiple: int = 16, obs_multiple: int = 16,
                 chat=None, max_model_tokens: int | None = None):
        check_return_mode(return_mode, gamma)
        if not isinstance(limits, EnvLimits):
            raise TypeError(f"MultiTurnRollouts: limits must be an EnvLimits, got "
                            f"{type(limits).__name__}")
        if prompt_len > limits.max_total_tokens:
            raise ValueError(f"MultiTurnRollouts: prompt_len={prompt_len} is over "
                             f"limits.max_total_tokens={limits.max_total_tokens}")
        self.gd, self.tok, self.make_env, self.mesh = graphdef, tokenizer, make_env, mesh
        self.chat, self.max_model_tokens = chat, max_model_tokens
        self.sampling, self.limits, self.pool = sampling, limits, pool
        self.prompt_len, self.group_size = prompt_len, group_size
        self.return_mode, self.gamma = return_mode, gamma
        self.prompt_multiple, self.obs_multiple = prompt_multiple, obs_multiple
        self.pad_id, self.eos_id = special_ids(tokenizer)
        self.stop_ids = stop_ids(tokenizer)
        self.stop_strings = tuple(getattr(make_env(), "stop_strings", ()))
        self.stop_seqs = stop_sequences(tokenizer, self.stop_strings)
        self.obs_width = bucket_length(limits.max_obs_tokens, obs_multiple)

    def spec(self, prompt_width: int, greedy: bool = False) -> TurnSpec:
        """The programs' static settings for prompts ``prompt_width`` wide."""
        args = self.sampling.sampler_args(greedy=greedy)
        n = args.pop("max_new_tokens")
        return TurnSpec(SamplingParams(**args), self.stop_ids, self.stop_seqs, n,
                        self.limits.max_total_tokens,
                        cache_slots(prompt_width, self.limits.max_turns, n, self.obs_width),
                        self.pad_id)

    def _prompts(self, first, lo: int, b: int, g: int):
        """Own rows' first observations -> every process's prompts (``b`` rows in groups
        of ``g``), left-padded to their bucket, placed by rows: ``(tokens, mask)``
        global ``[B, P]``."""
        ids = first.observation_ids
        for i, x in enumerate(ids):
            if not 0 < len(x) <= self.prompt_len:
                raise ValueError(f"row {lo + i}: the environment's first observation has "
                                 f"{len(x)} tokens; allowed: 1..{self.prompt_len} (prompt_len)")
            if x != ids[i - i % g]:
                raise ValueError(f"row {lo + i}: its first observation differs from its "
                                 "group's first row's; the rows of a group must start from "
                                 "the same prompt")
        tok, mask = pad_left(ids, self.prompt_len, self.pad_id)
        tok_all = hosts.gather_blocks(tok, lo, b)
        mask_all = hosts.gather_blocks(mask, lo, b)
        longest = int(mask_all.sum(axis=1).max())
        p = min(bucket_length(longest, self.prompt_multiple), self.prompt_len)
        return (hosts.put_rows(tok_all[:, -p:].astype(np.int32), self.mesh),
                hosts.put_rows(mask_all[:, -p:] > 0, self.mesh))

    def _budget(self, envs: EnvBatch, n: int) -> np.ndarray:
        return np.minimum(envs.remaining_tokens_B(), n).astype(np.int32)

    def sample(self, params, source: PromptSource, pos: int, n_prompts: int, key, *,
               greedy: bool = False, group_size: int | None = None,
               dispatched: Callable | None = None) -> MultiTurnOutput:
        """Episodes of prompts ``pos .. pos + n_prompts`` (``source(start, n) -> (prompts,
        metadata)``; each row's environment is reset with its metadata, with
        ``"prompt"`` set to the prompt where the metadata has none), ``group_size``
        (default: the trainer's) rows each; ``greedy``: temperature 0. ``dispatched()``
        runs once the first turn's programs are dispatched, before the host waits for
        them (what the caller queued behind them runs while the environments step)."""
        g = self.group_size if group_size is None else group_size
        b = n_prompts * g
        lo, hi = hosts.own_groups(b, g, self.mesh)
        prompts, meta = source(pos + lo // g, (hi - lo) // g)
        rows = [{"prompt": p, **m} for p, m in zip(prompts, meta) for _ in range(g)]
        envs = EnvBatch(self.make_env, functools.partial(encode_text, self.tok), self.limits,
                        pool=self.pool, chat=self.chat, max_model_tokens=self.max_model_tokens)
        first = envs.reset(rows)
        extra = [x for x in envs.stop_strings if x not in self.stop_strings]
        if extra:  # the programs' stop sequences are static, read from a probe environment
            raise ValueError(f"rows' environments have stop strings {extra} that a fresh "
                             f"make_env() does not (it has {list(self.stop_strings)}); give "
                             "every environment the same stop_strings")
        if first.done_B.any():
            raise ValueError(f"rows {[lo + i for i in np.flatnonzero(first.done_B)]}: the first "
                             f"observation is over limits.max_total_tokens="
                             f"{self.limits.max_total_tokens}")
        tok_BxP, mask_BxP = self._prompts(first, lo, b, g)
        spec = self.spec(tok_BxP.shape[1], greedy)
        glob = functools.partial(hosts.to_global, n_rows=b, mesh=self.mesh)
        mesh = mesh_of(params) if self.mesh is None else self.mesh
        with jax.transfer_guard("allow"):  # the inference copy of the weights (no host data)
            params, head = sampler_weights(params, config_of(self.gd, params), mesh)
        prog = (self.gd, spec, mesh, params, head)
        turns = 0
        with mesh_context(mesh):
            s = start(*prog, tok_BxP, mask_BxP, glob(self._budget(envs, spec.turn_tokens)), key)
            while True:
                s, turn_RxN, len_R = decode_turn(*prog, s)
                turns += 1
                if dispatched is not None and turns == 1:
                    dispatched()
                out = self._env_turn(envs, turn_RxN, len_R, lo, hi)
                obs_len = np.array([len(x) for x in out.observation_ids], np.int32)
                all_done, widest = hosts.turn_flags(turn_flags(glob(out.done_B),
                                                               glob(obs_len)))
                if all_done:
                    break
                if turns >= self.limits.max_turns:  # EnvBatch ends every row by then
                    raise RuntimeError(f"multi-turn rollout: rows still going after "
                                       f"max_turns={self.limits.max_turns} turns")
                w = min(bucket_length(max(widest, 1), self.obs_multiple), self.obs_width)
                obs, _ = pad_left([x or [self.pad_id] for x in out.observation_ids], w,
                                  self.pad_id, "observation")
                s = observe(*prog, s, *hosts.observations_in(
                    (obs.astype(np.int32), obs_len, ~out.done_B,
                     self._budget(envs, spec.turn_tokens)), b, self.mesh))
        return self._output(envs, s, tok_BxP, mask_BxP, glob, lo, hi, turns, g)

    def _env_turn(self, envs: EnvBatch, turn_RxN, len_R, lo: int, hi: int):
        """Own rows' turn: their tokens out, their text (stop ids left out) to the
        environments; with a chat renderer also the ids, which its delta follows."""
        tokens, lens = hosts.turn_tokens_out((turn_RxN, len_R), lo, hi)
        stops = set(self.stop_ids)
        ids = [[int(t) for t in row[:n]] for row, n in zip(tokens, lens)]
        decode = self.tok.decode if self.chat is None else self.chat.decode
        texts = [decode([t for t in x if t not in stops]) for x in ids]
        return envs.step(texts, model_tokens=[len(x) for x in ids],
                         model_ids=None if self.chat is None else ids)

    def _output(self, envs: EnvBatch, s, tok_BxP, mask_BxP, glob, lo, hi, turns, g):
        t = s.tokens_RxT.shape[1]
        infos = [envs.info(i) for i in range(len(envs))]
        truncated = np.array([i["truncated"] is not None for i in infos], np.float32)
        rewards = envs.returns_B(self.return_mode, self.gamma)
        cmask = _completion_mask(s.cursor_R, t)
        ro = Rollout(*to_rollout(tok_BxP, mask_BxP, s.tokens_RxT, cmask, s.logp_RxT,
                                 glob(truncated), glob(rewards),
                                 glob(np.zeros(hi - lo, np.float32)),
                                 glob(np.ones(hi - lo, np.float32))),
                     loss_mask_BxT=s.loss_RxT, expert_ids_BxLxSxK=s.experts_RxLxSxK,
                     group_size=g, has_correct=False)
        sums = envs.metrics()
        names = sorted(sums)
        tot = hosts.gather_rows(np.asarray([[sums[k][0] for k in names] + [len(envs)]],
                                           np.float64)).sum(axis=0)
        metrics = {k: float(v / max(tot[-1], 1.0)) for k, v in zip(names, tot[:-1])}
        metrics["env/rollout_turns"] = float(turns)
        return MultiTurnOutput(ro, lo, hi, [i["rewards"] for i in infos], infos, metrics)


@functools.partial(jax.jit, static_argnums=1)
def _completion_mask(cursor_R, t: int):
    return jnp.arange(t)[None] < cursor_R[:, None]
