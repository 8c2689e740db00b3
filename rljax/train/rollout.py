"""Rollouts: sample completions with the current policy, score this process's rows, and
keep the batch on device as a frozen pytree of global arrays.

Each process reads its own block of the step's prompts (by global position), the sampler
runs one SPMD program over the whole batch, each process detokenises and scores only the
rows it holds, and the rewards return as a global array. Shapes are fixed per bucket:
prompts are left-padded to ``bucket_length(longest, prompt_multiple)`` (never trimmed),
completions are ``max_new_tokens`` wide. ``Rollouts.evaluate`` is the held-out evaluator,
of one run or of several seeds in one program.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax.rewards import score_batch
from rljax.rewards.device import is_device_reward
from rljax.rewards.pooled import score_batch_fn
from rljax.sampling import generate
from rljax.sampling.generate import config_of, prepare
from rljax.train import hosts
from rljax.train.batching import decode_completions, encode_text, pad_left, special_ids, stop_ids
from rljax.train.config import SamplingConfig
from rljax.train.programs import program_signature
from rljax.train.programs.evaluate import device_scores, seeds_evaluate

log = logging.getLogger(__name__)
Array = Any
PromptSource = Callable[[int, int], tuple[Sequence[str], Sequence[dict]]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """One batch of sampled completions, ``B = groups x group_size`` rows (a prompt's
    completions consecutive, each repeating its prompt: the learning program may compute a
    group's prompt once, ``RLConfig.share_prompts``), as global arrays that stay on device
    until the update.

    prompt_BxP / prompt_mask_BxP: left-padded prompt ids (int32) and 0/1 mask (float32).
    completion_BxT / completion_mask_BxT: completion ids and mask (stop token included).
    sampler_logp_BxT: log-probs under the distribution the sampler drew from.
    truncated_B: 1 where no stop token came within ``max_new_tokens``.
    rewards_B: the task reward (before any length shaping). correct_B: verifier outcome
      (0/1; all 0 without a verifier). weight_B: 1 for real rows, 0 for padding groups.
    loss_mask_BxT: the tokens the objective trains on (float32 0/1, within
      ``completion_mask_BxT``); None means every completion token. Tokens the model did
      not choose (a tool's or an environment's output in a multi-turn rollout) are in the
      completion, attended to, and 0 here. ``loss_mask()`` resolves it.
    """

    prompt_BxP: Array
    prompt_mask_BxP: Array
    completion_BxT: Array
    completion_mask_BxT: Array
    sampler_logp_BxT: Array
    truncated_B: Array
    rewards_B: Array
    correct_B: Array
    weight_B: Array
    loss_mask_BxT: Array | None = None
    group_size: int = dataclasses.field(default=1, metadata=dict(static=True))
    has_correct: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def lengths_B(self) -> Array:
        """Completion lengths in tokens (stop token included)."""
        return jnp.sum(self.completion_mask_BxT, axis=1)

    def seqs(self) -> dict:
        """The sequence arrays of the trainer's layout (``rljax.train.batching``)."""
        return {"prompt_BxP": self.prompt_BxP, "prompt_mask_BxP": self.prompt_mask_BxP,
                "completion_BxT": self.completion_BxT,
                "completion_mask_BxT": self.completion_mask_BxT}

    def loss_mask(self) -> Array:
        """The per-token loss mask ``[B, T]`` (the completion mask where none is set)."""
        return self.completion_mask_BxT if self.loss_mask_BxT is None else self.loss_mask_BxT

    def masked_by_weight(self) -> "Rollout":
        """Padding rows (weight 0) get all-zero completion and loss masks: no loss, no
        count."""
        keep = self.weight_B[:, None] > 0
        return dataclasses.replace(self, completion_mask_BxT=self.completion_mask_BxT * keep,
                                   loss_mask_BxT=self.loss_mask() * keep)

    def metrics(self) -> dict:
        """Reward, accuracy, length, truncation and token statistics over real rows."""
        w = (self.weight_B > 0).astype(jnp.float32)
        n = jnp.maximum(jnp.sum(w), 1.0)
        mean = lambda x: jnp.sum(x.astype(jnp.float32) * w) / n
        r_mean = mean(self.rewards_B)
        lengths = jnp.sum(self.completion_mask_BxT, axis=1)
        zv = zero_variance_groups(self.rewards_B, self.group_size)
        m = {"reward_mean": r_mean,
             "reward_std": jnp.sqrt(mean(jnp.square(self.rewards_B - r_mean))),
             "response_len_mean": mean(lengths), "response_len_max": jnp.max(lengths * w),
             "truncation_rate": mean(self.truncated_B),
             "zero_var_frac": jnp.mean(zv.astype(jnp.float32)),
             "completion_tokens": jnp.sum(self.completion_mask_BxT),
             "prompt_tokens": jnp.sum(self.prompt_mask_BxP * w[:, None])}
        if self.has_correct:
            m["accuracy"] = mean(self.correct_B)
        return m


def zero_variance_groups(rewards_B: Array, group_size: int) -> Array:
    """bool[groups]: True where every completion of the prompt got the same reward."""
    r_NxG = rewards_B.reshape(-1, group_size)
    return jnp.max(r_NxG, axis=1) == jnp.min(r_NxG, axis=1)


@jax.jit
def to_rollout(ptok, pmask, tokens, cmask, slogp, truncated, rewards_B, correct_B, weight_B):
    """The sampler's outputs and the scores in ``Rollout``'s field order and dtypes."""
    return (ptok.astype(jnp.int32), pmask.astype(jnp.float32), tokens.astype(jnp.int32),
            cmask.astype(jnp.float32), slogp, truncated.astype(jnp.float32), rewards_B,
            correct_B, weight_B)


class Rollouts:
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
    every DAPO round's (``term_means``).
    """

    def __init__(self, graphdef, tokenizer, reward_fns, *, sampling: SamplingConfig,
                 prompt_len: int, group_size: int, accuracy_fn: Callable | None = None,
                 mesh=None, prompt_multiple: int = 16, reward_pool=None,
                 reward_timeout_s: float | None = None):
        self.gd, self.tok, self.sampling, self.mesh = graphdef, tokenizer, sampling, mesh
        self.prompt_len, self.group_size = prompt_len, group_size
        self.reward_fns, self.accuracy_fn = reward_fns, accuracy_fn
        self.prompt_multiple = prompt_multiple
        self.reward_pool = reward_pool
        self.reward_timeout_s = reward_timeout_s if reward_pool is not None else None
        self.pad_id, self.eos_id = special_ids(tokenizer)
        self.stop_ids = stop_ids(tokenizer)
        self._terms: dict[str, list] = {}  # reward term -> [sum, rows] since term_means
        self.seed_programs: set = set()  # the seed form's evaluation programs (signatures)

    def _own_prompts(self, source: PromptSource, pos: int, n: int):
        """This process's block of prompts ``pos .. pos + n`` (whole groups of its rows
        ``[lo, hi)``) -> ``(lo, hi, own metadata, ids [n, prompt_len], masks)``, the ids and
        masks every process's, placed by position."""
        g = self.group_size
        lo, hi = self._own_groups(n * g)
        prompts, meta = source(pos + lo // g, (hi - lo) // g)
        ids = [encode_text(self.tok, p) for p in prompts]
        for i, x in enumerate(ids):
            if not 0 < len(x) <= self.prompt_len:
                raise ValueError(f"prompt {pos + lo // g + i} has {len(x)} tokens; allowed: "
                                 f"1..{self.prompt_len} (prompt_len)")
        tok, mask = pad_left(ids, self.prompt_len, self.pad_id)
        return (lo, hi, list(meta), hosts.gather_blocks(tok, lo // g, n),
                hosts.gather_blocks(mask, lo // g, n))

    def generate(self, params, tok_NxW, mask_NxW, key, *, greedy: bool = False,
                 num_samples: int = 1):
        """The sampler on padded prompts, bucketed: ``min(bucket_length(longest,
        prompt_multiple), prompt_len)`` columns (the sampler's ``SampleResult``, global
        arrays)."""
        # The sampler's entry is the step's "prompt ids in" transfer: it packs the ids on
        # the host and places them on the mesh (rljax.sampling has its own tests).
        with jax.transfer_guard("allow"):
            return generate((self.gd, params), tok_NxW, prompt_mask=mask_NxW > 0, key=key,
                            mesh=self.mesh, **self._decode_args(greedy, num_samples))

    def _decode_args(self, greedy: bool = False, num_samples: int = 1) -> dict:
        """The sampler's settings (``generate`` / ``prepare`` keywords) for this trainer's
        prompts: ``SamplingConfig.sampler_args``, stop ids, padding and buckets."""
        return dict(**self.sampling.sampler_args(greedy=greedy), stop_ids=self.stop_ids,
                    num_samples=num_samples, pad_id=self.pad_id,
                    length_multiple=self.prompt_multiple,
                    # Buckets never exceed prompt_len: the last one is prompt_len itself.
                    max_len=self.prompt_len + self.sampling.max_new_tokens - 1)

    def device_inputs(self, params, source: PromptSource, pos: int, n_prompts: int, *,
                      on_host: bool = False):
        """The one-program step's inputs for prompts ``pos .. pos + n_prompts`` (this
        process reads its own block, as in :meth:`sample`): ``(DecodeSpec, (tokens,
        mask, positions), task arrays)``, the arrays placed on the mesh by rows (numpy,
        every process's rows, with ``on_host``)."""
        g = self.group_size
        lo, _, meta, tok, mask = self._own_prompts(source, pos, n_prompts)
        task = {k: hosts.gather_blocks(np.asarray(v), lo // g, n_prompts)
                for k, v in self.reward_fns.task_arrays(meta).items()}
        batch, spec = prepare(config_of(self.gd, params), tok, prompt_mask=mask > 0,
                              **self._decode_args(num_samples=g))
        arrays = (batch.tokens_BxP, batch.mask_BxP, batch.positions_BxP)
        if on_host:
            return spec, arrays, task
        return (spec, tuple(hosts.put_rows(x, self.mesh) for x in arrays),
                {k: hosts.put_rows(v, self.mesh) for k, v in task.items()})

    def _own_groups(self, b: int) -> tuple[int, int]:
        """This process's rows ``[lo, hi)`` of a ``b``-row batch; whole groups only."""
        return hosts.own_groups(b, self.group_size, self.mesh)

    def score(self, completions: list, metadata: list, group_size: int, first: int = 0):
        """Rewards float32 of own rows; errors name the function and the prompt index."""
        if is_device_reward(self.reward_fns):
            raise TypeError("Rollouts.score: a device reward scores token ids in the step's "
                            "program (rljax.train.programs.fused), not texts")
        if callable(self.reward_fns):
            return score_batch_fn(self.reward_fns, completions, metadata, group_size, first)
        return self._items(list(self.reward_fns), completions, metadata, group_size, first,
                           "reward function", "scored as a failure")

    def _items(self, fns: list, texts: list, metadata: list, group_size: int, first: int,
               what: str, counts: str) -> np.ndarray:
        """Item functions' sum over own rows (``score_batch``; in the reward pool under the
        time limit when there is one, a call past it logged with its prompt index)."""
        out = score_batch(fns, texts, metadata, group_size=group_size,
                          timeout_s=self.reward_timeout_s, pool=self.reward_pool)
        for t in out.timeouts:
            log.warning("%s %r timed out after %.1f s on prompt index %d (%s)", what, t.fn,
                        t.seconds, first + t.prompt_index, counts)
        return out.rewards

    def _verify(self, texts: list, metadata: list, group_size: int, first: int) -> np.ndarray:
        """The verifier's outcomes (float32 0/1; zeros without one) of own rows: in the
        reward pool under the reward time limit when there is a pool, a call past it
        logged with its prompt index and counted wrong; else in this process."""
        if self.accuracy_fn is None:
            return np.zeros(len(texts), np.float32)
        if self.reward_pool is None:
            return np.asarray([bool(self.accuracy_fn(c, m)) for c, m in zip(texts, metadata)],
                              np.float32)
        return (self._items([self.accuracy_fn], texts, metadata, group_size, first,
                            "accuracy verifier", "counted wrong") != 0).astype(np.float32)

    def _add_terms(self) -> None:
        """Add the reward's per-term sums of the rows it just scored (``last_components``)."""
        for k, v in (getattr(self.reward_fns, "last_components", None) or {}).items():
            acc = self._terms.setdefault(k, [0.0, 0])
            acc[0] += float(np.sum(np.asarray(v, np.float64)))
            acc[1] += len(v)

    def term_means(self) -> dict:
        """``{"reward/<term>": mean}`` over the rows sampled since the last call (every
        process's, every round's), then starts over. Every process calls it once per
        step: with several processes the sums are reduced over them."""
        names = sorted(self._terms)
        if not names:
            return {}
        sums = np.asarray([self._terms[k] for k in names], np.float64).reshape(-1)
        self._terms = {}
        tot = hosts.gather_rows(sums[None]).sum(axis=0).reshape(-1, 2)  # every process's
        return {f"reward/{k}": float(s / max(n, 1.0)) for k, (s, n) in zip(names, tot)}

    def _own_texts(self, out, lo: int, hi: int) -> list:
        """Detokenise rows ``[lo, hi)`` (this process's) of the sampler's output."""
        tokens = hosts.host_rows(out.tokens, lo, hi)
        mask = hosts.host_rows(out.completion_mask, lo, hi)
        return decode_completions(self.tok, tokens, mask, self.stop_ids)

    def sample(self, params, source: PromptSource, pos: int, n_prompts: int, key,
               ph) -> Rollout:
        """Rollouts of prompts ``pos .. pos + n_prompts`` (this process reads its own
        block), scored on its own rows."""
        g = self.group_size
        b = n_prompts * g
        lo, hi, meta, tok, mask = self._own_prompts(source, pos, n_prompts)
        out = ph.timed("rollout", self.generate, params, tok, mask, key, num_samples=g)
        t0 = time.perf_counter()
        texts = self._own_texts(out, lo, hi)
        rep_meta = [m for m in meta for _ in range(g)]
        rewards = np.asarray(self.score(texts, rep_meta, g, lo // g), np.float32)
        self._add_terms()
        correct = self._verify(texts, rep_meta, g, lo // g)
        glob = functools.partial(hosts.to_global, n_rows=b, mesh=self.mesh)
        ro = Rollout(*to_rollout(out.prompt_tokens, out.prompt_mask, out.tokens,
                                  out.completion_mask, out.sampling_logprobs, out.truncated,
                                  glob(rewards), glob(correct),
                                  glob(np.ones(hi - lo, np.float32))),
                     group_size=g, has_correct=self.accuracy_fn is not None)
        ph.times["reward"] = ph.times.get("reward", 0.0) + time.perf_counter() - t0
        return ro

    def evaluate(self, params, prompts: Sequence, metadata: Sequence, batch_size: int, *,
                 seeds: bool = False) -> dict | list[dict]:
        """Greedy completions of held-out ``prompts``: ``{"reward_mean", "n"}``, with
        ``"accuracy"`` where there is a verifier.

        One run: every process passes the same lists and scores its own rows (a device
        reward in a program, or the host reward on their texts); the verifier is
        ``accuracy_fn``. ``seeds`` (one device, a device reward): ``params`` has a leading
        seed axis and ``prompts[i]``, ``metadata[i]`` are seed ``i``'s, equally many per
        seed; all seeds sample and score in one vmapped program (``seeds_evaluate``, its
        signatures in ``seed_programs``), the verifier is the reward's (``rewards > 0``),
        and the result is one dict per seed."""
        ps_S, ms_S = (prompts, metadata) if seeds else ([prompts], [metadata])
        s, n = len(ps_S), len(ps_S[0])
        if any(len(p) != n for p in ps_S) or len(ms_S) != s:
            raise ValueError("Rollouts.evaluate: give every seed the same number of prompts")
        sums_Sx2 = np.zeros((s, 2))
        for i in range(0, n, batch_size):
            ms = [m[i:i + batch_size] for m in ms_S]
            tok, mask = pad_left([encode_text(self.tok, p) for ps in ps_S
                                  for p in ps[i:i + batch_size]], self.prompt_len, self.pad_id)
            scored = (self._eval_seeds(params, tok, mask, ms) if seeds
                      else self._eval_batch(params, tok, mask, ms[0], i))
            sums_Sx2 += [(float(np.sum(r)), float(np.sum(c))) for r, c in zip(*scored)]
        if n:  # every process's sums
            sums_Sx2 = hosts.gather_rows(sums_Sx2.reshape(1, -1)).sum(axis=0).reshape(s, 2)
        verifier = self.reward_fns.verifier if seeds else self.accuracy_fn is not None
        out = [{"reward_mean": float(r / max(n, 1)), "n": n,
                **({"accuracy": float(c / max(n, 1))} if verifier else {})} for r, c in sums_Sx2]
        return out if seeds else out[0]

    def _eval_batch(self, params, tok, mask, metadata: list, first: int):
        """One run's batch: ``([own rows' rewards], [their verifier outcomes])`` (a
        device reward scores every row; this process keeps its own)."""
        lo, hi = _eval_rows(len(metadata), self.mesh)
        out = self.generate(params, tok, mask, jax.random.key(0), greedy=True)
        texts = self._own_texts(out, lo, hi)
        if not is_device_reward(self.reward_fns):
            rewards = self.score(texts, metadata[lo:hi], 1, first + lo)
        else:
            with jax.transfer_guard("allow"):
                all_rows = device_scores(self.reward_fns, out,
                                          self.reward_fns.task_arrays(metadata))
            rewards = hosts.host_rows(all_rows, lo, hi)
        return [rewards], [self._verify(texts, metadata[lo:hi], 1, first + lo)]

    def _eval_seeds(self, params_S, tok, mask, metadata_S: list):
        """The seeds' batch: ``(rewards [S, b], verifier outcomes [S, b])``; the ``S * b``
        rows are packed together, so all seeds share the widest prompt's bucket."""
        s = len(metadata_S)  # config_of: the config is static, stacked parameters merge too
        batch, spec = prepare(config_of(self.gd, params_S), tok, prompt_mask=mask > 0,
                              **self._decode_args(greedy=True))
        args = [jnp.asarray(x.reshape(s, -1, x.shape[1]))
                for x in (batch.tokens_BxP, batch.mask_BxP, batch.positions_BxP)]
        tasks = [self.reward_fns.task_arrays(m) for m in metadata_S]
        task = {k: jnp.asarray(np.stack([t[k] for t in tasks])) for k in tasks[0]}
        self.seed_programs.add(program_signature(spec, (params_S, args, task)))
        r_Sxb = np.asarray(seeds_evaluate(self.gd, self.reward_fns, spec, params_S, *args, task))
        return r_Sxb, r_Sxb > 0


def _eval_rows(n: int, mesh) -> tuple[int, int]:
    """This process's rows of an evaluation batch: its shard block when the rows split
    over the devices; otherwise the sampler replicates them and each process takes an
    equal contiguous part (so every row is scored exactly once)."""
    n_dev = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    if n % n_dev == 0:
        return hosts.own_rows(n, mesh)
    p, k = jax.process_index(), jax.process_count()
    return p * n // k, (p + 1) * n // k

