"""How a learning batch's rows are laid out for the forwards: one object, chosen once
(``rljax.train.programs.paths.resolve_layout``) and held in the ``StepSpec``. The learning
program asks it, never a flag, how rows are laid out, how a micro-batch is formed and
how each forward's outputs return to the ``[B, T]`` layout of advantages and objective.

| layout | a forward's rows | micro-batch i | back to ``[B, T]`` |
|---|---|---|---|
| ``Padded(group=1)`` (per row) | each row's prompt and completion, ``P + T`` | rows i, i + M, ... | as computed |
| ``Padded(group=G)`` (shared prompts) | each group's prompt once, then its G completions | groups i, i + M, ... | as computed |
| ``Packed(tokens, shards, shape)`` | real tokens of several rows side by side (``rljax.train.learn.packing``) | packed rows i, i + M, ... | gathered from the packed columns |

:func:`head_logprobs` and :func:`head_one_pass` run the output head on any layout: the
one place its forward and backward are called.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.layers import compute_dtype
from rljax.sharding import logical_axes
from rljax.train import hosts
from rljax.train.batch import REPLAY_KEY
from rljax.train.learn import packing as pack
from rljax.train.learn.logprobs import completion_hidden, head_weight, hidden_logprobs
from rljax.train.learn.micro import merge_micro, split_micro
from rljax.train.learn.onepass import TokenGrads, one_pass_head, padded_width
from rljax.train.learn.ppo import value_predictions

Array = Any
__all__ = ["Layout", "Packed", "Padded", "frozen_logprobs", "head_logprobs", "head_one_pass"]


class Layout:
    """What every layout does; the defaults keep rows as they are.

    | member | what |
    |---|---|
    | ``name``, ``group``, ``num_micro`` | the start-up line's name; rows share their prompt in groups of ``group`` (micro-batches and minibatches keep them whole); micro-batches per update and per frozen forward |
    | ``split`` | the update's micro-batch split (``update.accumulate``; None: every array by rows) |
    | ``for_rollout(ro)``, ``check(num_minibatches)`` | the layout sized for a rollout's batch; ValueError for a minibatch count it cannot take |
    | ``plan(seqs)`` | ``(seqs with the arrays the layout needs, extra metrics)`` |
    | ``over_micro(fn, seqs)`` | ``fn(micro-batch)`` over a frozen forward's micro-batches, in ``[B, T]`` |
    | ``micro(mb)`` | one micro-batch of the update as the loss reads it |
    | ``hidden(model, mb, remat)``, ``targets(mb)`` | the decoder's hidden states at the layout's positions, and the token each predicts |
    | ``rows(x, mb)`` | one micro-batch's per-position outputs in ``[B, T]`` |
    | ``values(graphdef, params, mb, remat)`` | a value model's predictions at the positions |
    | ``token_grads(loss_of, aux, mb, chunk)`` | ``(token_grads, aux)`` for :func:`head_one_pass`: a chunk's derivatives by ``loss_of(aux, logp_BxT, ent_BxT)`` (a token-separable loss on ``[B, T]``) with the chunk's values in place (elsewhere the sampler's log-probs: any finite values do) |
    """

    group: int = 1
    split = None

    def for_rollout(self, ro) -> Layout:
        return self

    def check(self, num_minibatches: int) -> None:
        return None

    def plan(self, seqs: dict) -> tuple[dict, dict]:
        return seqs, {}

    def micro(self, mb: dict) -> dict:
        return mb

    def rows(self, x: Array, mb: dict) -> Array:
        return x


@dataclasses.dataclass(frozen=True)
class Padded(Layout):
    """Rows as sampled: left-padded prompts and right-padded completions (``P + T``); with
    ``group`` G > 1 each group's prompt computed once by every policy forward."""

    group: int = 1
    num_micro: int = 1

    @property
    def name(self) -> str:
        return f"shared(G={self.group})" if self.group > 1 else "per-row"

    def over_micro(self, fn: Callable, seqs: dict) -> Array:
        if self.num_micro == 1:
            return fn(seqs)
        micro = jax.tree.map(lambda x: split_micro(x, self.num_micro, self.group), seqs)
        return merge_micro(jax.lax.map(fn, micro), self.group)

    def hidden(self, model, mb: dict, remat: bool) -> Array:
        return completion_hidden(model, mb["prompt_BxP"], mb["prompt_mask_BxP"],
                                 mb["completion_BxT"], mb["completion_mask_BxT"],
                                 remat=remat, group=self.group,
                                 replay_BxLxSxK=mb.get(REPLAY_KEY))

    def targets(self, mb: dict) -> Array:
        return mb["completion_BxT"]

    def values(self, graphdef, params, mb: dict, remat: bool = False) -> Array:
        # Every row computes its prompt: the value model has no shared-prompt forward.
        return value_predictions(graphdef, params, mb, remat=remat)

    def token_grads(self, loss_of: Callable, aux, mb: dict, chunk: int):
        b, t = mb["completion_mask_BxT"].shape  # at the chunks' padded width
        c, width = min(chunk, t), padded_width(t, chunk)
        pad = lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, width - t)))
        arrays, values, coef = aux
        wide = ({k: pad(v) for k, v in arrays.items()}, pad(values), coef)

        def token_grads(wide, logp_BxC, ent_BxC, start):
            put = lambda full, x: jax.lax.dynamic_update_slice(full, x, (0, start))
            a, e = jax.grad(lambda lp, en: loss_of(wide, lp, en), argnums=(0, 1))(
                put(wide[0]["sampler_logp_BxT"], logp_BxC),
                put(jnp.zeros((b, width), jnp.float32), ent_BxC))
            cut = lambda x: jax.lax.dynamic_slice(x, (0, start), (b, c))
            return cut(a), cut(e)

        return token_grads, wide


@dataclasses.dataclass(frozen=True)
class Packed(Layout):
    """Each row's real tokens packed into rows of width ``P + T`` within each of
    ``shards`` batch shards, ``tokens`` slots a micro-batch
    (``RLConfig.tokens_per_micro_batch``); ``shape``: this batch's bucket
    (``packing.PackSpec``), set per rollout by :meth:`for_rollout` (None until then)."""

    tokens: int
    shards: int = 1
    shape: pack.PackSpec | None = None
    split = staticmethod(pack.split_packed)

    @property
    def name(self) -> str:
        return f"packed(tokens={self.tokens})"

    @property
    def num_micro(self) -> int:
        return self._shape().num_micro

    def _shape(self) -> pack.PackSpec:
        if self.shape is None:
            raise ValueError(f"{self.name}: the batch's bucket is not set; a learning program "
                             "of packed rows needs Packed.for_rollout(rollout) (or sized)")
        return self.shape

    def sized(self, bins: int, width: int) -> Packed:
        """This layout with the bucket of a batch whose fullest shard needs ``bins`` packed
        rows of ``width`` (``packing.choose_spec``)."""
        return dataclasses.replace(self, shape=pack.choose_spec(int(bins), self.tokens, width,
                                                                self.shards))

    def for_rollout(self, ro) -> Packed:
        # The plan's packed-row count: one replicated scalar, the step's packing transfer.
        bins = hosts.fetch_scalars(pack.pack_bins(ro.masked_by_weight().seqs(), self.shards))
        return self.sized(bins, ro.prompt_BxP.shape[1] + ro.completion_BxT.shape[1])

    def check(self, num_minibatches: int) -> None:
        if num_minibatches > 1:
            raise ValueError(f"make_learn: packed rows (RLConfig.tokens_per_micro_batch) need "
                             f"num_minibatches=1, got {num_minibatches}: the plan packs "
                             "the whole batch once")

    def plan(self, seqs: dict) -> tuple[dict, dict]:
        # From the masks alone: the same plan on every process.
        seqs = dict(seqs, **pack.make_plan(seqs, self._shape()))
        return seqs, {"useful_token_frac": pack.useful_token_frac(seqs)}

    def over_micro(self, fn: Callable, batch: dict) -> Array:
        return pack.unpack(pack.over_micro(fn, batch, self.num_micro), batch, self.shards)

    def micro(self, mb: dict) -> dict:
        return pack.this_micro(mb, self._shape())

    def hidden(self, model, mb: dict, remat: bool) -> Array:
        return pack.packed_hidden(model, mb, remat)

    def targets(self, mb: dict) -> Array:
        return mb["pack_targets_SxW"]

    def rows(self, x_SxW: Array, mb: dict) -> Array:
        return pack.unpack_micro(x_SxW, mb, self.shards, self.num_micro)

    def values(self, graphdef, params, mb: dict, remat: bool = False) -> Array:
        model = nnx.merge(graphdef, params)
        return model.values_from_hidden(self.hidden(model, mb, remat)).astype(jnp.float32)

    def token_grads(self, loss_of: Callable, aux, mb: dict, chunk: int):
        return pack.packed_token_grads(loss_of, aux, mb, chunk, self.shards)


def head_logprobs(layout: Layout, graphdef, params, mb: dict, *, chunk: int,
                  temperature: float, remat: bool = False) -> tuple[Array, Array]:
    """``(logp, entropy)`` of the decoder ``(graphdef, params)`` at ``layout``'s positions
    (``layout.rows`` puts them in ``[B, T]``): the linear head's chunked log-probs with
    their hand-written backward, or autodiff through chunks for another head
    (``rljax.train.learn.logprobs.hidden_logprobs``)."""
    model = nnx.merge(graphdef, params)
    return hidden_logprobs(graphdef, params, model, layout.hidden(model, mb, remat),
                           layout.targets(mb), chunk=chunk, temperature=temperature)


def frozen_logprobs(layout: Layout, graphdef, params, seqs: dict, *, chunk: int,
                    temperature: float) -> Array:
    """A frozen forward's (reference, old policy, teacher) completion log-probs ``[B, T]``
    over ``seqs`` (with ``layout.plan``'s arrays), micro-batch by micro-batch."""
    fn = lambda mb: head_logprobs(layout, graphdef, params, mb, chunk=chunk,
                                  temperature=temperature)[0]
    return layout.over_micro(fn, seqs)


def head_one_pass(layout: Layout, graphdef, params, mb: dict, token_grads: TokenGrads, aux, *,
                  chunk: int, temperature: float = 1.0, remat: bool = False,
                  with_entropy: bool = False):
    """``(surrogate, logp, entropy)`` at ``layout``'s positions by the one-pass head
    (``rljax.train.learn.onepass.one_pass_head``: the loss's gradient of the linear head
    formed in the forward); ``token_grads`` and ``aux`` as ``layout.token_grads`` makes
    them. The surrogate's gradient reaches every decoder parameter (the head directly,
    the layers and the embedding through the hidden states)."""
    model = nnx.merge(graphdef, params)
    head = head_weight(model)
    if head is None:  # the head form was resolved with the trainer
        raise ValueError("one-pass head: the policy has no linear output head; the head "
                         "form is resolved by rljax.train.programs.paths.resolve_paths, "
                         "which would have chosen 'chunked'")
    w, vocab_major = head
    h = layout.hidden(model, mb, remat)
    names = logical_axes(getattr(model, "embed" if vocab_major else "lm_head"))
    return one_pass_head(w, h, layout.targets(mb), token_grads, aux, vocab_major=vocab_major,
                         chunk=chunk, temperature=temperature,
                         compute_dtype=compute_dtype(model.config), with_entropy=with_entropy,
                         weight_names=names)
