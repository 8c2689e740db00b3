"""Shared-prompt forwards (`Decoder.grouped_hidden_states`, `rljax.models.grouped`): each
group's prompt computed once gives the full forward's hidden states and gradients."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, ModelConfig

TINY = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, rope_theta=500.0)
N, G, P, T = 2, 3, 7, 6


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, TINY.vocab_size, (N, P))
    pmask = np.ones((N, P), bool)
    pmask[0, :3] = False  # left padding
    comp = rng.integers(1, TINY.vocab_size, (N * G, T))
    cmask = np.ones((N * G, T), bool)
    cmask[1, 2:] = False  # stopped early; right padding
    cmask[4, 5:] = False
    return (jnp.asarray(prompt, jnp.int32), jnp.asarray(pmask), jnp.asarray(comp, jnp.int32),
            jnp.asarray(cmask))


def _full(model, prompt, pmask, comp, cmask):
    """The reference: one full forward of every concatenated row."""
    ids = jnp.concatenate([jnp.repeat(prompt, G, axis=0), comp], axis=1)
    mask = jnp.concatenate([jnp.repeat(pmask, G, axis=0), cmask], axis=1)
    h = model.hidden_states(ids, mask_BxT=mask)
    return h[::G, :P], h[:, P:]


def _grouped(model, prompt, pmask, comp, cmask):
    return model.grouped_hidden_states(prompt, pmask, comp, cmask)


def _loss(fn, cmask):
    """A scalar of both outputs on real slots: its gradient reaches every parameter."""
    def f(model, *args):
        hp, hc = fn(model, *args)
        w = jnp.cos(jnp.arange(hc.shape[-1]))
        return jnp.sum(hp[:, -1] * w) + jnp.sum(jnp.where(cmask[..., None], hc * w, 0.0))
    return f


@pytest.mark.parametrize("impl", ["xla", "splash"])
@pytest.mark.parametrize("scan", [False, True])
def test_grouped_forward_and_gradients_equal_the_full_forward(impl, scan):
    cfg = dataclasses.replace(TINY, attention=impl, scan_layers=scan)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    prompt, pmask, comp, cmask = _batch()
    (hp_f, hc_f), (hp_g, hc_g) = (nnx.jit(fn)(model, prompt, pmask, comp, cmask)
                                  for fn in (_full, _grouped))
    pm, cm = np.asarray(pmask), np.asarray(cmask)
    np.testing.assert_allclose(np.asarray(hp_g)[pm], np.asarray(hp_f)[pm], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(hc_g)[cm], np.asarray(hc_f)[cm], rtol=2e-5, atol=2e-5)
    if impl == "xla":  # the same mask on padding rows too: equal everywhere
        np.testing.assert_allclose(np.asarray(hc_g), np.asarray(hc_f), rtol=2e-5, atol=2e-5)
    grads = [nnx.jit(nnx.grad(_loss(fn, cmask)))(model, prompt, pmask, comp, cmask)
             for fn in (_full, _grouped)]
    flat_f, flat_g = (jax.tree.leaves(nnx.state(g)) for g in grads)
    assert len(flat_f) == len(flat_g) > 10
    for a, b in zip(flat_f, flat_g):
        scale = float(np.abs(np.asarray(a)).max()) + 1e-6
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=3e-5 * scale, rtol=0)


def test_grouped_forward_checks_its_shapes_and_attention():
    model = Decoder(TINY, rngs=nnx.Rngs(0))
    prompt, pmask, comp, cmask = _batch()
    with pytest.raises(ValueError, match="multiple of N"):
        model.grouped_hidden_states(prompt, pmask, comp[:5], cmask[:5])
    with pytest.raises(ValueError, match="do not match ids"):
        model.grouped_hidden_states(prompt, pmask[:, :3], comp, cmask)
    cudnn = Decoder(dataclasses.replace(TINY, attention="cudnn", compute_dtype="bfloat16"),
                    rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="allowed: 'xla', 'splash'"):
        cudnn.grouped_hidden_states(prompt, pmask, comp, cmask)
