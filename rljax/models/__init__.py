"""rljax.models: the Flax NNX decoder (Llama / Qwen2 / Qwen3), KV cache, value head,
Hugging Face checkpoint import/export and tokenizer helpers.

Functional use: `graphdef, state = nnx.split(model)`; `nnx.merge(graphdef, state)`
inside jitted functions. Shardings of a state: `rljax.sharding.state_shardings`.
"""

from rljax.models.attention import Attention, attend
from rljax.models.config import ARCHITECTURES, Llama3RopeScaling, ModelConfig
from rljax.models.decoder import Block, Decoder, default_positions
from rljax.models.kv_cache import KVCache, grow_kv_cache, init_kv_cache, kv_cache_shardings
from rljax.models.hf_config import config_from_hf, config_to_hf
from rljax.models.hf_io import from_pretrained, save_pretrained, weight_map
from rljax.models.layers import MLP, RMSNorm, annotated_param, rope_inv_freq
from rljax.models.value import ValueModel

__all__ = [
    "ARCHITECTURES",
    "Attention",
    "Block",
    "Decoder",
    "KVCache",
    "Llama3RopeScaling",
    "MLP",
    "ModelConfig",
    "RMSNorm",
    "ValueModel",
    "annotated_param",
    "attend",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "save_pretrained",
    "weight_map",
    "default_positions",
    "grow_kv_cache",
    "init_kv_cache",
    "kv_cache_shardings",
    "rope_inv_freq",
]

_TOKENIZER_NAMES = ("add_stop_ids", "apply_chat_template", "build_char_tokenizer",
                    "check_same_tokenizer", "check_vocab", "encode_prompts",
                    "generation_eos_ids", "load_tokenizer", "stop_token_ids")
__all__ += list(_TOKENIZER_NAMES)


def __getattr__(name):
    # Tokenizer helpers import transformers; load them only when asked for.
    if name in _TOKENIZER_NAMES:
        from rljax.models import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module 'rljax.models' has no attribute {name!r}")
