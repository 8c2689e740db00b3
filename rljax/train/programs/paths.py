"""The forward paths of a trainer's programs, chosen once when the trainer is built.

Four choices decide which forward and backward a learning program runs
(docs/design.md, "Forward paths"):

- attention: ``ModelConfig.attention`` of the policy ("xla", "splash", "cudnn");
- head: "one-pass" (``rljax.train.learn.onepass``: the head's gradient formed in the forward)
  or "chunked" (log-prob chunks recomputed in the backward), from ``RLConfig.one_pass_head``;
- prompt layout: each group's prompt computed once (``prompt_group`` G > 1), every
  row's (1), from ``RLConfig.share_prompts``, or rows packed into sequences by a token
  budget (``RLConfig.tokens_per_micro_batch``, ``rljax.train.learn.packing``);
- layers: scanned (``ModelConfig.scan_layers``) or unrolled, and what each layer keeps
  for the backward (``ModelConfig.remat``, or "full" where only ``RLConfig.remat`` asks).

:func:`resolve_paths` decides them from the configs and the models' graphdefs, a pure
function; the result, :class:`ForwardPaths`, is a field of the trainer's ``StepSpec``
(``rljax.train.programs.step``), so JAX's cache keys the programs by it and the programs
read it instead of deciding again. A choice left to its default (``None``: auto) that
cannot be taken falls back and says why in :attr:`ForwardPaths.notes`; a choice set
explicitly that cannot be taken is a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rljax import objectives as obj
from rljax.models.config import ModelConfig
from rljax.models.decoder import Decoder
from rljax.models.grouped import can_share_prompts
from rljax.models.scanned import effective_remat
from rljax.train.learn.layout import Layout, Packed, Padded

__all__ = ["HEADS", "ForwardPaths", "graph_model_config", "resolve_layout", "resolve_paths"]

HEADS = ("one-pass", "chunked")
# Where each attention kernel runs natively; elsewhere splash runs in Pallas interpret mode.
_NATIVE = {"splash": "tpu", "cudnn": "gpu"}


@dataclasses.dataclass(frozen=True)
class ForwardPaths:
    """The resolved forward paths of a trainer's learning programs (see the module).

    attention: the policy's ``ModelConfig.attention``.
    head: "one-pass" or "chunked".
    prompt_group: G > 1 when the learning program's forwards share each group's prompt
      (``StepSpec.share_group``); 1: every row computes its prompt.
    packed_tokens: > 0 when rows are packed into sequences, this many token slots a
      micro-batch (``RLConfig.tokens_per_micro_batch``; each step's bucket is set on
      ``StepSpec.layout``); 0: padded rows.
    layers: "scanned" or "unrolled".
    remat: what each layer keeps for the backward pass ("none", "full", "dots_saveable").
    notes: ``(choice, why)`` pairs for the defaults that fell back (or run other than
      natively); not part of the spec's equality or hash, so they never split a program.
    """

    attention: str = "xla"
    head: str = "chunked"
    prompt_group: int = 1
    packed_tokens: int = 0
    layers: str = "unrolled"
    remat: str = "none"
    notes: tuple = dataclasses.field(default=(), compare=False)

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"ForwardPaths.head={self.head!r}; allowed: {HEADS}")
        if self.layers not in ("scanned", "unrolled"):
            raise ValueError(f"ForwardPaths.layers={self.layers!r}; allowed: 'scanned', "
                             "'unrolled'")

    @property
    def prompt_layout(self) -> str:
        """``"shared(G=4)"``, ``"per-row"`` or ``"packed(tokens=1144)"``: the name of
        :func:`resolve_layout`'s layout."""
        return resolve_layout(self).name

    def choices(self) -> dict:
        """``{"attention", "head", "prompts", "layers"}`` as the start-up line shows them."""
        return {"attention": self.attention, "head": self.head,
                "prompts": self.prompt_layout, "layers": f"{self.layers}(remat={self.remat})"}

    def line(self) -> str:
        """One line: ``attention=xla head=one-pass prompts=shared(G=8)
        layers=scanned(remat=full)``, each choice that fell back followed by why."""
        why = dict(self.notes)
        return " ".join(f"{k}={v}" + (f" ({why[k]})" if k in why else "")
                        for k, v in self.choices().items())

    def record(self) -> dict:
        """The JSON record a run directory keeps (``config.json``'s ``"resolved"``)."""
        return {**dataclasses.asdict(self), "prompts": self.prompt_layout,
                "notes": dict(self.notes)}


def graph_model_config(graphdef) -> ModelConfig | None:
    """The ``ModelConfig`` among a split model's static attributes (None: none there)."""
    for _, attr in getattr(graphdef, "attributes", ()):
        config = getattr(attr, "value", None)
        if isinstance(config, ModelConfig):
            return config
    return None


def _is_decoder(graphdef) -> bool:
    """Whether a split model is a rljax ``Decoder`` (it has a linear output head:
    ``rljax.train.learn.logprobs.head_weight``)."""
    nodes = getattr(graphdef, "nodes", None)
    return bool(nodes) and getattr(nodes[0], "type", None) is Decoder


def _explicit_error(field: str, why: str, allowed: str) -> ValueError:
    return ValueError(f"RLConfig.{field}=True was set explicitly, but {why}; allowed: "
                      f"{allowed}")


def _head(objective: Callable, linear: bool, requested: bool | None) -> tuple[str, str]:
    if requested is False:
        return "chunked", ""
    why = ("" if linear else "the policy has no linear output head (a rljax Decoder has)")
    if linear and not obj.token_separable(objective):
        name = getattr(getattr(objective, "func", objective), "__name__", repr(objective))
        if getattr(objective, "keywords", {}).get("is_level") == "sequence":
            name += " with is_level='sequence'"
        why = f"one-pass needs a token-separable objective; {name} is not"
    if why and requested:
        raise _explicit_error("one_pass_head", why,
                              "None (auto: one-pass where it applies) or False")
    return ("chunked", why) if why else ("one-pass", "")


def _prompt_group(group_size: int, rows_per_micro: int, graphdefs: list,
                  requested: bool | None) -> tuple[int, str]:
    if requested is False:
        return 1, ""
    why = ""
    if group_size < 2:
        why = f"group_size={group_size}: one completion per prompt"
    elif not all(_is_decoder(gd) for gd in graphdefs):
        why = "a model is not a rljax Decoder: no shared-prompt forward"
    elif not all(can_share_prompts(gd) for gd in graphdefs):
        atts = sorted({graph_model_config(gd).attention for gd in graphdefs})
        why = f"attention {'/'.join(atts)} has no prefix path ('xla' and 'splash' do)"
    elif rows_per_micro % group_size:
        why = f"micro-batches of {rows_per_micro} rows split the groups of {group_size}"
    if why and requested:
        raise _explicit_error("share_prompts", why,
                              "None (auto: shared where it applies) or False")
    return (1, why) if why else (group_size, "")


def resolve_paths(policy_gd, *, objective: Callable, one_pass_head: bool | None,
                  share_prompts: bool | None, group_size: int, rows_per_micro: int,
                  remat: bool = False, other_gds: tuple = (), backend: str = "cpu",
                  tokens_per_micro_batch: int = 0) -> ForwardPaths:
    """The forward paths of a trainer (see the module docstring).

    policy_gd: the policy's graphdef; other_gds: the other models whose forwards the
    learning program runs on the same rows (the teacher), which must share prompts too.
    objective: the algorithm's objective (``rljax.train.learn.algorithms.make_objective``).
    one_pass_head, share_prompts, remat, tokens_per_micro_batch: ``RLConfig``'s fields
    (None: auto; packed rows compute every row's prompt: ``share_prompts`` must not be
    True, ``rljax.train.config.check_packing``).
    group_size: completions per prompt; rows_per_micro: rows in one micro-batch.
    backend: ``jax.default_backend()`` (only a note depends on it).
    Raises ValueError when an explicit choice (True) cannot be taken, saying why.
    """
    config = graph_model_config(policy_gd)
    notes = []
    attention = getattr(config, "attention", "xla")
    native = _NATIVE.get(attention)
    if attention == "splash" and backend != native:
        notes.append(("attention", f"Pallas interpret mode: the backend is {backend}, not tpu"))
    elif attention == "cudnn" and backend != native:
        notes.append(("attention", f"cuDNN needs a gpu backend; this one is {backend}"))
    head, why = _head(objective, _is_decoder(policy_gd), one_pass_head)
    if why:
        notes.append(("head", why))
    group, why = _prompt_group(group_size, rows_per_micro, [policy_gd, *other_gds],
                               False if tokens_per_micro_batch else share_prompts)
    if why:
        notes.append(("prompts", why))
    layers = "scanned" if getattr(config, "scan_layers", False) else "unrolled"
    return ForwardPaths(attention=attention, head=head, prompt_group=group,
                        packed_tokens=tokens_per_micro_batch, layers=layers,
                        remat=effective_remat(getattr(config, "remat", "none"), remat),
                        notes=tuple(notes))


def resolve_layout(paths: ForwardPaths, num_micro: int = 1, shards: int = 1) -> Layout:
    """The learning batch's layout (``rljax.train.learn.layout``) of ``paths``' prompt
    layout, chosen once with the trainer and held in its ``StepSpec``: ``Packed`` with
    ``paths.packed_tokens`` slots a micro-batch within ``shards`` batch shards (sized per
    batch), else ``Padded`` with the prompt group and ``num_micro`` micro-batches."""
    if paths.packed_tokens:
        return Packed(paths.packed_tokens, shards)
    return Padded(paths.prompt_group, num_micro)
