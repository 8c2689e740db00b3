"""The sampler's output: a frozen pytree of prompt and completion arrays.

Rows are ``R = B * G``: prompt ``b`` appears in rows ``b*G .. b*G + G - 1`` (its group).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SampleResult"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    """Prompts and sampled completions, ready for rewards and the trainer.

    prompt_tokens: int32 ``[R, P]``, left-padded (``pad_id`` in padding).
    prompt_mask: bool ``[R, P]``, True on real prompt tokens.
    prompt_positions: int32 ``[R, P]``, ``cumsum(prompt_mask) - 1`` (clipped at 0).
    tokens: int32 ``[R, N]`` completion tokens (``N = max_new_tokens``), ``pad_id`` after
      the stop token.
    completion_mask: bool ``[R, N]``, True on generated tokens, the stop token included.
    positions: int32 ``[R, N]``, the model positions of the completion tokens.
    lengths: int32 ``[R]``, number of completion tokens (stop token included).
    truncated: bool ``[R]``, True where no stop token was produced within ``N`` tokens.
    logprobs: float32 ``[R, N]``, ``log pi(token)`` under the policy at temperature 1
      (0 where the mask is False).
    sampling_logprobs: float32 ``[R, N]``, the log-prob under the distribution actually
      sampled from (temperature, top-k, top-p; 0 for greedy and where masked).
    prompt_index: int32 ``[R]``, which input prompt each row continues (``row // G``).
    expert_ids: an MoE model's routing, for router replay: int8 / int16
      ``[R, L_moe, P + N, k]`` in `sequences`' columns, the experts each MoE layer sent
      each prompt and completion token to; -1 where a token was never fed (the last
      completion column). None for a dense model.
    """

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    prompt_positions: jax.Array
    tokens: jax.Array
    completion_mask: jax.Array
    positions: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    logprobs: jax.Array
    sampling_logprobs: jax.Array
    prompt_index: jax.Array
    expert_ids: jax.Array | None = None

    def sequences(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Full sequences ``(ids_RxT, mask_RxT, positions_RxT)`` with ``T = P + N``.

        The prompt is followed by its completion; ``mask`` is True on real prompt and
        completion tokens; positions continue the prompt's. This is what the trainer
        feeds to the policy to recompute ``logprobs`` (at columns ``P-1 .. T-2``).
        """
        ids = jnp.concatenate([self.prompt_tokens, self.tokens], axis=1)
        mask = jnp.concatenate([self.prompt_mask, self.completion_mask], axis=1)
        pos = jnp.concatenate([self.prompt_positions, self.positions], axis=1)
        return ids, mask, pos
