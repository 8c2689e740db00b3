"""Model configuration: one frozen, validated dataclass for the Llama / Qwen2 / Qwen3 family."""

from __future__ import annotations

import dataclasses

from rljax.models.lora import LoraConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")
COMPUTE_DTYPES = ("float32", "bfloat16")
# "xla": the einsum in `rljax.models.attention.attend` (the CPU default); "splash": JAX's
# Pallas TPU splash attention; "cudnn": cuDNN flash attention through
# `jax.nn.dot_product_attention` (GPU, bfloat16). See rljax/models/attention_kernels.py.
ATTENTION_IMPLS = ("xla", "splash", "cudnn")
# What a layer keeps for the backward pass; see rljax/models/scanned.py.
REMAT_POLICIES = ("none", "full", "dots_saveable")
# How a mixture-of-experts layer computes its experts (rljax/models/moe.py): "ragged"
# (`jax.lax.ragged_dot`, grouped matmuls: TPU / GPU), "tiled" (tokens sorted by expert and
# padded to tiles, one batched matmul: XLA:CPU, where ragged_dot is slow), "auto" (ragged
# on TPU / GPU, tiled on CPU, chosen when the program is traced).
MOE_IMPLS = ("auto", "ragged", "tiled")
# Router replay: "off" (every forward routes by its own router logits) or "replay" (a
# forward given recorded expert ids routes by them; rljax/models/moe.py).
ROUTER_REPLAY = ("off", "replay")


def _check_positive(obj, names):
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{type(obj).__name__}.{name} must be a positive int, got {value!r}"
            )


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3 rope scaling (HF `rope_type: "llama3"`).

    Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
    divided by `factor`; shorter than `... / high_freq_factor` are kept; in between the
    inverse frequency is interpolated linearly in `original / wavelength`.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"Llama3RopeScaling.factor must be > 0, got {self.factor!r}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "Llama3RopeScaling needs high_freq_factor > low_freq_factor > 0, got "
                f"low_freq_factor={self.low_freq_factor!r}, "
                f"high_freq_factor={self.high_freq_factor!r}"
            )
        _check_positive(self, ("original_max_position_embeddings",))


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts feed-forward layers (Qwen3-MoE; HF names in brackets).

    num_experts [num_experts]: routed experts per MoE layer.
    experts_per_token [num_experts_per_tok]: top-k experts each token goes to.
    intermediate_size [moe_intermediate_size]: each expert's SwiGLU width.
    norm_topk_prob [norm_topk_prob]: renormalise the k gate weights to sum to 1.
    sparse_step [decoder_sparse_step], mlp_only_layers [mlp_only_layers]: layer i is an
      MoE layer when i is not in mlp_only_layers and (i + 1) % sparse_step == 0; the other
      layers keep the dense MLP of `ModelConfig.intermediate_size`.
    impl: `MOE_IMPLS` (how experts are computed; never written to config.json).
    aux_loss_coef: weight of the Switch load-balance loss in a training loss (0: off, the
      RL default, as in verl / slime; HF's router_aux_loss_coef is not imported).
    z_loss_coef: weight of the router z-loss (ST-MoE) in a training loss (0: off).
    router_replay: `ROUTER_REPLAY`: "replay" makes the learner's forwards route by the
      expert ids the sampler recorded.
    """

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool = True
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    impl: str = "auto"
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    router_replay: str = "off"

    def __post_init__(self):
        _check_positive(self, ("num_experts", "experts_per_token", "intermediate_size",
                               "sparse_step"))
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"MoeConfig.experts_per_token={self.experts_per_token} exceeds "
                             f"num_experts={self.num_experts}")
        if self.num_experts > 32767:
            raise ValueError(f"MoeConfig.num_experts={self.num_experts}; allowed: <= 32767 "
                             "(expert ids are recorded as int16)")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if not all(isinstance(i, int) and i >= 0 for i in self.mlp_only_layers):
            raise ValueError(f"MoeConfig.mlp_only_layers={self.mlp_only_layers!r}; allowed: "
                             "layer indices >= 0")
        for name, allowed in (("impl", MOE_IMPLS), ("router_replay", ROUTER_REPLAY)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MoeConfig.{name}={getattr(self, name)!r}; allowed: {allowed}")
        for name in ("aux_loss_coef", "z_loss_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"MoeConfig.{name}={v!r}; allowed: a number >= 0")
        if not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"MoeConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` routes to experts (HF's rule)."""
        return i not in self.mlp_only_layers and (i + 1) % self.sparse_step == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (names follow the HF config fields they come from).

    head_dim: per-head width; None means hidden_size // num_heads (Llama / Qwen2 default;
      Qwen3 sets it explicitly).
    qkv_bias: Qwen2's biases on the q/k/v projections.
    qk_norm: Qwen3's per-head RMSNorm on queries and keys (before rotary embeddings).
    compute_dtype: dtype of matmul inputs in the forward ("float32" | "bfloat16");
      parameters are always float32, norms, softmax and logits are computed in float32.
    attention: how full (causal) forwards and prefill compute attention: "xla" (einsum,
      the default), "splash" (Pallas TPU kernel; Pallas interpret mode off TPU) or
      "cudnn" (GPU only, needs compute_dtype "bfloat16"). Decode steps against a KV cache
      always use "xla". An implementation choice: never written to HF config.json.
    scan_layers: stack the layers' parameters on a leading layer axis `[L, ...]` and run
      them with `nnx.scan` (compile time flat in depth); checkpoints of the two layouts
      differ, HF files do not. Not written to config.json.
    remat: what each layer keeps for the backward pass: "none", "full" (its input
      only) or "dots_saveable" (matmul outputs too); scanned and unscanned alike.
    lora: low-rank adapters on the projections (`rljax.models.lora.LoraConfig`), or None;
      a rank-0 config is stored as None (the model without adapters). Not written to
      config.json (an exported adapter folder has its own adapter_config.json).
      An MoE model takes adapters on attention only; experts and routers stay frozen.
    moe: `MoeConfig` for mixture-of-experts layers (architecture "qwen3_moe"), or None.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    compute_dtype: str = "float32"
    architecture: str = "llama"
    attention: str = "xla"
    scan_layers: bool = False
    remat: str = "none"
    lora: LoraConfig | None = None
    moe: MoeConfig | None = None

    def __post_init__(self):
        _check_positive(
            self,
            ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
             "num_kv_heads", "max_position_embeddings"),
        )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"ModelConfig: hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive(self, ("head_dim",))
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (rotary), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise TypeError(
                "ModelConfig.rope_scaling must be None or Llama3RopeScaling, got "
                f"{type(self.rope_scaling).__name__}"
            )
        for name, allowed in (("compute_dtype", COMPUTE_DTYPES), ("architecture", ARCHITECTURES),
                              ("attention", ATTENTION_IMPLS), ("remat", REMAT_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; allowed: {allowed}")
        if self.attention == "cudnn" and self.compute_dtype != "bfloat16":
            raise ValueError(
                "ModelConfig.attention='cudnn' needs compute_dtype='bfloat16' (cuDNN flash "
                f"attention takes float16 / bfloat16 inputs), got {self.compute_dtype!r}"
            )
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise TypeError(f"ModelConfig.lora must be None or a LoraConfig, got {self.lora!r}")
        if self.lora is not None and not self.lora.enabled:
            object.__setattr__(self, "lora", None)  # rank 0: the model without adapters
        self._check_moe()
        for name in ("tie_word_embeddings", "qkv_bias", "qk_norm", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def _check_moe(self):
        if self.moe is not None and not isinstance(self.moe, MoeConfig):
            raise TypeError(f"ModelConfig.moe must be None or a MoeConfig, got {self.moe!r}")
        if (self.moe is not None) != (self.architecture == "qwen3_moe"):
            raise ValueError(f"ModelConfig: architecture={self.architecture!r} with "
                             f"moe={self.moe!r}; a MoeConfig goes with 'qwen3_moe' only")
        mlp_targets = set(self.lora.targets) & {"gate", "up", "down"} if self.lora else set()
        if self.moe is not None and mlp_targets:
            raise ValueError(f"ModelConfig.lora.targets={self.lora.targets!r} on an MoE model: "
                             "experts and routers stay frozen; allowed: attention projections "
                             "('q', 'k', 'v', 'o')")
        if self.moe is not None and self.scan_layers and len(set(self.moe_layers)) != 1:
            raise ValueError("ModelConfig.scan_layers=True needs every layer alike, but moe "
                             f"makes layers {self.moe_layers} MoE (True) or dense; set "
                             "scan_layers=False, or sparse_step=1 and no mlp_only_layers")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it is an MoE layer (all False for a dense model)."""
        return tuple(self.moe is not None and self.moe.is_moe_layer(i)
                     for i in range(self.num_layers))
