"""`export_hf` writes a folder transformers' `generate` uses as is: eos / pad ids in
config.json and generation_config.json, the chat template, a umask-following mode."""

import json
import os
import stat

import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, ModelConfig
from rljax.models.hf_io import save_pretrained
from rljax.models.tokenizer import build_char_tokenizer
from rljax.run.artifacts import export_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _eos_first_model(tok) -> Decoder:
    """A tiny Qwen2 whose greedy next token is always EOS: every layer's output projections
    are zero (the residual stream is the token's embedding), every embedding has +1 in
    dimension 0, the final norm keeps only that dimension and the head's EOS row reads it."""
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, max_position_embeddings=64,
                      architecture="qwen2", qkv_bias=True, tie_word_embeddings=False)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, var in flat.items():
        name = "/".join(map(str, path))
        x = np.asarray(var.get_value())
        if name.endswith(("attn/o", "mlp/down")):
            x = np.zeros_like(x)
        elif name == "embed":
            x = x.copy()
            x[:, 0] = 1.0
        elif name == "final_norm/scale":
            x = np.zeros_like(x)
            x[0] = 1.0
        elif name == "lm_head":
            x = np.zeros_like(x)
            x[0, tok.eos_token_id] = 10.0  # [D, V]
        var.set_value(x)
    return model


def test_transformers_generate_stops_at_eos_on_the_export(tmp_path):
    tok = build_char_tokenizer()
    src = tmp_path / "src"
    save_pretrained(_eos_first_model(tok), src)
    tok.save_pretrained(str(src))
    old = os.umask(0o027)
    try:
        out = export_hf(src, tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o750  # not mkdtemp's 0700
    config = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    for d in (config, gen):
        assert d["eos_token_id"] == tok.eos_token_id and d["pad_token_id"] == tok.pad_token_id
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.chat_template == tok.chat_template is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([tok.encode("12+3=", add_special_tokens=False)])
    with torch.no_grad():
        gen_ids = model.generate(ids, max_new_tokens=8, do_sample=False)
    new = gen_ids[0, ids.shape[1]:].tolist()
    assert new == [tok.eos_token_id]  # stopped at EOS, not 8 tokens
    model.generation_config.eos_token_id = None  # what the export used to give
    with torch.no_grad():
        assert model.generate(ids, max_new_tokens=8, do_sample=False).shape[1] == ids.shape[1] + 8
