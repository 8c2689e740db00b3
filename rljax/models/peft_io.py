"""Exporting LoRA adapters: merged into the base's Hugging Face tensors, or as a PEFT folder.

Both read tensors one at a time through getters, as `rljax.models.hf_io.write_pretrained`
does, so a multi-process export gathers one tensor at a time:

- :func:`merged_getter` turns a base getter (``state path -> array``) and an adapter
  getter into one that returns ``W + (alpha / r) A B`` for every adapted projection, so
  `write_pretrained` writes the merged model a plain transformers model loads;
- :func:`write_peft` writes ``adapter_config.json`` and ``adapter_model.safetensors``
  with PEFT's key names (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``
  ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``), which ``peft.PeftModel.from_pretrained``
  loads onto the transformers model of the base (PEFT's scale is ``lora_alpha / r``, the
  same as ours).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

from rljax.models.config import ModelConfig
from rljax.models.lora import HF_PROJECTION_NAMES, merged_weight
from rljax.models.safetensors_io import write_safetensors
from rljax.models.writes import atomic_dir

__all__ = ["adapter_paths", "merged_getter", "peft_config", "write_peft"]

_MODULE = {"q": "attn", "k": "attn", "v": "attn", "o": "attn",
           "gate": "mlp", "up": "mlp", "down": "mlp"}


def adapter_paths(config: ModelConfig, layer: int, proj: str) -> tuple[tuple, tuple, tuple]:
    """Per-layer state paths ``(weight, A, B)`` of projection ``proj`` in layer ``layer``
    (unscanned form, as in `rljax.models.hf_io.weight_map`; `state_location` maps them)."""
    s = ("layers", layer, _MODULE[proj])
    return s + (proj,), s + (f"{proj}_lora", "a"), s + (f"{proj}_lora", "b")


def merged_getter(config: ModelConfig, get: Callable, get_adapter: Callable) -> Callable:
    """A getter of the merged model's tensors: ``get(state path)`` for every tensor but an
    adapted projection's weight, which is ``W + (alpha / r) A B`` (float32) with ``A``, ``B``
    from ``get_adapter(state path)``. Both getters take `weight_map`'s per-layer paths."""
    lora = config.lora
    if lora is None:
        return get
    merged = {adapter_paths(config, i, p)[0]: adapter_paths(config, i, p)[1:]
              for i in range(config.num_layers) for p in lora.targets}

    def one(spath):
        w = np.asarray(get(spath))
        if spath not in merged:
            return w
        a, b = (np.asarray(get_adapter(p)) for p in merged[spath])
        return np.asarray(merged_weight(w, a, b, lora.scale))

    return one


def peft_config(config: ModelConfig, base_model: str | None = None) -> dict:
    """PEFT's ``adapter_config.json`` for ``config.lora``."""
    lora = config.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted(HF_PROJECTION_NAMES[p].rsplit(".", 1)[1]
                                     for p in lora.targets),
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model}


def write_peft(config: ModelConfig, get_adapter: Callable, path: str | os.PathLike | None, *,
               base_model: str | None = None) -> None:
    """Write ``config.lora``'s adapters as a PEFT folder at ``path``: adapter_config.json
    and adapter_model.safetensors (float32). ``get_adapter(state path)`` returns a per-layer
    ``A [*in, r]`` or ``B [r, *out]`` (paths of :func:`adapter_paths`). ``path=None``
    calls the getter in the same order and writes nothing (a multi-process export's
    other processes). Atomic, as `rljax.models.hf_io.write_pretrained`."""
    lora = config.lora
    if lora is None:
        raise ValueError("write_peft: the model has no adapters (lora.rank is 0)")
    r, specs = lora.rank, []
    for i in range(config.num_layers):
        for p in lora.targets:
            _, a_path, b_path = adapter_paths(config, i, p)
            key = f"base_model.model.model.layers.{i}.{HF_PROJECTION_NAMES[p]}"
            for which, spath, to_peft in (("A", a_path, lambda a: a.reshape(-1, r).T),
                                          ("B", b_path, lambda b: b.reshape(r, -1).T)):
                specs.append((f"{key}.lora_{which}.weight", spath, to_peft))
    shapes = _peft_shapes(config)
    out = [(name, shapes[spath[-2:]], np.dtype(np.float32),
            lambda s=spath, f=f: f(np.asarray(get_adapter(s), np.float32)))
           for name, spath, f in specs]
    if path is None:
        for *_, produce in out:
            produce()
        return
    with atomic_dir(path) as tmp:
        with open(tmp / "adapter_config.json", "w") as fh:
            json.dump(peft_config(config, base_model), fh, indent=2)
        write_safetensors(tmp / "adapter_model.safetensors", out)


def _peft_shapes(config: ModelConfig) -> dict:
    """PEFT's ``(name_lora, "a" | "b") -> shape``: ``lora_A [r, in]``, ``lora_B [out, r]``."""
    c, r = config, config.lora.rank
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    d, f = c.hidden_size, c.intermediate_size
    io = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f),
          "down": (f, d)}
    return {k: v for p, (i, o) in io.items()
            for k, v in (((f"{p}_lora", "a"), (r, i)), ((f"{p}_lora", "b"), (o, r)))}

