"""The RL step's batch, at the bottom of ``rljax.train``: what every rollout source
produces and the learning program consumes.

- :class:`Rollout`: one batch of sampled, scored completions as a frozen pytree of
  global arrays (it stays on device until the update);
- :func:`to_rollout`: the sampler's outputs and the scores in ``Rollout``'s order and
  dtypes; :func:`zero_variance_groups`: groups whose rewards are all equal;
- ``PromptSource``: ``source(start, n) -> (prompts, metadata)``, prompts addressed by
  global position (what a run's data stream is);
- :func:`stack_states` / :func:`unstack`: a leading seed axis on any pytree;
  :func:`widen_prompts`: a rollout's prompts in a wider bucket (to join rollouts).

Nothing here imports another module of ``rljax.train``: the interior's layers
(pyproject.toml, contract ``train-interior``) keep it at the bottom.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["PromptSource", "REPLAY_KEY", "Rollout", "stack_states", "to_rollout", "unstack",
           "widen_prompts", "zero_variance_groups"]

Array = Any
PromptSource = Callable[[int, int], tuple[Sequence[str], Sequence[dict]]]
#: The ``seqs`` key of router-replay ids (`rljax.sampling.SampleResult.expert_ids`, rows
#: first like every ``seqs`` array, so micro-batches slice them alike).
REPLAY_KEY = "expert_ids_BxLxSxK"


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
    expert_ids_BxLxSxK: an MoE sampler's routing (`rljax.sampling.SampleResult.expert_ids`,
      int8 / int16 over prompt and completion positions, -1 where never fed), or None;
      ``seqs()`` hands it to the learner's forwards, which route by it under
      ``MoeConfig.router_replay="replay"`` (router replay).
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
    expert_ids_BxLxSxK: Array | None = None
    group_size: int = dataclasses.field(default=1, metadata=dict(static=True))
    has_correct: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def lengths_B(self) -> Array:
        """Completion lengths in tokens (stop token included)."""
        return jnp.sum(self.completion_mask_BxT, axis=1)

    def seqs(self) -> dict:
        """The sequence arrays of the trainer's layout (``rljax.train.batching``), with the
        sampler's expert ids under `REPLAY_KEY` when the rollout has them."""
        out = {"prompt_BxP": self.prompt_BxP, "prompt_mask_BxP": self.prompt_mask_BxP,
               "completion_BxT": self.completion_BxT,
               "completion_mask_BxT": self.completion_mask_BxT}
        if self.expert_ids_BxLxSxK is not None:
            out[REPLAY_KEY] = self.expert_ids_BxLxSxK
        return out

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


def widen_prompts(ro: Rollout, width: int, pad_id: int) -> Rollout:
    """``ro`` with its prompts left-padded to ``width`` columns (a wider bucket); expert
    ids, over prompt and completion positions, get as many never-fed slots (-1) first."""
    extra = width - ro.prompt_BxP.shape[1]
    pad = ((0, 0), (extra, 0))
    ids = ro.expert_ids_BxLxSxK
    if ids is not None:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (extra, 0), (0, 0)), constant_values=-1)
    return dataclasses.replace(ro, prompt_BxP=jnp.pad(ro.prompt_BxP, pad, constant_values=pad_id),
                               prompt_mask_BxP=jnp.pad(ro.prompt_mask_BxP, pad),
                               expert_ids_BxLxSxK=ids)


def stack_states(states: Sequence) -> Any:
    """Per-seed pytrees (e.g. ``TrainState`` s) -> one whose arrays have a leading seed
    axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def unstack(tree, i: int):
    """Seed ``i``'s slice of a stacked tree."""
    return jax.tree.map(lambda x: x[i], tree)
