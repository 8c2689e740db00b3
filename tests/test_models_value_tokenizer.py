"""Value head on the decoder backbone, and the tokenizer helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from rljax.models import Decoder, ModelConfig, ValueModel, save_pretrained
from rljax.models.tokenizer import (
    apply_chat_template,
    build_char_tokenizer,
    check_vocab,
    encode_prompts,
    load_tokenizer,
)

CFG = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2)


@nnx.jit
def _values(model, ids, mask):
    return model(ids, mask_BxT=mask)


def test_value_model_from_policy_copies_backbone(tmp_path):
    policy = Decoder(CFG, rngs=nnx.Rngs(0))
    value = ValueModel.from_policy(policy, rngs=nnx.Rngs(1))
    assert not hasattr(value.backbone, "lm_head")  # no vocab-sized output projection
    ids = jnp.asarray([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]], jnp.int32)
    mask = ids > 0
    v = _values(value, ids, mask)
    assert v.shape == (2, 5) and v.dtype == jnp.float32
    h = nnx.jit(lambda m, i, k: m.hidden_states(i, mask_BxT=k))(policy, ids, mask)
    np.testing.assert_allclose(np.asarray(v), np.asarray(h @ value.head[...]), atol=1e-5)
    # The copy is independent of the policy.
    policy.final_norm.scale[...] = 2 * policy.final_norm.scale[...]
    np.testing.assert_array_equal(np.asarray(_values(value, ids, mask)), np.asarray(v))
    # From an HF checkpoint folder: the same backbone.
    save_pretrained(Decoder(CFG, rngs=nnx.Rngs(0)), tmp_path)
    loaded = ValueModel.from_pretrained(tmp_path, rngs=nnx.Rngs(1))
    np.testing.assert_allclose(np.asarray(_values(loaded, ids, mask)), np.asarray(v), atol=1e-6)


def test_value_model_is_trainable_functionally():
    model = ValueModel(CFG, rngs=nnx.Rngs(2))
    graphdef, state = nnx.split(model)
    ids = jnp.asarray([[3, 4, 5]], jnp.int32)

    def loss(s):
        return jnp.sum(nnx.merge(graphdef, s)(ids) ** 2)

    grads = jax.jit(jax.grad(loss))(state)
    assert float(jnp.abs(grads["head"][...]).sum()) > 0
    assert float(jnp.abs(grads["backbone"]["layers"][0]["mlp"]["up"][...]).sum()) > 0


def test_char_tokenizer_roundtrip_and_autotokenizer(tmp_path):
    tok = build_char_tokenizer(alphabet="abc +=0123456789\n", path=tmp_path)
    again = load_tokenizer(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for t in (tok, again, auto):
        assert len(t) == 4 + 17
        assert (t.pad_token_id, t.bos_token_id, t.eos_token_id) == (0, 1, 2)
        ids = t.encode("ab 12+3", add_special_tokens=False)
        assert ids == [4, 5, 7, 11, 12, 8, 13]
        assert t.decode(ids) == "ab 12+3"
        assert t.encode("z", add_special_tokens=False) == [3]  # unknown -> <unk>
    texts = apply_chat_template(again, [[{"role": "user", "content": "1+2="}]])
    assert texts == ["<bos>user: 1+2=<eos>\n<bos>assistant: "]
    (prompt,) = encode_prompts(again, texts)
    assert prompt[0] == 1 and 2 in prompt and prompt[-1] == again.encode(" ")[0]


def test_encode_prompts_limits_and_check_vocab():
    tok = build_char_tokenizer()
    assert encode_prompts(tok, ["abc", "a"]) == [[4, 5, 6], [4]]
    with pytest.raises(ValueError, match="prompt 0 has 3 tokens"):
        encode_prompts(tok, ["abc"], max_len=2)
    assert encode_prompts(tok, ["abc"], max_len=2, truncate="left") == [[5, 6]]
    with pytest.raises(ValueError, match="truncate"):
        encode_prompts(tok, ["abc"], truncate="right")
    with pytest.raises(TypeError, match="list of str"):
        encode_prompts(tok, "abc")
    check_vocab(tok, CFG)  # 100 tokens, vocab 100: fine
    small = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                        num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="vocab_size is 64"):
        check_vocab(tok, small)
    with pytest.raises(FileNotFoundError):
        load_tokenizer("/nonexistent/tokenizer")
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer(alphabet="aa")
    with pytest.raises(ValueError, match="conversation 0"):
        apply_chat_template(tok, [["hello"]])
