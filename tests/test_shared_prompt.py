"""Shared-prompt forwards (`Decoder.grouped_hidden_states`, `rljax.models.grouped`): each
group's prompt computed once gives the full forward's hidden states and gradients."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _train_common import CharTok, random_seqs, tiny_model
from rljax.models import Decoder, ModelConfig
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.learn import _minibatch_rows
from rljax.train.learn.micro import merge_micro, split_micro
from rljax.train.programs.step import learn_fn
from rljax.train.rl import RLTrainer
from rljax.train.batch import Rollout

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


@pytest.mark.parametrize("impl,scan", [("xla", False), ("xla", True), ("splash", True)])
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


def test_grouped_forward_on_a_mesh_runs_a_prompt_copy_per_batch_shard(mesh8):
    """2 prompts x 4 rows over 4 batch shards: each prompt runs as 2 copies (one per shard
    holding its rows); the same hidden states as the full forward."""
    from rljax.models import grouped

    rng = np.random.default_rng(5)
    n, g, p, t = 2, 4, 5, 4
    prompt = jnp.asarray(rng.integers(1, TINY.vocab_size, (n, p)), jnp.int32)
    pmask = jnp.asarray(np.arange(p)[None] >= np.array([[1], [0]]))
    comp = jnp.asarray(rng.integers(1, TINY.vocab_size, (n * g, t)), jnp.int32)
    cmask = jnp.asarray(np.arange(t)[None] < rng.integers(1, t + 1, (n * g, 1)))
    model = Decoder(TINY, rngs=nnx.Rngs(0))
    ids = jnp.concatenate([jnp.repeat(prompt, g, axis=0), comp], axis=1)
    mask = jnp.concatenate([jnp.repeat(pmask, g, axis=0), cmask], axis=1)
    with jax.set_mesh(mesh8):
        assert grouped.prompt_copies(n, g) == 2
        hp, hc = nnx.jit(lambda m: m.grouped_hidden_states(prompt, pmask, comp, cmask))(model)
        h = nnx.jit(lambda m: m.hidden_states(ids, mask_BxT=mask))(model)
    assert hp.shape == (n, p, TINY.hidden_size)
    pm, cm = np.asarray(pmask), np.asarray(cmask)
    np.testing.assert_allclose(np.asarray(hp)[pm], np.asarray(h)[::g, :p][pm], rtol=2e-5,
                               atol=2e-5)
    np.testing.assert_allclose(np.asarray(hc)[cm], np.asarray(h)[:, p:][cm], rtol=2e-5,
                               atol=2e-5)
    assert grouped.prompt_copies(n, g) == 1  # no mesh


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


def _grouped_rollout(rng, groups: int, g: int, p: int = 6, t: int = 5) -> Rollout:
    """A rollout in the trainer's layout: each prompt's g completions consecutive."""
    s = random_seqs(rng, groups * g, p, t)
    prompt = np.repeat(s["prompt_BxP"][::g], g, axis=0)
    pmask = np.repeat(s["prompt_mask_BxP"][::g], g, axis=0)
    b = groups * g
    rewards = rng.integers(0, 2, b).astype(np.float32)
    return Rollout(prompt, pmask, s["completion_BxT"], s["completion_mask_BxT"],
                   -rng.random((b, t), dtype=np.float32), np.zeros(b, np.float32), rewards,
                   np.zeros(b, np.float32), np.ones(b, np.float32), group_size=g)


def _trainer(gd, share: bool, name="grpo", **alg):
    return RLTrainer(gd, CharTok(), lambda c, m: np.zeros(len(c), np.float32),
                     algorithm=algorithm_preset(name, **alg),
                     # eps = 1: the first Adam step is ~lr x gradient, so comparing weights
                     # compares gradients (at eps ~ 0 it is lr x sign, ill-conditioned).
                     optim=OptimConfig(lr=1.0, eps=1.0),
                     sampling=SamplingConfig(max_new_tokens=5),
                     rl=RLConfig(steps=2, prompts_per_step=4, logp_chunk=2, share_prompts=share),
                     prompt_len=6)


@pytest.mark.parametrize("micro", [0, 4])
def test_learning_program_with_shared_prompts_equals_per_row_prompts(micro):
    """GRPO with a KL reference (its forward shares too), one minibatch, whole or in
    micro-batches of two groups: the same update, loss and metrics either way."""
    gd, st = tiny_model()
    ro = _grouped_rollout(np.random.default_rng(3), 4, 2)
    outs = []
    for share in (True, False):
        tr = _trainer(gd, share, group_size=2, kl_coef=0.1, kl_in="loss", micro_batch_size=micro)
        assert tr.share_group == (2 if share else 1)
        state = tr.init_state(st)
        counters = (state.updates, state.nonfinite_run, state.skipped)
        outs.append(jax.jit(learn_fn(tr.base_spec))(state.params, state.opt_state, counters,
                                                      state.ref_params, ro, state.kl_coef,
                                                      jax.random.key(0)))
    (p_s, _, _, _, m_s), (p_r, _, _, _, m_r) = outs
    for k in ("loss", "grad_norm", "kl_ref"):
        np.testing.assert_allclose(m_s[k], m_r[k], rtol=2e-5, err_msg=k)
    assert float(m_r["grad_norm"]) > 0
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(p_r["policy"]), jax.tree.leaves(st))]
    assert max(moved) > 1e-4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), p_s, p_r)


def test_prompts_are_shared_only_where_groups_stay_whole():
    """By default (None) prompts are shared where the groups stay whole and the attention
    has a prefix path; set explicitly (True), anything else is an error saying why."""
    gd, _ = tiny_model()
    cudnn, _ = tiny_model(attention="cudnn", compute_dtype="bfloat16")
    assert _trainer(gd, True, group_size=4).share_group == 4
    assert _trainer(gd, None, group_size=4).share_group == 4
    for model, name, alg, why in (
            (gd, "grpo", dict(group_size=4, micro_batch_size=2), "split the groups of 4"),
            (gd, "reinforce", dict(group_size=1), "one completion per prompt"),
            (cudnn, "grpo", dict(group_size=2), "cudnn has no prefix path")):
        assert _trainer(model, None, name, **alg).share_group == 1
        with pytest.raises(ValueError, match=f"share_prompts=True was set explicitly.*{why}"):
            _trainer(model, True, name, **alg)
    with pytest.raises(ValueError, match="share_prompts.*True or False"):
        RLConfig(share_prompts=1)


def test_group_micro_batches_and_minibatches_keep_groups_whole():
    x = np.arange(24)
    m = np.asarray(split_micro(jnp.asarray(x), 2, 3))
    np.testing.assert_array_equal(m, [[0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20],
                                      [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]])
    np.testing.assert_array_equal(np.asarray(merge_micro(jnp.asarray(m), 3)), x)
    np.testing.assert_array_equal(np.asarray(split_micro(jnp.asarray(x), 4))[1], x[1::4])
    rows = np.asarray(_minibatch_rows(jax.random.key(1), 24, 2, 3))
    assert sorted(rows.ravel().tolist()) == list(range(24))
    groups = rows.reshape(2, -1, 3)
    assert np.all(groups % 3 == np.arange(3)) and np.all(groups[..., 0] // 3 == groups[..., 2] // 3)


def test_model_flops_count_each_shared_prompt_once():
    """The step's FLOP rate counts the prompt tokens the forwards compute (once per group);
    the token rates count every row's."""
    from rljax.train.rl import PhaseTimes

    gd, params = tiny_model()
    n = sum(x.size for x in jax.tree.leaves(params))
    m = {}
    for share in (True, False):
        tr = _trainer(gd, share, group_size=4)
        tr.num_params = n
        row = {"completion_tokens": 100.0, "prompt_tokens": 400.0}
        tr.add_throughput(row, PhaseTimes({"rollout": 1.0, "learn": 1.0}))
        m[share] = row
    assert m[True]["train_tok_s"] == m[False]["train_tok_s"] == 500.0
    assert tr.uses_ref and tr.old_mode == "self"  # GRPO: a KL reference forward, one epoch
    # 2N per generated token and per prefilled prompt token (each group's prompt once,
    # 400 / 4), 2N (reference) + 6N (update) per computed sequence token, over 2 s
    for share, seq in ((True, 100 + 100), (False, 100 + 400)):
        assert m[share]["model_flops_s"] == pytest.approx((2 * (100 + 100) + 8 * seq) * n / 2.0)
