"""Hugging Face `config.json` <-> `ModelConfig`, for both the v4 and v5 formats.

v4 (most published Qwen2.5 / Llama 3 checkpoints): top-level `rope_theta`, `rope_scaling`,
`torch_dtype`. v5 (what transformers 5 writes): `rope_parameters`, `dtype`. Anything this
decoder cannot reproduce exactly is refused with the config field and value named.
"""

from __future__ import annotations

from rljax.models.config import Llama3RopeScaling, ModelConfig, MoeConfig

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM"}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# Qwen2-MoE's shared expert, DeepSeek's shared / grouped routing: not in the decoder yet
# (docs/moe.md says what each would need).
_UNSUPPORTED_MOE_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "topk_group")


def _unsupported(field, value, allowed):
    return ValueError(
        f"config.json: unsupported {field}={value!r}; rljax supports {allowed}"
    )


def _require(cfg: dict, field: str):
    if field not in cfg:
        raise ValueError(f"config.json: missing required field {field!r}")
    return cfg[field]


def _check_supported(cfg: dict, model_type: str):
    for field in _MOE_FIELDS if model_type != "qwen3_moe" else _UNSUPPORTED_MOE_FIELDS:
        if cfg.get(field):
            raise _unsupported(field, cfg[field], "mixtures of experts of model_type "
                               "'qwen3_moe' only (no shared experts)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", cfg["hidden_act"], "'silu' (SwiGLU)")
    if cfg.get("use_sliding_window"):
        raise _unsupported("use_sliding_window", cfg["use_sliding_window"], "False")
    for kind in cfg.get("layer_types") or ():
        if kind != "full_attention":
            raise _unsupported("layer_types", kind, "'full_attention' in every layer")
    if model_type in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        raise _unsupported("attention_bias", True, f"False for model_type {model_type!r}")
    if cfg.get("mlp_bias"):
        raise _unsupported("mlp_bias", True, "False")


def _rope(cfg: dict) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from v5 `rope_parameters` or v4 `rope_theta` / `rope_scaling`."""
    params = cfg.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        field = "rope_scaling"
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise _unsupported(field, params, "one dict with rope_theta (not per-layer-type)")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params["rope_theta"])
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _unsupported(f"{field}.rope_type", kind, "'default' or 'llama3'")
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"config.json: {field} of rope_type 'llama3' lacks {e.args[0]!r}") from e
    return theta, scaling


def config_from_hf(cfg: dict, compute_dtype: str = "float32",
                   attention: str = "xla") -> ModelConfig:
    """A `ModelConfig` from a parsed HF config.json dict (v4 or v5 format).

    compute_dtype and attention are implementation choices (see `ModelConfig`), not part
    of config.json: `config_to_hf` writes neither.
    """
    if not isinstance(cfg, dict):
        raise TypeError(f"config_from_hf: expected a dict, got {type(cfg).__name__}")
    model_type = _require(cfg, "model_type")
    if model_type not in HF_CLASSES:
        raise _unsupported("model_type", model_type, sorted(HF_CLASSES))
    _check_supported(cfg, model_type)
    theta, scaling = _rope(cfg)
    heads = int(_require(cfg, "num_attention_heads"))
    moe = _moe_from_hf(cfg) if model_type == "qwen3_moe" else None
    return ModelConfig(
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=int(_require(cfg, "hidden_size")),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=cfg.get("head_dim"),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        compute_dtype=compute_dtype,
        architecture=model_type,
        attention=attention,
        moe=moe,
    )


def _moe_from_hf(cfg: dict) -> MoeConfig:
    """The `MoeConfig` of a qwen3_moe config.json (transformers 5 writes the expert count
    as num_local_experts, 4.x as num_experts)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ValueError("config.json: qwen3_moe lacks num_experts (or num_local_experts)")
    return MoeConfig(num_experts=int(experts),
                     experts_per_token=int(_require(cfg, "num_experts_per_tok")),
                     intermediate_size=int(_require(cfg, "moe_intermediate_size")),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                     mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))


def _moe_to_hf(moe: MoeConfig) -> dict:
    return {"num_experts": moe.num_experts, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.intermediate_size,
            "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": moe.sparse_step,
            "mlp_only_layers": list(moe.mlp_only_layers),
            "router_aux_loss_coef": moe.aux_loss_coef}


def config_to_hf(config: ModelConfig) -> dict:
    """An HF config.json dict (v5 format, float32 weights) for `config`."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        sc = config.rope_scaling
        rope.update(rope_type="llama3", factor=sc.factor, low_freq_factor=sc.low_freq_factor,
                    high_freq_factor=sc.high_freq_factor,
                    original_max_position_embeddings=sc.original_max_position_embeddings)
    out = {
        "architectures": [HF_CLASSES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": rope,
        "dtype": "float32",
    }
    if config.architecture in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if config.moe is not None:
        out.update(_moe_to_hf(config.moe))
    if config.architecture == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    return out
