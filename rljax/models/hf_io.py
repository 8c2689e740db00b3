"""Hugging Face checkpoints: `from_pretrained` and `save_pretrained` for the Decoder.

HF stores linear weights `[out, in]`; rljax stores `[in, out]` with heads split out
(q `[D, N, H]`, o `[N, H, D]`). Loading builds the model abstractly (no random init),
then reads one tensor at a time from memory-mapped safetensors straight to its device
placement, so peak host memory is about the float32 model plus one tensor (a scanned
model, `ModelConfig.scan_layers`: plus one stacked `[L, ...]` tensor, assembled from the
per-layer HF tensors before it is placed; saving slices it back per layer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike

from rljax.models.adapters import init_adapters
from rljax.models.config import ModelConfig
from rljax.models.decoder import Decoder
from rljax.models.hf_config import config_from_hf, config_to_hf
from rljax.models.moe_io import EXPERT_LAYOUTS, expand_fused, fuse_specs, moe_entries
from rljax.models.peft_io import merged_getter
from rljax.models.safetensors_io import SafetensorsFile, write_safetensors
from rljax.models.writes import atomic_dir
from rljax.sharding import state_shardings

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _linear(*out_dims):
    """HF `[prod(out_dims), in]` <-> rljax `[in, *out_dims]`."""
    return ((lambda w: w.T.reshape(w.shape[1], *out_dims)),
            (lambda w: w.reshape(w.shape[0], -1).T))


def _out_proj(n, h):
    """HF o_proj `[D, N*H]` <-> rljax `[N, H, D]`."""
    return (lambda w: w.T.reshape(n, h, w.shape[0])), (lambda w: w.reshape(n * h, -1).T)


_SAME = (lambda w: w, lambda w: w)
_TRANSPOSE = (lambda w: w.T, lambda w: w.T)


def weight_map(config: ModelConfig) -> list[tuple[str, tuple, tuple[int, ...], tuple]]:
    """(HF name, rljax state path, HF shape, (to_ours, to_hf)) for every tensor."""
    c = config
    d, f, v, h = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    n, k = c.num_heads, c.num_kv_heads
    out = [("model.embed_tokens.weight", ("embed",), (v, d), _SAME),
           ("model.norm.weight", ("final_norm", "scale"), (d,), _SAME)]
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", ("lm_head",), (v, d), _TRANSPOSE))
    for i in range(c.num_layers):
        p, s = f"model.layers.{i}.", ("layers", i)
        qkv = (("q", n), ("k", k), ("v", k))
        out += [
            (p + "input_layernorm.weight", s + ("attn_norm", "scale"), (d,), _SAME),
            (p + "post_attention_layernorm.weight", s + ("mlp_norm", "scale"), (d,), _SAME),
            *[(p + f"self_attn.{x}_proj.weight", s + ("attn", x), (m * h, d), _linear(m, h))
              for x, m in qkv],
            (p + "self_attn.o_proj.weight", s + ("attn", "o"), (d, n * h), _out_proj(n, h)),
        ]
        if c.moe_layers[i]:
            out += moe_entries(c, p, s)
        else:
            out += [(p + "mlp.gate_proj.weight", s + ("mlp", "gate"), (f, d), _TRANSPOSE),
                    (p + "mlp.up_proj.weight", s + ("mlp", "up"), (f, d), _TRANSPOSE),
                    (p + "mlp.down_proj.weight", s + ("mlp", "down"), (d, f), _TRANSPOSE)]
        if c.qkv_bias:
            out += [(p + f"self_attn.{x}_proj.bias", s + ("attn", f"{x}_bias"), (m * h,),
                     (lambda b, m=m: b.reshape(m, h), lambda b: b.reshape(-1))) for x, m in qkv]
        if c.qk_norm:
            out += [(p + "self_attn.q_norm.weight", s + ("attn", "q_norm", "scale"), (h,), _SAME),
                    (p + "self_attn.k_norm.weight", s + ("attn", "k_norm", "scale"), (h,), _SAME)]
    return out


def state_location(config: ModelConfig, spath: tuple) -> tuple[tuple, tuple | None]:
    """Where `weight_map`'s per-layer state path lives in a model of `config`:
    `(path, None)` for a whole parameter; `(path, index)`, a slice of a stacked parameter:
    `(i,)` of a scanned decoder's `[L, ...]` (`scan_layers=True`), `(e,)` of an expert
    stack `[E, ...]` (the path's trailing int), `(i, e)` of both."""
    index = ()
    if isinstance(spath[-1], int):
        spath, index = spath[:-1], (spath[-1],)
    if config.scan_layers and spath[0] == "layers":
        spath, index = ("layers", *spath[2:]), (spath[1], *index)
    return spath, (index or None)


def state_getter(model: Decoder):
    """``get(state path of weight_map) -> host array`` of `model`'s parameters (adapters
    too), one slice of a stacked parameter at a time."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))

    def get(spath):
        path, index = state_location(model.config, spath)
        value = flat[path].get_value()
        return jax.device_get(value if index is None else value[index])

    return get


def _read_config(path: pathlib.Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"from_pretrained: {file} does not exist")
    with open(file) as fh:
        return json.load(fh)


def _open_weights(path: pathlib.Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> open file, from model.safetensors or model.safetensors.index.json."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        with open(index) as fh:
            names = json.load(fh).get("weight_map")
        if not isinstance(names, dict):
            raise ValueError(f"{index}: missing or malformed 'weight_map'")
        files = {}
        for fname in sorted(set(names.values())):
            if not (path / fname).is_file():
                raise FileNotFoundError(f"{index} names {fname}, which does not exist")
            files[fname] = SafetensorsFile(path / fname)
        return {name: files[fname] for name, fname in names.items()}
    if single.is_file():
        f = SafetensorsFile(single)
        return {name: f for name in f.names()}
    raise FileNotFoundError(
        f"from_pretrained: {path} has neither model.safetensors nor "
        "model.safetensors.index.json (only safetensors weights are supported)"
    )


def _check_names(wmap, tensors, config):
    expected = {name for name, *_ in wmap}
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"checkpoint lacks tensors {missing[:5]} (total {len(missing)} missing)")
    extra = sorted(
        t for t in set(tensors) - expected
        if not t.endswith(_IGNORED_SUFFIXES) and not (t == "lm_head.weight" and config.tie_word_embeddings)
    )
    if extra:
        raise ValueError(
            f"checkpoint has tensors this {config.architecture} config does not use: "
            f"{extra[:5]} (total {len(extra)}); is config.json for these weights?"
        )


def _read_tensor(file: SafetensorsFile, name, hf_shape, to_ours) -> np.ndarray:
    """One HF tensor in rljax's layout, float32, in memory of its own."""
    shape = file.shape(name)
    if shape != hf_shape:
        raise ValueError(
            f"tensor {name!r} in {file.path} has shape {shape}, but config.json implies "
            f"{hf_shape}"
        )
    raw = file.get(name)
    ours = np.asarray(to_ours(raw), dtype=np.float32)
    if np.may_share_memory(ours, raw):
        # Own writable memory, never the read-only file mapping: on CPU `device_put` may
        # alias the host array, and donated buffers get written to.
        ours = ours.copy()
    return ours


def _place(ours: np.ndarray, sharding):
    if sharding is None:
        return jax.device_put(ours)
    return jax.make_array_from_callback(ours.shape, sharding, lambda idx: ours[idx])


def _parse_dtype(dtype) -> str:
    name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"from_pretrained: dtype={dtype!r}; allowed: float32, bfloat16")
    return name


def from_pretrained(path: str | os.PathLike, *, dtype: DTypeLike = jnp.float32,
                    mesh: Mesh | None = None, attention: str = "xla",
                    scan_layers: bool = False, remat: str = "none", lora=None,
                    lora_seed: int = 0) -> Decoder:
    """Load an HF Llama / Qwen2 / Qwen3 checkpoint folder as a `Decoder`.

    dtype: the compute dtype (parameters are always float32). mesh: when given, every
    tensor is placed straight to its sharding (per `rljax.sharding.LOGICAL_RULES`).
    attention: `ModelConfig.attention` ("xla" | "splash" | "cudnn"). scan_layers, remat:
    as in `ModelConfig` (a scanned model stacks the per-layer HF tensors). lora: a
    `rljax.models.lora.LoraConfig` (or None): the base from the folder, fresh adapters
    drawn from ``jax.random.key(lora_seed)`` (`rljax.models.adapters.init_adapters`).
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"from_pretrained: {path} is not a directory")
    config = config_from_hf(_read_config(path), compute_dtype=_parse_dtype(dtype),
                            attention=attention)
    config = dataclasses.replace(config, scan_layers=scan_layers, remat=remat, lora=lora)
    tensors = expand_fused(_open_weights(path))
    wmap = weight_map(config)
    _check_names(wmap, tensors, config)
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(abs_state))
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(state_shardings(abs_state, mesh)))
    values, stacks = {}, {}
    located = [(state_location(config, entry[1]), entry) for entry in wmap]
    if config.scan_layers or config.moe is not None:
        # All slices of one stacked parameter, then the next: one [L, ...] (or [E, ...])
        # host buffer is alive at a time.
        located.sort(key=lambda e: (e[0][1] is not None, e[0][0], e[0][1] or ()))
    filled = {}
    for (path, index), (name, _, hf_shape, (to_ours, _)) in located:
        sharding = shardings[path].get_value() if mesh else None
        ours = _read_tensor(tensors[name], name, hf_shape, to_ours)
        if index is not None:
            shape = targets[path].get_value().shape
            buf = stacks.setdefault(path, np.empty(shape, np.float32))
            buf[index] = ours
            filled[path] = filled.get(path, 0) + 1
            if filled[path] < int(np.prod(shape[:len(index)])):
                continue
            ours = stacks.pop(path)
        values[path] = targets[path].replace(_place(ours, sharding))
    state = nnx.from_flat_state(sorted(values.items()))
    if config.lora is not None:
        state = nnx.merge_state(state, init_adapters(config, jax.random.key(lora_seed), mesh))
    return nnx.merge(graphdef, state)


_WRITE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


#: The token ids `special_token_ids` reads from a tokenizer.
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(tokenizer) -> dict[str, int]:
    """`{"bos_token_id", "eos_token_id", "pad_token_id"}` of `tokenizer` (those it has),
    for `write_pretrained(special_ids=...)`."""
    ids = {k: getattr(tokenizer, k, None) for k in SPECIAL_IDS}
    return {k: int(v) for k, v in ids.items() if isinstance(v, (int, np.integer))}


def save_pretrained(model: Decoder, path: str | os.PathLike, *,
                    max_shard_bytes: int | None = None, dtype: str = "float32",
                    special_ids: dict[str, int] | None = None,
                    expert_layout: str = "per_expert") -> None:
    """Write `model` as an HF checkpoint (config.json + safetensors) to `path`; a model
    with LoRA adapters is written merged (`rljax.models.peft_io.merged_getter`).

    max_shard_bytes: split the weights over several files with model.safetensors.index.json.
    dtype: "float32" (default) or "bfloat16" for the written weights.
    special_ids: token ids (`special_token_ids(tokenizer)`) for config.json and
      generation_config.json, so transformers' `generate` stops at EOS and pads.
    expert_layout: an MoE model's experts as "per_expert" tensors (what transformers
      writes) or "fused" (its in-memory `gate_up_proj` / `down_proj`; `rljax.models.moe_io`).
    Atomic: everything is written to a temporary folder first (see `atomic_dir`).
    """
    if not isinstance(model, Decoder):
        raise TypeError(f"save_pretrained: model must be a Decoder, got {type(model).__name__}")
    get = state_getter(model)
    write_pretrained(model.config, merged_getter(model.config, get, get), path,
                     max_shard_bytes=max_shard_bytes, dtype=dtype, special_ids=special_ids,
                     expert_layout=expert_layout)


def write_pretrained(config: ModelConfig, get_tensor, path: str | os.PathLike | None, *,
                     max_shard_bytes: int | None = None, dtype: str = "float32",
                     special_ids: dict[str, int] | None = None,
                     expert_layout: str = "per_expert") -> None:
    """Write an HF checkpoint of `config` whose tensors come one at a time, in
    `weight_map` order, from `get_tensor(state_path)` (an array in rljax's layout); only
    one converted tensor is alive at a time.

    path=None writes nothing but calls `get_tensor` in the same order: what the other
    processes of a multi-process export do, taking part in each tensor's gather while
    process 0 writes. Sharding into files, `special_ids`, `expert_layout` and atomicity
    as in `save_pretrained`.
    """
    if dtype not in _WRITE_DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {sorted(_WRITE_DTYPES)}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}; allowed: {EXPERT_LAYOUTS}")
    np_dtype = _WRITE_DTYPES[dtype]
    specs = [(name, hf_shape, np_dtype,
              lambda s=spath, f=to_hf, n=name: _finite_in(f(np.asarray(get_tensor(s))), n, dtype))
             for name, spath, hf_shape, (_, to_hf) in weight_map(config)]
    if expert_layout == "fused":
        specs = fuse_specs(specs)
    groups = _shard_groups(specs, max_shard_bytes)
    if path is None:
        for _, _, _, produce in specs:
            produce()
        return
    ids = _checked_special_ids(special_ids, config.vocab_size)
    hf_config = {**config_to_hf(config), "dtype": dtype, **ids}
    with atomic_dir(path) as tmp:
        with open(tmp / "config.json", "w") as fh:
            json.dump(hf_config, fh, indent=2)
        if ids:  # transformers' generate reads its stop and pad ids from this file
            with open(tmp / "generation_config.json", "w") as fh:
                json.dump(ids, fh, indent=2)
        if len(groups) == 1:
            write_safetensors(tmp / "model.safetensors", groups[0])
            return
        weight_names = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            write_safetensors(tmp / fname, group)
            weight_names.update({name: fname for name, *_ in group})
        total = sum(_nbytes(spec) for spec in specs)
        with open(tmp / "model.safetensors.index.json", "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_names}, fh, indent=2)


def _checked_special_ids(ids: dict[str, int] | None, vocab_size: int) -> dict[str, int]:
    ids = dict(ids or {})
    for k, v in ids.items():
        if k not in SPECIAL_IDS or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise ValueError(f"special_ids[{k!r}]={v!r}: keys are {SPECIAL_IDS}, values "
                             f"token ids in [0, vocab_size={vocab_size})")
    return ids


def _finite_in(x: np.ndarray, name: str, dtype: str) -> np.ndarray:
    """`x` unchanged when every value is finite and stays finite in `dtype`; otherwise a
    ValueError naming the tensor (a NaN or an overflow to inf would be written silently:
    float32 values above bfloat16's largest finite, ~3.39e38, round to inf)."""
    bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
    if bad:
        raise ValueError(f"tensor {name!r} holds {bad} non-finite values (NaN or inf); "
                         "refusing to write it: export an earlier checkpoint (--step)")
    if dtype != "float32":
        over = int(np.size(x) - np.count_nonzero(np.isfinite(x.astype(_WRITE_DTYPES[dtype]))))
        if over:
            raise ValueError(f"tensor {name!r}: {over} values (largest magnitude "
                             f"{float(np.max(np.abs(x))):.4g}) overflow {dtype} to inf; "
                             "export it as float32")
    return x


def _nbytes(spec) -> int:
    return int(np.prod(spec[1], dtype=np.int64)) * np.dtype(spec[2]).itemsize


def _shard_groups(specs, max_shard_bytes):
    if max_shard_bytes is None:
        return [specs]
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"save_pretrained: max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    groups, size = [[]], 0
    for spec in specs:
        nbytes = _nbytes(spec)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    return groups
