"""Hugging Face tensor names of Qwen3-MoE layers, in both expert layouts.

On disk transformers 5 writes one tensor per expert and projection
(``model.layers.N.mlp.experts.E.gate_proj.weight`` ``[F, D]``, ``up_proj`` ``[F, D]``,
``down_proj`` ``[D, F]``), what 4.x checkpoints hold too; in memory it fuses them
(``mlp.experts.gate_up_proj`` ``[E, 2F, D]``, gate rows first, and ``mlp.experts.down_proj``
``[E, D, F]``), and a state dict saved as it is has that layout. `weight_map` lists the
per-expert names; `FusedExperts` reads a fused checkpoint as if it had them, and
`fuse_specs` writes the fused layout from per-expert tensors.
"""

from __future__ import annotations

import re

import numpy as np

from rljax.models.config import ModelConfig

#: Expert layouts `rljax.models.hf_io.write_pretrained` can write.
EXPERT_LAYOUTS = ("per_expert", "fused")
_PROJ = ("gate", "up", "down")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_TRANSPOSE = (lambda w: w.T, lambda w: w.T)


def moe_entries(config: ModelConfig, prefix: str, spath: tuple) -> list:
    """`weight_map` entries of one MoE layer's feed-forward: the router
    (``mlp.gate.weight`` ``[E, D]``) and each expert's three projections (state path: the
    stacked parameter, then the expert index)."""
    moe = config.moe
    d, f, e = config.hidden_size, moe.intermediate_size, moe.num_experts
    out = [(prefix + "mlp.gate.weight", spath + ("mlp", "router"), (e, d), _TRANSPOSE)]
    for x in range(e):
        out += [(prefix + f"mlp.experts.{x}.{p}_proj.weight", spath + ("mlp", p, x),
                 (d, f) if p == "down" else (f, d), _TRANSPOSE) for p in _PROJ]
    return out


class FusedExperts:
    """A tensor source (``shape`` / ``get``, as `SafetensorsFile`) serving the per-expert
    names of a fused ``experts.gate_up_proj`` / ``experts.down_proj`` pair."""

    def __init__(self, file, gate_up_name: str, down_name: str) -> None:
        self.file, self.gate_up, self.down = file, gate_up_name, down_name
        self.path = file.path

    @staticmethod
    def split(name: str) -> tuple[str, int, str]:
        """(``...mlp.experts``, expert index, "gate" | "up" | "down") of a per-expert name."""
        m = _PER_EXPERT.match(name)
        if m is None:
            raise ValueError(f"{name!r} is not a per-expert tensor name")
        return m.group(1), int(m.group(2)), m.group(3)

    def shape(self, name: str) -> tuple[int, ...]:
        _, _, proj = self.split(name)
        full = self.file.shape(self.down if proj == "down" else self.gate_up)
        return tuple(full[1:]) if proj == "down" else (full[1] // 2, full[2])

    def get(self, name: str) -> np.ndarray:
        _, x, proj = self.split(name)
        if proj == "down":
            return self.file.get(self.down)[x]
        w = self.file.get(self.gate_up)[x]
        half = w.shape[0] // 2
        return w[:half] if proj == "gate" else w[half:]


def expand_fused(tensors: dict) -> dict:
    """``tensors`` (name -> source) with every fused expert pair replaced by its
    per-expert names served by `FusedExperts`; a checkpoint without fused experts is
    returned as it is."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
        base = name[: -len(".gate_up_proj")]
        down = base + ".down_proj"
        if down not in tensors:
            raise ValueError(f"checkpoint has {name} but not {down}")
        src = FusedExperts(tensors[name], name, down)
        experts = tensors[name].shape(name)[0]
        del out[name], out[down]
        out.update({f"{base}.{x}.{p}_proj.weight": src for x in range(experts) for p in _PROJ})
    return out


def fuse_specs(specs: list) -> list:
    """Write specs ``(name, shape, dtype, produce)`` with each layer's per-expert tensors
    replaced by the fused ``experts.gate_up_proj`` ``[E, 2F, D]`` and
    ``experts.down_proj`` ``[E, D, F]`` (produced one layer at a time)."""
    out, groups = [], {}
    for spec in specs:
        m = _PER_EXPERT.match(spec[0])
        if m is None:
            out.append(spec)
            continue
        base = m.group(1)
        if base not in groups:
            groups[base] = {}
            out.append(base)  # placeholder, filled below in order
        groups[base][(int(m.group(2)), m.group(3))] = spec
    fused = []
    for spec in out:
        if isinstance(spec, str):
            fused.extend(_fused(spec, groups[spec]))
        else:
            fused.append(spec)
    return fused


def _fused(base: str, parts: dict) -> tuple:
    experts = 1 + max(x for x, _ in parts)
    _, (f, d), dtype, _ = parts[(0, "gate")]

    def gate_up():
        return np.stack([np.concatenate([parts[(x, "gate")][3](), parts[(x, "up")][3]()])
                         for x in range(experts)])

    def down():
        return np.stack([parts[(x, "down")][3]() for x in range(experts)])

    return ((base + ".gate_up_proj", (experts, 2 * f, d), dtype, gate_up),
            (base + ".down_proj", (experts, d, f), dtype, down))
