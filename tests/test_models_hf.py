"""Parity with transformers' PyTorch models on tiny random checkpoints made in the test.

torch is a test dependency: imported at module top so these tests fail (not skip)
without it.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from _hf_parity import PARITY_TOL
from _hf_parity import hf_logits as _hf_logits
from _hf_parity import logits as _logits
from _hf_parity import max_diff as _max_diff
from rljax.models import Decoder, ModelConfig, from_pretrained, save_pretrained

SHARD_TOL = 1e-5  # sharded vs single-device load

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2)


def _hf_model(cls, seed=0, **kw):
    """A random transformers model whose every parameter (norms, biases too) is random."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**SMALL, **kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def _ids(t=9, b=2, seed=0):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], (b, t))


CASES = {
    "qwen2": (transformers.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2_tied_mha": (transformers.Qwen2Config,
                       dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config,
              dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "qwen3_tied": (transformers.Qwen3Config,
                   dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                        tie_word_embeddings=True)),
    "llama": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_tied_mqa": (transformers.LlamaConfig,
                       dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_transformers(case, tmp_path):
    cls, kw = CASES[case]
    hf = _hf_model(cls, rope_theta=300.0, **kw)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.config.tie_word_embeddings == kw.get("tie_word_embeddings", False)
    ids = _ids()
    assert _max_diff(_logits(model, jnp.asarray(ids, jnp.int32)), _hf_logits(hf, ids)) <= PARITY_TOL


def test_llama3_rope_scaling_beyond_original_context_v4_config(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    hf = _hf_model(transformers.LlamaConfig, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, max_position_embeddings=64,
                   rope_parameters={"rope_theta": 50.0, **scaling})
    hf.save_pretrained(tmp_path)
    # Rewrite config.json in the v4 format (top-level rope_theta / rope_scaling / torch_dtype).
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("dtype", None)
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = "float32"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(tmp_path)
    assert model.config.rope_scaling is not None and model.config.rope_theta == 50.0
    ids = _ids(t=40, b=1)  # 40 positions >> original_max_position_embeddings = 8
    assert _max_diff(_logits(model, jnp.asarray(ids, jnp.int32)), _hf_logits(hf, ids)) <= PARITY_TOL


def test_rljax_to_transformers_round_trip(tmp_path):
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, qkv_bias=True, architecture="qwen2",
                      rope_theta=700.0)
    model = Decoder(cfg, rngs=nnx.Rngs(5))
    for layer in model.layers:  # make biases and norms non-trivial
        layer.attn.q_bias[...] = 0.1 * jnp.ones_like(layer.attn.q_bias[...])
        layer.attn_norm.scale[...] = 1.5 * layer.attn_norm.scale[...]
    save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=20_000)  # sharded files
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").float().eval()
    ids = _ids(seed=3)
    ours = _logits(model, jnp.asarray(ids, jnp.int32))
    assert _max_diff(ours, _hf_logits(hf, ids)) <= PARITY_TOL
    back = from_pretrained(tmp_path / "ckpt")  # and our own sharded-file load
    assert _max_diff(_logits(back, jnp.asarray(ids, jnp.int32)), ours) == 0.0
    # Saving again over an existing folder replaces the files atomically, single file now.
    save_pretrained(back, tmp_path / "ckpt")
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["config.json", "model.safetensors"]


def test_transformers_to_rljax_to_transformers(tmp_path):
    hf = _hf_model(transformers.Qwen3Config, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8)
    hf.save_pretrained(tmp_path / "a")
    save_pretrained(from_pretrained(tmp_path / "a"), tmp_path / "b")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").float().eval()
    ids = _ids(seed=4)
    assert _max_diff(_hf_logits(again, ids), _hf_logits(hf, ids)) == 0.0


@pytest.mark.parametrize("mesh_sizes", [(1, 2, 4), (2, 4, 1), (1, 4, 2)])
def test_sharded_load_matches_single_device(mesh_sizes, tmp_path_factory):
    from rljax.sharding import MeshConfig, make_mesh
    path = tmp_path_factory.mktemp("sharded")
    hf = _hf_model(transformers.Qwen2Config, num_attention_heads=8, num_key_value_heads=4,
                   seed=2)
    hf.save_pretrained(path)
    ids = jnp.asarray(_ids(b=4, seed=5), jnp.int32)
    single = _logits(from_pretrained(path), ids)
    mesh = make_mesh(MeshConfig(*mesh_sizes))
    with jax.set_mesh(mesh):
        model = from_pretrained(path, mesh=mesh)
        q = model.layers[0].attn.q[...]
        assert q.sharding.mesh == mesh and len(q.sharding.device_set) == 8
        assert q.sharding.spec[0] == ("fsdp" if mesh_sizes[1] > 1 else None)
        out = _logits(model, ids)
    assert _max_diff(out, single) <= SHARD_TOL
