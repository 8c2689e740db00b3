"""Scanned layers (`ModelConfig.scan_layers`): the stacked decoder equals the layer loop.

Both layouts are loaded from one HF folder, so they hold the same weights: logits on a
padded batch, gradients under each remat policy, greedy tokens from the sampler and the
HF round trip in both directions must agree.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models import (Decoder, ModelConfig, from_pretrained, kv_cache_shardings,
                          save_pretrained, weight_map)
from rljax.models.hf_io import state_location
from rljax.sampling import generate
from rljax.sharding import state_shardings
from rljax.sharding import MeshConfig, make_mesh

LOGIT_RTOL = 1e-5  # float32: |scanned - loop| <= LOGIT_RTOL * max |logit| (issue 18)
GRAD_RTOL = 1e-6  # float32 grads, max |diff| / global grad norm; observed 1e-9 (logits: 0)

CFG = ModelConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
    num_kv_heads=2, rope_theta=500.0, qkv_bias=True, architecture="qwen2",
    max_position_embeddings=128,
)
PROMPTS = [[5, 9, 2, 33, 7], [11], [40, 41, 42, 43, 44, 45, 46, 47, 12], [3, 3]]


def _padded_batch():
    """Ids `[3, 8]` with left padding, right padding and a full row."""
    ids = np.random.default_rng(0).integers(1, CFG.vocab_size, (3, 8)).astype(np.int32)
    mask = np.ones((3, 8), bool)
    mask[0, :3] = False  # left padded
    mask[1, 6:] = False  # right padded
    return jnp.asarray(np.where(mask, ids, 0)), jnp.asarray(mask)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An HF folder of a loop decoder whose every parameter (norms, biases too) is random."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [1 + 0.2 * jax.random.normal(k, x.shape) if x.ndim == 1 else
              0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    path = tmp_path_factory.mktemp("hf") / "loop"
    save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def loop(folder):
    return from_pretrained(folder)


@pytest.fixture(scope="module")
def scanned(folder):
    return from_pretrained(folder, scan_layers=True)


def _per_layer_params(model, state=None) -> dict:
    """HF tensor name -> `state`'s (default: the model's params) value of it, in rljax's
    per-layer layout."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param) if state is None else state))
    out = {}
    for name, spath, _, _ in weight_map(model.config):
        path, i = state_location(model.config, spath)
        value = np.asarray(flat[path].get_value())
        out[name] = value if i is None else value[i]
    return out


@nnx.jit
def _logits(model, ids, mask):
    return model(ids, mask_BxT=mask)


def test_stacked_layout_and_sharding(scanned):
    """Layer parameters and the KV cache are `[L, ...]` with "layers" first, which no mesh
    axis splits."""
    flat = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))
    q = flat[("layers", "attn", "q")]
    assert q.get_value().shape == (CFG.num_layers, CFG.hidden_size, CFG.num_heads, CFG.head_dim)
    assert q.get_metadata("logical_axes")[0] == "layers"
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    spec = dict(nnx.to_flat_state(state_shardings(nnx.state(scanned), mesh)))[
        ("layers", "mlp", "gate")].get_value().spec
    assert spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    cache = kv_cache_shardings(scanned.init_cache(4, 16), mesh)
    assert cache.keys.spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"), "tensor",
                                                         None, None)


def test_logits_equal_loop(loop, scanned):
    ids, mask = _padded_batch()
    want, got = np.asarray(_logits(loop, ids, mask)), np.asarray(_logits(scanned, ids, mask))
    assert np.abs(got - want).max() <= LOGIT_RTOL * np.abs(want).max()


def test_hf_round_trip_both_ways(tmp_path, loop, scanned):
    """Loading an unscanned folder stacks it exactly; saving a scanned model unstacks it."""
    ref = _per_layer_params(loop)
    for name, value in _per_layer_params(scanned).items():
        np.testing.assert_array_equal(value, ref[name], err_msg=name)
    save_pretrained(scanned, tmp_path / "from_scanned")
    for name, value in _per_layer_params(from_pretrained(tmp_path / "from_scanned")).items():
        np.testing.assert_array_equal(value, ref[name], err_msg=name)


def _lm_loss(model, ids, mask):
    logits = model(ids, mask_BxT=mask)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    m = mask[:, 1:] & mask[:, :-1]
    return jnp.sum(nll * m) / jnp.sum(m)


@nnx.jit
def _grads(model, ids, mask):
    return nnx.grad(_lm_loss)(model, ids, mask)


@pytest.mark.parametrize("scan,remat", [(True, "none"), (True, "full"),
                                        (True, "dots_saveable"), (False, "dots_saveable")])
def test_grads_equal_loop_without_remat(folder, loop, scan, remat):
    ids, mask = _padded_batch()
    model = from_pretrained(folder, scan_layers=scan, remat=remat)
    jaxpr = str(jax.make_jaxpr(lambda m: nnx.grad(_lm_loss)(m, ids, mask))(model))
    assert ("remat" in jaxpr or "checkpoint" in jaxpr) == (remat != "none")
    want = _per_layer_params(loop, _grads(loop, ids, mask))
    got = _per_layer_params(model, _grads(model, ids, mask))
    norm = np.sqrt(sum(np.sum(np.square(g)) for g in want.values()))
    worst = max(np.abs(got[n] - want[n]).max() for n in want)
    assert worst <= GRAD_RTOL * norm, (worst, norm)


def test_greedy_tokens_equal_loop(loop, scanned):
    kw = dict(key=jax.random.key(0), max_new_tokens=6, temperature=0.0, decode_phases=2)
    want, got = generate(loop, PROMPTS, **kw), generate(scanned, PROMPTS, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_config_errors_and_unstacked_cache(scanned):
    with pytest.raises(ValueError, match=r"remat='partial'.*'dots_saveable'"):
        dataclasses.replace(CFG, remat="partial")
    with pytest.raises(TypeError, match="scan_layers"):
        dataclasses.replace(CFG, scan_layers=1)
    loop_cache = Decoder(CFG, rngs=nnx.Rngs(0)).init_cache(1, 4)
    ids = jnp.ones((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="stacked cache"):
        scanned.forward_cached(ids, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), bool),
                               loop_cache, 0)


def test_experiment_layout_reaches_hf_path_models(folder, scanned):
    """`ExperimentConfig.scan_layers` / `remat` reach a model loaded from `hf_path` (the
    recipes' real checkpoints) and the model config a run's checkpoints are restored with."""
    from rljax.run.artifacts import _model_config
    from rljax.run.builders import build_model
    from rljax.run.experiment import ExperimentConfig

    cfg = ExperimentConfig(hf_path=str(folder), scan_layers=True, remat="dots_saveable")
    model = build_model(cfg, range(CFG.vocab_size))  # check_vocab reads only its length
    assert (model.config.scan_layers, model.config.remat) == (True, "dots_saveable")
    assert _model_config(cfg) == model.config
    assert jax.tree.all(jax.tree.map(jnp.array_equal, nnx.state(model, nnx.Param),
                                     nnx.state(scanned, nnx.Param)))
    with pytest.raises(ValueError, match=r"ExperimentConfig.remat='partial'"):
        dataclasses.replace(cfg, remat="partial")
