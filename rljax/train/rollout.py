"""Rollouts: sample completions for prompts with the current policy weights, score them,
and keep everything the update needs (host-side arrays, grouped consecutively).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rljax.train.batching import decode_completions, encode_text, special_ids
from rljax.train.config import SamplingConfig


@dataclasses.dataclass
class Rollout:
    """One batch of sampled completions (B = groups x group_size rows), host arrays."""

    prompt_BxP: np.ndarray
    prompt_mask_BxP: np.ndarray
    completion_BxT: np.ndarray
    completion_mask_BxT: np.ndarray
    sampler_logp_BxT: np.ndarray
    rewards_B: np.ndarray
    correct_B: np.ndarray | None
    truncated_B: np.ndarray
    completions: list
    metadata: list
    group_size: int

    @property
    def lengths_B(self) -> np.ndarray:
        """Completion lengths in tokens (EOS included)."""
        return self.completion_mask_BxT.sum(axis=1)

    @property
    def num_groups(self) -> int:
        """Number of prompts (groups)."""
        return self.rewards_B.shape[0] // self.group_size

    def zero_variance_groups(self) -> np.ndarray:
        """bool[groups]: True where every completion of the prompt got the same reward."""
        r = self.rewards_B.reshape(-1, self.group_size)
        return r.max(axis=1) == r.min(axis=1)

    def select_groups(self, keep_G: np.ndarray) -> "Rollout":
        """The rollout restricted to the groups where ``keep_G`` is True."""
        rows = np.repeat(np.asarray(keep_G, bool), self.group_size)
        return self._rows(np.flatnonzero(rows))

    def first_groups(self, n: int) -> "Rollout":
        """The first ``n`` groups."""
        return self._rows(np.arange(min(n, self.num_groups) * self.group_size))

    def _rows(self, idx) -> "Rollout":
        def take(x):
            if x is None:
                return None
            return [x[i] for i in idx] if isinstance(x, list) else x[idx]

        return Rollout(**{f.name: (take(getattr(self, f.name)) if f.name != "group_size"
                                   else self.group_size) for f in dataclasses.fields(self)})

    @staticmethod
    def concat(parts: Sequence["Rollout"]) -> "Rollout":
        """Rows of several rollouts (same widths) one after another."""
        first = parts[0]
        out = {}
        for f in dataclasses.fields(first):
            vals = [getattr(p, f.name) for p in parts]
            if f.name == "group_size":
                out[f.name] = first.group_size
            elif vals[0] is None:
                out[f.name] = None
            elif isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            else:
                out[f.name] = np.concatenate(vals, axis=0)
        return Rollout(**out)

    def seqs(self) -> dict:
        """The sequence arrays of the trainer's layout."""
        return {"prompt_BxP": self.prompt_BxP, "prompt_mask_BxP": self.prompt_mask_BxP,
                "completion_BxT": self.completion_BxT,
                "completion_mask_BxT": self.completion_mask_BxT}

    def metrics(self) -> dict:
        """Reward, accuracy, length and truncation statistics."""
        lengths = self.lengths_B
        m = {"reward_mean": float(self.rewards_B.mean()), "reward_std": float(self.rewards_B.std()),
             "response_len_mean": float(lengths.mean()), "response_len_max": float(lengths.max()),
             "truncation_rate": float(self.truncated_B.mean())}
        if self.correct_B is not None:
            m["accuracy"] = float(self.correct_B.mean())
        return m


def _sample(graphdef, params, prompt_ids: list, key, sampling: SamplingConfig, *,
            num_samples: int, eos_id: int, pad_id: int, greedy: bool, mesh):
    """``rljax.sampling.generate`` with the policy state (no copy): numpy arrays
    ``(prompt_BxP, prompt_mask_BxP, completion_BxT, completion_mask_BxT, sampler_logp_BxT,
    truncated_B)`` with each prompt's ``num_samples`` rows consecutive."""
    from rljax.sampling import generate

    out = generate(
        (graphdef, params), prompt_ids, key=key, max_new_tokens=sampling.max_new_tokens,
        temperature=0.0 if greedy else sampling.temperature, top_k=sampling.top_k or None,
        top_p=None if sampling.top_p >= 1.0 else sampling.top_p, stop_ids=(eos_id,),
        num_samples=num_samples, pad_id=pad_id, mesh=mesh,
    )
    out = jax.device_get(out)
    # The sampler left-pads prompts to a bucket width; drop columns that are padding in
    # every row so the training forward passes do not pay for them.
    pm = np.asarray(out.prompt_mask, bool)
    first = int(np.argmax(pm.any(axis=0))) if pm.any() else 0
    return (np.asarray(out.prompt_tokens, np.int32)[:, first:],
            np.asarray(out.prompt_mask, np.float32)[:, first:],
            np.asarray(out.tokens, np.int32), np.asarray(out.completion_mask, np.float32),
            np.asarray(out.sampling_logprobs, np.float32), np.asarray(out.truncated, bool))


class Rollouts:
    """Samples and scores completions for prompts (each repeated ``group_size`` times).

    ``reward_fns``: a batch reward ``(completions, metadata) -> float[B]`` (a function
    with ``is_batch_reward = True`` or any single callable taking two lists), or a list
    of item rewards ``(completion, meta) -> float`` summed via ``rljax.rewards.score_batch``.
    Errors (a raise or a non-finite value) name the function and the prompt index.
    """

    def __init__(self, graphdef, tokenizer, reward_fns, *, sampling: SamplingConfig,
                 prompt_len: int, group_size: int, accuracy_fn: Callable | None = None,
                 mesh=None):
        self.gd, self.tok, self.sampling, self.mesh = graphdef, tokenizer, sampling, mesh
        self.prompt_len, self.group_size = prompt_len, group_size
        self.reward_fns, self.accuracy_fn = reward_fns, accuracy_fn
        self.pad_id, self.eos_id = special_ids(tokenizer)
        self.num_params = 0

    def _count_params(self, params):
        if not self.num_params:
            self.num_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))

    def generate(self, params, prompts: list, key, *, greedy: bool = False,
                 num_samples: int = 1):
        """Encode and sample; see ``_sample`` for the returned arrays."""
        ids = [encode_text(self.tok, p) for p in prompts]
        for i, x in enumerate(ids):
            if not 0 < len(x) <= self.prompt_len:
                raise ValueError(f"prompt {i} has {len(x)} tokens; allowed: 1..{self.prompt_len} "
                                 f"(prompt_len)")
        return _sample(self.gd, params, ids, key, self.sampling, num_samples=num_samples,
                       eos_id=self.eos_id, pad_id=self.pad_id, greedy=greedy, mesh=self.mesh)

    def score(self, completions: list, metadata: list) -> np.ndarray:
        """Rewards float32[B]; errors name the function and the prompt index."""
        if callable(self.reward_fns):
            return score_batch_fn(self.reward_fns, completions, metadata, self.group_size)
        from rljax.rewards import score_batch

        return score_batch(list(self.reward_fns), completions, metadata,
                           group_size=self.group_size).rewards

    def sample(self, params, prompts: list, metadata: list, key, ph) -> Rollout:
        """Rollouts for ``prompts`` (each ``group_size`` times, consecutively), scored."""
        self._count_params(params)
        g = self.group_size
        rep_meta = [m for m in metadata for _ in range(g)]
        ids, mask, tokens, cmask, logp, truncated = ph.timed(
            "rollout", self.generate, params, prompts, key, num_samples=g)
        texts = decode_completions(self.tok, tokens, cmask, self.eos_id)
        t0 = time.perf_counter()
        rewards = self.score(texts, rep_meta)
        correct = (np.asarray([bool(self.accuracy_fn(c, m)) for c, m in zip(texts, rep_meta)])
                   if self.accuracy_fn is not None else None)
        ph.times["reward"] = ph.times.get("reward", 0.0) + time.perf_counter() - t0
        return Rollout(ids, mask, tokens, cmask, logp, np.asarray(rewards, np.float32), correct,
                       truncated, texts, rep_meta, g)

    def evaluate(self, params, prompts: list, metadata: list, batch_size: int) -> dict:
        """Greedy completions of ``prompts``: accuracy (if a verifier), reward mean."""
        rewards, correct = [], []
        for i in range(0, len(prompts), batch_size):
            ps, ms = prompts[i:i + batch_size], metadata[i:i + batch_size]
            _, _, tokens, cmask, _, _ = self.generate(params, ps, jax.random.key(0), greedy=True)
            texts = decode_completions(self.tok, tokens, cmask, self.eos_id)
            g, self.group_size = self.group_size, 1
            try:
                rewards.append(self.score(texts, ms))
            finally:
                self.group_size = g
            if self.accuracy_fn is not None:
                correct += [bool(self.accuracy_fn(c, m)) for c, m in zip(texts, ms)]
        out = {"reward_mean": float(np.concatenate(rewards).mean()), "n": len(prompts)}
        if self.accuracy_fn is not None:
            out["accuracy"] = float(np.mean(correct))
        return out


def score_batch_fn(fn, completions: list, metadata: list, group_size: int) -> np.ndarray:
    """Call a batch reward ``fn(completions, metadata) -> float[B]`` and check it.

    A raise is localised by re-calling ``fn`` on single completions, so the error names
    the first failing prompt; a non-finite or wrongly shaped result is an error too. All
    errors are ``rljax.rewards.RewardError`` naming the function and the prompt index.
    """
    from rljax.rewards import RewardError, reward_name

    name = reward_name(fn)
    where = lambda i: f"batch index {i} (prompt index {i // group_size})"
    try:
        out = np.asarray(fn(list(completions), list(metadata)), np.float64)
    except Exception as e:  # find which prompt made it fail
        for i, (c, m) in enumerate(zip(completions, metadata)):
            try:
                fn([c], [m])
            except Exception as e1:
                raise RewardError(f"reward function {name!r} raised {type(e1).__name__}: {e1} "
                                  f"at {where(i)}", index=i, fn=name) from e1
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e} on the "
                          "batch (but on no single completion)", index=-1, fn=name) from e
    if out.shape != (len(completions),):
        raise RewardError(f"reward function {name!r} returned shape {out.shape}; expected "
                          f"({len(completions)},), one reward per completion", index=-1, fn=name)
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        i = int(bad[0])
        raise RewardError(f"reward function {name!r} returned non-finite {out[i]} at {where(i)}",
                          index=i, fn=name)
    return out.astype(np.float32)
