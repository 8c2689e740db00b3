"""The host-reward source: single-turn completions sampled with the current policy,
scored on the host (each process its own rows), kept on device as a ``Rollout``.

Each process reads its own block of the step's prompts (by global position), the sampler
runs one SPMD program over the whole batch, each process detokenises and scores only the
rows it holds, and the rewards return as a global array. Shapes are fixed per bucket:
prompts are left-padded to ``bucket_length(longest, prompt_multiple)`` (never trimmed),
completions are ``max_new_tokens`` wide.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import jax
import numpy as np

from rljax.rewards import score_batch
from rljax.rewards.device import is_device_reward
from rljax.rewards.pooled import score_batch_fn
from rljax.train import hosts
from rljax.train.batch import Rollout, to_rollout
from rljax.train.config import SamplingConfig
from rljax.train.sources import Collected, Window
from rljax.train.sources.prompts import PromptRows, eval_rows, sum_rows

__all__ = ["Rollouts"]

log = logging.getLogger(__name__)


class Rollouts(PromptRows):
    """Samples and scores completions for prompts (each repeated ``group_size`` times).

    ``reward_fns``: a batch reward ``(completions, metadata) -> float[B]`` (any single
    callable taking two lists), or a list of item rewards ``(completion, meta) -> float``
    summed via ``rljax.rewards.score_batch``; with a ``reward_pool``
    (``rljax.rewards.RewardPool``) each item call is cut at ``reward_timeout_s``, scored
    0 and logged with its prompt index. Errors (a raise or a non-finite value) name the
    function and the prompt index. ``prompt_multiple``: prompts are left-padded to a
    multiple of it (the buckets).

    ``accuracy_fn``: the verifier ``(completion, meta) -> bool``; with a ``reward_pool``
    it runs there under ``reward_timeout_s`` too (so it must pickle), a call past the
    limit counting as wrong. Completions end at any of the tokenizer's ``stop_ids``
    (``rljax.train.batching.stop_ids``). A batch reward that sets ``last_components``
    (name -> float[B] of its latest call, as ``rljax.run.builders.ComponentReward``
    does) gets ``reward/<name>`` means over every row the step sampled: every process's,
    every DAPO round's (``step_metrics``). ``reward/timeouts`` is the share of those
    rows whose reward a time limit cut (a row of an item call past ``reward_timeout_s``,
    every row of a batch call past it); the held-out results report it too.
    """

    def __init__(self, graphdef, tokenizer, reward_fns, *, sampling: SamplingConfig,
                 prompt_len: int, group_size: int, accuracy_fn: Callable | None = None,
                 mesh=None, prompt_multiple: int = 16, reward_pool=None,
                 reward_timeout_s: float | None = None):
        if is_device_reward(reward_fns):
            raise TypeError("Rollouts: a device reward scores token ids in the step's "
                            "program; use rljax.train.sources.device.DeviceRewardSource")
        super().__init__(graphdef, tokenizer, sampling=sampling, prompt_len=prompt_len,
                         group_size=group_size, mesh=mesh, prompt_multiple=prompt_multiple)
        self.reward_fns, self.accuracy_fn = reward_fns, accuracy_fn
        self.reward_pool = reward_pool
        self.reward_timeout_s = reward_timeout_s if reward_pool is not None else None
        self._terms: dict[str, list] = {}  # reward term -> [sum, rows] since step_metrics
        self.last_timeouts = 0  # rows of the latest `score` a time limit cut

    def score(self, completions: list, metadata: list, group_size: int, first: int = 0):
        """Rewards float32 of own rows; errors name the function and the prompt index.
        Sets ``last_timeouts``: how many of these rows a reward call's time limit cut (a
        batch reward reports its own, ``last_timeouts``, as ``PooledBatchReward`` does)."""
        if callable(self.reward_fns):
            out = score_batch_fn(self.reward_fns, completions, metadata, group_size, first)
            self.last_timeouts = int(getattr(self.reward_fns, "last_timeouts", 0))
            return out
        out, self.last_timeouts = self._items(list(self.reward_fns), completions, metadata,
                                              group_size, first, "reward function",
                                              "scored as a failure")
        return out

    def _items(self, fns: list, texts: list, metadata: list, group_size: int, first: int,
               what: str, counts: str) -> tuple[np.ndarray, int]:
        """Item functions' sum over own rows (``score_batch``; in the reward pool under the
        time limit when there is one, a call past it logged with its prompt index) and
        how many rows had a call cut."""
        out = score_batch(fns, texts, metadata, group_size=group_size,
                          timeout_s=self.reward_timeout_s, pool=self.reward_pool)
        for t in out.timeouts:
            log.warning("%s %r timed out after %.1f s on prompt index %d (%s)", what, t.fn,
                        t.seconds, first + t.prompt_index, counts)
        return out.rewards, len({t.index for t in out.timeouts})

    def _verify(self, texts: list, metadata: list, group_size: int, first: int) -> np.ndarray:
        """The verifier's outcomes (float32 0/1; zeros without one) of own rows: in the
        reward pool under the reward time limit when there is a pool, a call past it
        logged with its prompt index and counted wrong; else in this process."""
        if self.accuracy_fn is None:
            return np.zeros(len(texts), np.float32)
        if self.reward_pool is None:
            return np.asarray([bool(self.accuracy_fn(c, m)) for c, m in zip(texts, metadata)],
                              np.float32)
        ok, _ = self._items([self.accuracy_fn], texts, metadata, group_size, first,
                            "accuracy verifier", "counted wrong")
        return (ok != 0).astype(np.float32)

    def _add_terms(self, rows: int) -> None:
        """Add the reward's per-term sums of the ``rows`` it just scored
        (``last_components``) and its rows cut by a time limit (``timeouts``)."""
        terms = {k: (float(np.sum(np.asarray(v, np.float64))), len(v)) for k, v in
                 (getattr(self.reward_fns, "last_components", None) or {}).items()}
        terms["timeouts"] = (float(self.last_timeouts), rows)
        for k, (total, n) in terms.items():
            acc = self._terms.setdefault(k, [0.0, 0])
            acc[0] += total
            acc[1] += n

    def step_metrics(self) -> dict:
        """``{"reward/<term>": mean}`` and ``reward/timeouts`` over the rows sampled since
        the last call (every process's, every round's), then starts over. Every process
        calls it once per step: with several processes the sums are reduced over them."""
        names = sorted(self._terms)
        if not names:
            return {}
        sums = np.asarray([self._terms[k] for k in names], np.float64).reshape(-1)
        self._terms = {}
        tot = hosts.gather_rows(sums[None]).sum(axis=0).reshape(-1, 2)  # every process's
        return {f"reward/{k}": float(s / max(n, 1.0)) for k, (s, n) in zip(names, tot)}

    def sample_round(self, params, window: Window, key, ph,
                     dispatched: Callable | None = None) -> Rollout:
        """Rollouts of ``window``'s prompts (this process reads its own block), scored on
        its own rows; ``dispatched()`` runs once the sampler is dispatched, before the
        host waits for it (the protocol's ``collect``)."""
        g = self.group_size
        b = window.n * g
        lo, hi, meta, tok, mask = self.own_prompts(window.prompts, window.pos, window.n)
        t0 = time.perf_counter()
        out = self.generate(params, tok, mask, key, num_samples=g)
        if dispatched is not None:
            dispatched()
        jax.block_until_ready(out)
        ph.add("rollout", time.perf_counter() - t0)
        t0 = time.perf_counter()
        texts = self.own_texts(out, lo, hi)
        rep_meta = [m for m in meta for _ in range(g)]
        rewards = np.asarray(self.score(texts, rep_meta, g, lo // g), np.float32)
        self._add_terms(len(texts))
        correct = self._verify(texts, rep_meta, g, lo // g)
        glob = functools.partial(hosts.to_global, n_rows=b, mesh=self.mesh)
        ro = Rollout(*to_rollout(out.prompt_tokens, out.prompt_mask, out.tokens,
                                  out.completion_mask, out.sampling_logprobs, out.truncated,
                                  glob(rewards), glob(correct),
                                  glob(np.ones(hi - lo, np.float32))),
                     expert_ids_BxLxSxK=out.expert_ids, group_size=g,
                     has_correct=self.accuracy_fn is not None)
        ph.add("reward", time.perf_counter() - t0)
        return ro

    def collect(self, params, window: Window, key, ph,
                dispatched: Callable | None = None) -> Collected:
        """One sampling round of ``window`` (its key split as each of DAPO's rounds
        splits it, ``rljax.train.sources.refill``) and the reward terms' means."""
        _, k = jax.random.split(key)
        ro = self.sample_round(params, window, k, ph, dispatched)
        return Collected(ro, window.pos + window.n, self.step_metrics())

    def eval_batch(self, params, prompts: list, metadata: list, first: int) -> dict:
        """Greedy completions of held-out ``prompts`` scored by the reward (and the
        verifier): sums over every process's rows."""
        tok, mask = self.encode_all(prompts)
        lo, hi = eval_rows(len(prompts), self.mesh)
        out = self.generate(params, tok, mask, jax.random.key(0), greedy=True)
        texts = self.own_texts(out, lo, hi)
        sums = {"reward": float(np.sum(self.score(texts, metadata[lo:hi], 1, first + lo)))}
        sums["reward/timeouts"] = float(self.last_timeouts)
        if self.accuracy_fn is not None:
            sums["accuracy"] = float(np.sum(self._verify(texts, metadata[lo:hi], 1, first + lo)))
        return sum_rows(sums)

    def eval_samples(self, params, prompts: list, metadata: list, first: int, k: int,
                     key, *, threshold: float | None = None) -> dict:
        """``k`` completions of each held-out prompt at the sampling temperature: sums over
        every process's prompts of ``"pass@k"`` (any of its ``k`` passes: Chen et al.
        2021's estimator with n = k) and the mean of its ``k``. With a verifier a
        completion passes when verified (the mean is ``"sample_accuracy"``); without one,
        when its reward is ``>= threshold`` (the means are ``"sample_pass"`` and
        ``"sample_reward_mean"``). ``threshold`` is for a reward without a verifier only."""
        if (self.accuracy_fn is None) == (threshold is None):
            raise ValueError(
                "pass@k counts verified completions when the reward has a verifier "
                "(accuracy_fn) and completions whose reward reaches a threshold when it has "
                f"none: give threshold without a verifier only (verifier: "
                f"{self.accuracy_fn is not None}, threshold: {threshold!r})")
        tok, mask = self.encode_all(prompts)
        lo, hi = hosts.own_groups(len(prompts) * k, k, self.mesh)
        out = self.generate(params, tok, mask, key, num_samples=k)
        meta = [m for m in metadata[lo // k:hi // k] for _ in range(k)]
        texts, first_own = self.own_texts(out, lo, hi), first + lo // k
        if threshold is None:
            ok_Nxk = (self._verify(texts, meta, k, first_own) > 0).reshape(-1, k)
            means = {"sample_accuracy": ok_Nxk.mean(axis=1)}
        else:
            r_Nxk = np.asarray(self.score(texts, meta, k, first_own), np.float64).reshape(-1, k)
            ok_Nxk = r_Nxk >= threshold
            means = {"sample_pass": ok_Nxk.mean(axis=1), "sample_reward_mean": r_Nxk.mean(axis=1)}
        sums = {name: float(v.sum()) for name, v in means.items()}
        return sum_rows({f"pass@{k}": float(ok_Nxk.any(axis=1).sum()), **sums})
