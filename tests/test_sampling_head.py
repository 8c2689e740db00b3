"""The sampler's vocab-major output weight: its values, fresh after an update."""

import dataclasses
import importlib

import jax
import numpy as np
from flax import nnx

from rljax.models import Decoder, ModelConfig
from rljax.sampling import generate, state_vocab_major_weight, vocab_major_weight
from rljax.sampling import sampler as sampler_mod

# the module (the package's ``generate`` attribute is the function)
generate_mod = importlib.import_module("rljax.sampling.generate")

CFG = ModelConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
    num_kv_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
)
PROMPTS = [[5, 9, 2], [11, 4]]


def test_weight_is_the_transposed_lm_head_or_the_embedding():
    untied = Decoder(CFG, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(vocab_major_weight(untied), np.asarray(untied.lm_head[...]).T)
    tied = Decoder(dataclasses.replace(CFG, tie_word_embeddings=True), rngs=nnx.Rngs(0))
    _, state = nnx.split(tied)
    # a float32 embedding is already [V, D]: returned as it is, no copy
    assert state_vocab_major_weight(state, tied.config) is state["embed"][...]


def test_state_weight_follows_the_state():
    """Built from the state it is given (no weight kept between calls): after an update
    the new weights' transpose."""
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    _, state = nnx.split(model)
    first = state_vocab_major_weight(state, CFG)
    np.testing.assert_array_equal(first, vocab_major_weight(model))
    model.lm_head[...] = model.lm_head[...] * 2.0  # a new array, as after a training step
    _, state2 = nnx.split(model)
    np.testing.assert_array_equal(state_vocab_major_weight(state2, CFG), np.asarray(first) * 2.0)


def test_generate_sees_updated_weights_and_matches_the_uncached_path(monkeypatch):
    model = Decoder(CFG, rngs=nnx.Rngs(2))
    kw = dict(key=jax.random.key(0), max_new_tokens=6)
    before = generate(model, PROMPTS, **kw)
    model.lm_head[...] = -model.lm_head[...]  # flips every logit: different draws
    after = generate(model, PROMPTS, **kw)
    # without the config, run() builds the weight inside its programs (no cache)
    monkeypatch.setattr(generate_mod, "run", lambda *a: sampler_mod.run(*a[:6]))
    ref = generate(model, PROMPTS, **kw)
    np.testing.assert_array_equal(after.tokens, ref.tokens)
    np.testing.assert_allclose(after.logprobs, ref.logprobs, atol=1e-6)
    assert not np.array_equal(before.logprobs, after.logprobs)
