"""LoRA adapters owned by the decoder's projections, and the trainable / frozen split.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. (3): a frozen
weight ``W [in, out]`` gains a pair ``A [in, r]``, ``B [r, out]`` and the projection
computes

    y = x W + (alpha / r) (x A) B

``A`` is drawn uniform in ``±1 / sqrt(in)`` (PEFT's Kaiming-uniform with ``a = sqrt(5)``)
and ``B`` is zero, so a fresh adapter leaves the model unchanged. The pairs are
``nnx.LoRAParam`` variables of a :class:`LoraPair` owned by `Attention` (q, k, v, o) and
`MLP` (gate, up, down) and applied inside `rljax.models.layers.dense`, so every entry
point of the decoder (full forwards, grouped prompts, the KV-cache forward) runs them.
Multi-axis weights keep their axes: q ``[D, N, H]`` has ``A [D, r]`` and ``B [r, N, H]``,
o ``[N, H, D]`` has ``A [N, H, r]`` and ``B [r, D]``; each carries its weight's logical
axis names (the rank axis is never split). Adapters are float32 whatever the base's
dtype, and drawn from their own key stream, so a model's base weights do not depend on
whether it has adapters.

A model with adapters trains only them (:class:`Trainable`, chosen once by
:func:`trainable_of`); its KL reference is
its own base with a frozen copy of the adapters as RL starts (``rljax.train.learn.reference``),
never a copy of the base. :func:`set_adapters` switches adapters off (the base's function).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.sharding import constrain_logical

__all__ = ["ADAPTERS", "ALL_PARAMETERS", "ATTENTION_PROJECTIONS", "HF_PROJECTION_NAMES",
           "LoraConfig", "LoraPair", "MLP_PROJECTIONS", "PROJECTIONS", "Trainable",
           "adapter_arrays", "count_pairs", "has_adapters", "lora_delta", "lora_rngs",
           "merge_trainable", "merged_weight", "set_adapters", "split_trainable",
           "trainable_of"]

ATTENTION_PROJECTIONS = ("q", "k", "v", "o")
MLP_PROJECTIONS = ("gate", "up", "down")
#: Every projection an adapter can target, in the order the layers apply them.
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
#: Hugging Face's module name of each projection (what PEFT's `target_modules` says).
HF_PROJECTION_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj",
                       "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                       "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_ALIASES = {name.rsplit(".", 1)[1]: p for p, name in HF_PROJECTION_NAMES.items()}
# Adapters draw from a key folded from the model's key with this salt (b"LoRA").
_LORA_SALT = 0x4C6F5241


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the decoder's projections (off at rank 0).

    Attributes:
      rank: r, the adapters' inner width (0 = no adapters: the model and every program
        are those of a model without this section).
      alpha: the scale's numerator: adapters add ``(alpha / rank) (x A) B``.
      targets: the projections that get an adapter: "q", "k", "v", "o" (attention),
        "gate", "up", "down" (MLP), or their Hugging Face names ("q_proj", ...,
        "down_proj"); stored as rljax names in `PROJECTIONS` order. Default: all seven.
    """

    rank: int = 0
    alpha: float = 32.0
    targets: tuple[str, ...] = PROJECTIONS

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"LoraConfig.rank={self.rank!r} is invalid; allowed: an int >= 0 "
                             "(0 = no adapters)")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 0:
            raise ValueError(f"LoraConfig.alpha={a!r} is invalid; allowed: a finite number > 0")
        object.__setattr__(self, "alpha", float(a))
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, (tuple, list)) or not targets:
            raise ValueError(f"LoraConfig.targets={self.targets!r} is invalid; allowed: a "
                             f"non-empty tuple of {PROJECTIONS} (or their HF names)")
        unknown = [t for t in targets if _ALIASES.get(t, t) not in PROJECTIONS]
        if unknown:
            raise ValueError(f"LoraConfig.targets: {unknown} match no projection; the "
                             f"projections are {PROJECTIONS} (or their Hugging Face names "
                             f"{tuple(_ALIASES)})")
        names = [_ALIASES.get(t, t) for t in targets]
        if len(set(names)) != len(names):
            raise ValueError(f"LoraConfig.targets={self.targets!r} names a projection twice")
        object.__setattr__(self, "targets", tuple(p for p in PROJECTIONS if p in names))

    @property
    def enabled(self) -> bool:
        """Adapters are built (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, the factor on every adapter's output."""
        return self.alpha / self.rank

    def targets_of(self, projections: Sequence[str]) -> tuple[str, ...]:
        """The targeted names among ``projections`` (one module's)."""
        return tuple(p for p in projections if p in self.targets) if self.enabled else ()


def lora_rngs(rngs: nnx.Rngs) -> nnx.Rngs:
    """The adapters' own key stream: the model's ``params`` key folded with a salt, read
    without drawing from it, so the base weights are those of the same model without
    adapters."""
    return nnx.Rngs(lora=jax.random.fold_in(rngs.params.key[...], _LORA_SALT))


def _lora_param(value: jax.Array, names: Sequence[str | None]) -> nnx.LoRAParam:
    value = constrain_logical(jnp.asarray(value, jnp.float32), tuple(names))
    return nnx.LoRAParam(value, eager_sharding=False, logical_axes=tuple(names))


class LoraPair(nnx.Module):
    """One projection's adapter: ``a [*in, r]`` (uniform, ``±1 / sqrt(prod(in))``) and
    ``b [r, *out]`` (zeros), float32 `nnx.LoRAParam`s with the weight's logical axes.

    ``enabled`` (static, so it is part of the graphdef) switches the adapter off without
    touching its arrays: `set_adapters`.
    """

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                 in_names: Sequence[str | None], out_names: Sequence[str | None],
                 config: LoraConfig, rngs: nnx.Rngs) -> None:
        r = config.rank
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        draw = jax.random.uniform(rngs.lora(), (*in_shape, r), jnp.float32, -bound, bound)
        self.a = _lora_param(jax.lax.optimization_barrier(draw), (*in_names, None))
        self.b = _lora_param(jnp.zeros((r, *out_shape), jnp.float32), (None, *out_names))
        self.scale = config.scale
        self.enabled = True


def make_pairs(owner: nnx.Module, config: LoraConfig | None, rngs: nnx.Rngs | None,
               specs: dict) -> None:
    """Attach ``<name>_lora`` pairs to ``owner`` for the targeted names of ``specs``:
    ``name -> (weight shape, weight logical names, contracted axes)``."""
    if config is None or not config.enabled:
        return
    for name in config.targets_of(tuple(specs)):
        shape, names, contract = specs[name]
        setattr(owner, f"{name}_lora", LoraPair(shape[:contract], shape[contract:],
                                                names[:contract], names[contract:], config,
                                                rngs))


def adapter_arrays(owner: nnx.Module, name: str, dtype) -> tuple | None:
    """``(A, B, scale)`` of ``owner``'s adapter on projection ``name`` in ``dtype``, or
    None when it has none or it is switched off."""
    pair = getattr(owner, f"{name}_lora", None)
    if pair is None or not pair.enabled:
        return None
    return pair.a[...].astype(dtype), pair.b[...].astype(dtype), pair.scale


def lora_delta(x_NxI: jax.Array, a_IxR: jax.Array, b_RxO: jax.Array, scale: float,
               preferred_element_type=None) -> jax.Array:
    """``scale (x A) B`` for flattened ``x [N, in]``, ``A [in, r]``, ``B [r, out]``; the
    rank-wide product is rounded to ``x``'s dtype between the two dots."""
    xa = jnp.dot(x_NxI, a_IxR, preferred_element_type=jnp.float32).astype(x_NxI.dtype)
    d = jnp.dot(xa, b_RxO, preferred_element_type=preferred_element_type)
    return d * jnp.asarray(scale, d.dtype)


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``W + scale A B`` in ``W``'s layout (``A [*in, r]``, ``B [r, *out]``), float32:
    the weight that computes what the adapted projection computes. Stacked layers
    (``W [L, ...]``, ``A [L, *in, r]``, ``B [L, r, *out]``) merge layer by layer."""
    if a.ndim + b.ndim - 2 == w.ndim + 1:  # a leading layer axis on all three
        return jax.vmap(lambda w1, a1, b1: merged_weight(w1, a1, b1, scale))(w, a, b)
    r = a.shape[-1]
    ab = jnp.dot(a.reshape(-1, r).astype(jnp.float32), b.reshape(r, -1).astype(jnp.float32))
    return w.astype(jnp.float32) + scale * ab.reshape(w.shape)


def set_adapters(model: nnx.Module, enabled: bool) -> nnx.Module:
    """Switch every adapter of ``model`` on or off in place (their arrays untouched);
    returns ``model``. Off, the model computes its base weights' function (``nnx.merge``
    a fresh copy inside a program first)."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, LoraPair):
            node.enabled = enabled
    return model


def has_adapters(model) -> bool:
    """A model (its NNX state or its graphdef) holds `nnx.LoRAParam` leaves. A run decides
    this once, in :func:`trainable_of`."""
    if isinstance(model, nnx.GraphDef):
        return any(isinstance(t, type) and issubclass(t, nnx.LoRAParam)
                   for t in (getattr(n, "type", None) for n in model.nodes))
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return any(isinstance(x, nnx.LoRAParam) for x in leaves)


def count_pairs(state) -> int:
    """Adapter pairs in an NNX state: one per `LoraPair` (stacked layers count each
    layer: a scanned model's ``[L, ...]`` pair is L pairs)."""
    n = 0
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.LoRAParam) and path[-1] == "a":
            value = var.get_value()
            n += value.shape[0] if path[0] == "layers" and isinstance(path[1], str) else 1
    return n


@dataclasses.dataclass(frozen=True)
class Trainable:
    """Which parameters of a model train: every one (``adapters=False``) or its LoRA
    adapters (``adapters=True``: the base frozen). Chosen once per model
    (:func:`trainable_of`), it drives the gradients and the optimiser state
    (``rljax.train.learn.update``), the KL reference (``rljax.train.learn.reference``), and
    a LoRA run's checkpoints and export (``rljax.run.lora_runs``)."""

    adapters: bool = False

    def split(self, state):
        """``(trainable, frozen)``: the `nnx.LoRAParam` leaves and the rest, or the whole
        state and None. :meth:`merge` undoes it."""
        if not self.adapters:
            return state, None
        return nnx.split_state(state, nnx.LoRAParam, ...)

    @staticmethod
    def merge(trainable, frozen):
        """The model state :meth:`split` split (``frozen`` None: ``trainable`` itself)."""
        if frozen is None:
            return trainable
        return nnx.merge_state(frozen, trainable)


#: Every parameter trains.
ALL_PARAMETERS = Trainable(adapters=False)
#: The adapters train, the base is frozen.
ADAPTERS = Trainable(adapters=True)


def trainable_of(model) -> Trainable:
    """The filter of a model (its graphdef or state): :data:`ADAPTERS` when it has
    adapters, else :data:`ALL_PARAMETERS`. The one place a run decides it."""
    return ADAPTERS if has_adapters(model) else ALL_PARAMETERS


def split_trainable(state):
    """``(trainable, frozen)`` states of a model, by :func:`trainable_of` of the state."""
    return trainable_of(state).split(state)


#: The model state `split_trainable` split (``frozen`` None: ``trainable`` itself).
merge_trainable = Trainable.merge
