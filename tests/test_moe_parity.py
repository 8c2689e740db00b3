"""Qwen3-MoE parity with transformers' PyTorch `Qwen3MoeForCausalLM` on tiny random
configs built offline, import and export in both expert layouts (per-expert keys on disk,
transformers 5's fused in-memory tensors)."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import save_file

from _hf_parity import PARITY_TOL
from _hf_parity import hf_logits as _hf_logits
from _hf_parity import logits as _logits
from _hf_parity import max_diff as _diff
from rljax.models import Decoder, from_pretrained, save_pretrained


BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=300.0)
# (seed, config overrides, [(scan_layers, impl)]): top-2 of 4 with and without
# renormalised gates, dense layers among MoE layers (decoder_sparse_step, mlp_only_layers;
# unscanned only: a scan needs every layer alike), top-3 of 6 with tied embeddings.
CASES = [
    (0, dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
     [(False, "tiled"), (True, "ragged")]),
    (1, dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
             decoder_sparse_step=2, mlp_only_layers=[3]), [(False, "tiled")]),
    (2, dict(num_hidden_layers=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
             tie_word_embeddings=True), [(False, "ragged"), (True, "tiled")]),
]


def _hf_model(seed, **kw):
    """A random transformers Qwen3-MoE whose every parameter (norms, router too) is random."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**{**BASE, **kw})
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05  # spread router logits
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
    return model


def _ids(seed, t=11, b=3):
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], (b, t))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parity_per_expert_checkpoint(case, tmp_path):
    seed, kw, forms = CASES[case]
    hf = _hf_model(seed, **kw)
    hf.save_pretrained(tmp_path)  # per-expert keys on disk
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"
    ids = _ids(seed)
    want = _hf_logits(hf, ids)
    for scan, impl in forms:
        model = _with_impl(from_pretrained(tmp_path, scan_layers=scan), impl)
        got = _logits(model, jnp.asarray(ids, jnp.int32))
        assert _diff(got, want) <= PARITY_TOL, (scan, impl)


def _with_impl(model, impl):
    """`model` with its MoE layers computed by `impl` (the same parameters)."""
    c = model.config
    cfg = dataclasses.replace(c, moe=dataclasses.replace(c.moe, impl=impl))
    graphdef, state = nnx.split(model)
    new_graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(new_graphdef, state)


def test_fused_in_memory_layout_imports(tmp_path):
    """A checkpoint holding transformers 5's fused in-memory experts tensors loads."""
    seed, kw, _ = CASES[1]
    hf = _hf_model(seed, **kw)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    hf.config.save_pretrained(tmp_path)
    save_file(sd, str(tmp_path / "model.safetensors"))
    model = from_pretrained(tmp_path)
    ids = _ids(seed)
    assert _diff(_logits(model, jnp.asarray(ids, jnp.int32)), _hf_logits(hf, ids)) <= PARITY_TOL


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_export_loads_in_transformers(layout, tmp_path):
    seed, kw, _ = CASES[0]
    hf = _hf_model(seed, **kw)
    hf.save_pretrained(tmp_path / "src")
    model = from_pretrained(tmp_path / "src", scan_layers=True)
    save_pretrained(model, tmp_path / "out", expert_layout=layout, max_shard_bytes=40_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = _ids(seed + 7)
    assert _diff(_hf_logits(back, ids), _hf_logits(hf, ids)) <= PARITY_TOL
    ours = from_pretrained(tmp_path / "out")
    assert _diff(_logits(ours, jnp.asarray(ids, jnp.int32)),
                 _logits(model, jnp.asarray(ids, jnp.int32))) == 0.0
