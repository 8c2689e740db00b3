"""Bad checkpoints get clear errors naming the field / tensor / file."""

import json

import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, ModelConfig, config_from_hf, from_pretrained, save_pretrained
from rljax.models.safetensors_io import SafetensorsFile, write_safetensors

CFG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1,
                  num_heads=2, num_kv_heads=1, architecture="llama")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    save_pretrained(Decoder(CFG, rngs=nnx.Rngs(0)), path)
    return path


def _copy_with_config(src, dst, **changes):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


@pytest.mark.parametrize("changes, match", [
    (dict(model_type="gpt2"), "model_type='gpt2'"),
    (dict(num_local_experts=8), "num_local_experts=8"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     "rope_parameters.rope_type='yarn'"),
    (dict(layer_types=["sliding_attention"]), "layer_types='sliding_attention'"),
])
def test_unsupported_architectures_name_the_field(ckpt, tmp_path, changes, match):
    bad = _copy_with_config(ckpt, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=match):
        from_pretrained(bad)


def test_v4_rope_scaling_type_and_missing_fields():
    base = {"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = config_from_hf({**base, "rope_theta": 5.0, "rope_scaling": None})
    assert cfg.rope_theta == 5.0 and cfg.head_dim == 4 and cfg.num_kv_heads == 2
    assert cfg.qkv_bias and cfg.architecture == "qwen2"
    with pytest.raises(ValueError, match="rope_scaling.rope_type='linear'"):
        config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="lacks 'low_freq_factor'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 2.0}})
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        config_from_hf({k: v for k, v in base.items() if k != "hidden_size"})


def test_shape_mismatch_names_tensor_and_config(ckpt, tmp_path):
    bad = _copy_with_config(ckpt, tmp_path / "bad", intermediate_size=32)
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight.*shape \(24, 16\).*\(32, 16\)"):
        from_pretrained(bad)


def test_missing_files_and_tensors(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(tmp_path / "empty")
    # an index pointing at a missing shard
    (tmp_path / "empty" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        from_pretrained(tmp_path / "empty")
    # a weights file lacking a tensor
    f = SafetensorsFile(ckpt / "model.safetensors")
    keep = [n for n in f.names() if n != "model.norm.weight"]
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((ckpt / "config.json").read_text())
    write_safetensors(tmp_path / "partial" / "model.safetensors",
                      [(n, f.shape(n), np.float32, lambda n=n: f.get(n)) for n in keep])
    with pytest.raises(ValueError, match=r"lacks tensors \['model.norm.weight'\]"):
        from_pretrained(tmp_path / "partial")


def test_truncated_weights_and_bad_dtype(ckpt, tmp_path):
    bad = _copy_with_config(ckpt, tmp_path / "bad")
    data = (ckpt / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="corrupt entry"):
        from_pretrained(bad)
    with pytest.raises(ValueError, match="dtype"):
        from_pretrained(ckpt, dtype="float16")


def test_failed_save_leaves_destination_untouched(ckpt, tmp_path):
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    model.layers[0].mlp.up = nnx.Param(np.zeros((3, 3), np.float32))  # wrong shape
    dst = tmp_path / "dst"
    with pytest.raises(ValueError):
        save_pretrained(model, dst)
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="must be a Decoder"):
        save_pretrained(object(), dst)


def test_bfloat16_weights_load_as_float32(ckpt, tmp_path):
    import ml_dtypes

    f = SafetensorsFile(ckpt / "model.safetensors")
    (tmp_path / "bf16").mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(cfg))
    write_safetensors(tmp_path / "bf16" / "model.safetensors",
                      [(n, f.shape(n), ml_dtypes.bfloat16, lambda n=n: f.get(n)) for n in f.names()])
    model = from_pretrained(tmp_path / "bf16")
    w = np.asarray(model.embed[...])
    assert w.dtype == np.float32
    ref = f.get("model.embed_tokens.weight")
    np.testing.assert_allclose(w, ref, rtol=1e-2)
    assert np.array_equal(w, ref.astype(ml_dtypes.bfloat16).astype(np.float32))
