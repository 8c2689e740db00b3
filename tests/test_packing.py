"""Packed learning batches (`rljax.train.learn.packing`): the plan, the packed forward, and
the packed learning program against the padded one: the same loss, metrics and
gradients for GRPO (one-pass head; also with a multi-turn loss mask), PPO with a value
model, GSPO (sequence ratio) and distillation, on one device and on the 8-device mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _train_common import CharTok, random_seqs, tiny_config, tiny_model
from rljax.models import Decoder, ValueModel
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.sharding import mesh_context, shard_params
from rljax.train.learn import packing as pack
from rljax.train.learn.layout import Packed
from rljax.train.programs.step import learn_fn
from rljax.train.rl import RLTrainer
from rljax.train.batch import Rollout

P, T, B = 6, 5, 8
# eps >> |grad|: Adam's first update is -lr * g / (|g| + eps), so equal updates mean
# equal gradients (to the same relative tolerance); no clipping, no decay. lr is large so
# that the updates are not lost in the float32 rounding of the parameters they move.
OPTIM = OptimConfig(lr=1.0, eps=100.0, clip_norm=0.0, weight_decay=0.0)


def _seqs(rng, g: int) -> dict:
    s = random_seqs(rng, B, P, T)
    for k in ("prompt_BxP", "prompt_mask_BxP"):  # a group's rows share their prompt
        s[k] = np.repeat(s[k][::g], g, axis=0)
    return s


def _rollout(rng, g: int, gaps: bool = False) -> Rollout:
    """``gaps``: a multi-turn episode's loss mask, 0 at the observation tokens inside the
    completion (the second and third)."""
    s = _seqs(rng, g)
    weight = np.ones(B, np.float32)
    weight[-g:] = 0.0  # a padding group (DAPO's): not packed, changes nothing
    loss = None
    if gaps:
        loss = s["completion_mask_BxT"].copy()
        loss[:, 1:3] = 0.0
    return Rollout(s["prompt_BxP"], s["prompt_mask_BxP"], s["completion_BxT"],
                   s["completion_mask_BxT"], -rng.random((B, T), dtype=np.float32),
                   (s["completion_mask_BxT"][:, -1] > 0).astype(np.float32),
                   rng.random(B).astype(np.float32), np.zeros(B, np.float32), weight,
                   loss_mask_BxT=loss, group_size=g)


def test_plan_places_every_real_token_once_within_its_shard():
    rng = np.random.default_rng(0)
    s = {k: jnp.asarray(v) for k, v in _seqs(rng, 1).items()}
    bins = int(pack.bins_needed(s, 2))
    spec = pack.choose_spec(bins, 2 * (P + T), P + T, 2)
    plan = pack.make_plan(s, spec)
    seg = np.asarray(plan["pack_segments_SxW"])
    tok = np.asarray(plan["pack_tokens_SxW"])
    pos = np.asarray(plan["pack_positions_SxW"])
    per = spec.rows // 2
    for r in range(B):
        shard, local = divmod(r, B // 2)
        rows = slice(shard * per, (shard + 1) * per)
        where = seg[rows] == local
        ids = np.concatenate([s["prompt_BxP"][r][s["prompt_mask_BxP"][r] > 0],
                              s["completion_BxT"][r][s["completion_mask_BxT"][r] > 0]])
        assert where.sum() == len(ids)  # all of the row, in its own shard's packed rows
        np.testing.assert_array_equal(tok[rows][where], ids)
        np.testing.assert_array_equal(np.sort(pos[rows][where]), np.arange(len(ids)))
    assert spec.rows * (P + T) >= (seg >= 0).sum() > 0.5 * spec.rows * (P + T) - (P + T)
    with pytest.raises(ValueError, match="allowed: a multiple of 2"):
        pack.PackSpec(3, 1, 2)


def test_packed_splash_forward_equals_the_padded_one():
    """Segment ids keep splash attention (interpret mode) within a row; the hidden states
    of real tokens and the gradient equal the padded forward's. (The xla path: every
    packed program below.)"""
    model = Decoder(tiny_config(attention="splash", num_layers=1), rngs=nnx.Rngs(0))
    s = {k: jnp.asarray(v) for k, v in _seqs(np.random.default_rng(1), 1).items()}
    plan = pack.make_plan(s, pack.choose_spec(int(pack.bins_needed(s, 1)), 8 * (P + T), P + T, 1))
    ids = jnp.concatenate([s["prompt_BxP"], s["completion_BxT"]], axis=1)
    mask = jnp.concatenate([s["prompt_mask_BxP"], s["completion_mask_BxT"]], axis=1) > 0

    def padded(m):
        return m.hidden_states(ids, mask_BxT=mask)[:, P - 1:-1]

    def packed(m):
        return pack.unpack(pack.packed_hidden(m, plan, False)[..., 0], plan, 1)

    cm = np.asarray(s["completion_mask_BxT"]) > 0
    a, b = (np.asarray(nnx.jit(f)(model)) for f in (lambda m: padded(m)[..., 0], packed))
    np.testing.assert_allclose(b[cm], a[cm], rtol=2e-5, atol=2e-5)
    loss = lambda f: lambda m: jnp.sum(jnp.where(cm, f(m), 0.0) ** 2)  # noqa: E731
    ga, gb = (jax.tree.leaves(nnx.state(nnx.jit(nnx.grad(loss(f)))(model)))
              for f in (lambda m: padded(m)[..., 0], packed))
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(y, x, atol=2e-5 * (float(np.abs(x).max()) + 1e-6))


def _trainer(name: str, gd, mesh, **kw):
    one_pass = kw.pop("one_pass_head", None)
    extra = {}
    if name == "ppo":
        extra["value_graphdef"] = kw.pop("value_gd")
    if name == "distill":
        extra["teacher"] = kw.pop("teacher")
    g = 1 if name in ("ppo", "distill") else 2
    return RLTrainer(gd, CharTok(), lambda c, m: np.zeros(len(c)),
                     algorithm=algorithm_preset(name, group_size=g, **kw), optim=OPTIM,
                     sampling=SamplingConfig(max_new_tokens=T),
                     rl=RLConfig(steps=2, prompts_per_step=B // g, logp_chunk=4,
                                 one_pass_head=one_pass), prompt_len=P, mesh=mesh, **extra)


CASES = {  # name -> (preset, its overrides, the head form it must take)
    "grpo-one-pass": ("grpo", {}, "one-pass"),
    "ppo-value": ("ppo", dict(num_minibatches=1), "one-pass"),
    "gspo-sequence-ratio": ("gspo", dict(num_epochs=2), "chunked"),
    "distill": ("distill", {}, "chunked"),
}


def _compare(case: str, mesh, shards: int, rows_per_micro: int, gaps: bool = False):
    """The packed program's metrics and parameter updates equal the padded one's; returns
    the padded one's ``(metrics, updates)``."""
    preset, kw, head = CASES[case]
    gd, st = tiny_model(num_layers=1)
    kw = dict(kw)
    vst = None
    if preset == "ppo":
        vgd, vst = nnx.split(ValueModel.from_policy(nnx.merge(gd, st), rngs=nnx.Rngs(3)))
        kw["value_gd"] = vgd
    if preset == "distill":
        kw["teacher"] = tiny_model(seed=7, mesh=mesh, num_layers=1)
    if mesh is not None:
        st, vst = (None if x is None else shard_params(x, mesh) for x in (st, vst))
    tr = _trainer(preset, gd, mesh, **kw)
    assert tr.base_spec.paths.head == head
    ro = _rollout(np.random.default_rng(3), 1 if preset in ("ppo", "distill") else 2, gaps)
    bins = int(pack.bins_needed(ro.masked_by_weight().seqs(), shards))
    packed = pack.choose_spec(bins, rows_per_micro * (P + T), P + T, shards)
    assert packed.num_micro >= 2  # the packed program accumulates micro-batches
    results = []
    for spec in (tr.base_spec, dataclasses.replace(
            tr.base_spec, layout=Packed(rows_per_micro * (P + T), shards, packed))):
        state = tr.init_state(jax.tree.map(jnp.copy, st), value_params=vst and jax.tree.map(
            jnp.copy, vst))
        before = jax.tree.map(np.asarray, state.params)
        counters = (state.updates, state.nonfinite_run, state.skipped)
        with mesh_context(mesh):
            p, _, _, _, m = jax.jit(learn_fn(spec))(
                state.params, state.opt_state, counters, state.ref_params, ro, state.kl_coef,
                jax.random.key(0), tr.teacher_params)
        delta = jax.tree.map(lambda a, b: np.asarray(a) - b, p, before)
        results.append(({k: float(v) for k, v in m.items()}, delta))
    (m0, d0), (m1, d1) = results
    assert 0.3 < m1.pop("useful_token_frac") <= 1.0
    assert set(m0) == set(m1)
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    leaves0, leaves1 = jax.tree.leaves(d0), jax.tree.leaves(d1)
    assert len(leaves0) == len(leaves1) > 10
    scale = max(float(np.abs(x).max()) for x in leaves0)
    assert scale > 0
    for x, y in zip(leaves0, leaves1):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5 * scale)
    return m0, d0


@pytest.mark.parametrize("case", list(CASES))
def test_packed_program_equals_the_padded_one(case):
    _compare(case, None, 1, 2)


def test_packed_program_keeps_a_multiturn_loss_mask():
    """Multi-turn episodes packed: observation tokens (loss mask 0 inside the completion)
    are attended to and not trained on, packed as padded; the control: the mask changes
    the padded program's update, so the packed one had a mask to keep."""
    _, d_gaps = _compare("grpo-one-pass", None, 1, 2, gaps=True)
    _, d = _compare("grpo-one-pass", None, 1, 2)
    assert max(float(np.abs(x - y).max())
               for x, y in zip(jax.tree.leaves(d_gaps), jax.tree.leaves(d))) > 1e-4


def test_packed_program_equals_the_padded_one_on_the_mesh(mesh8):
    """PPO (value model, reference, one-pass head) packed within each of 4 batch shards."""
    _compare("ppo-value", mesh8, 4, 4)


@pytest.mark.parametrize("alg_kw,rl_kw,what", [
    (dict(num_minibatches=2), {}, "num_minibatches=2"),
    (dict(micro_batch_size=4), {}, "micro_batch_size=4"),
    ({}, dict(share_prompts=True), "share_prompts=True"),
])
def test_trainer_refuses_what_packing_rules_out(alg_kw, rl_kw, what):
    gd, _ = tiny_model(num_layers=1)
    with pytest.raises(ValueError, match=f"rules out {what}; allowed: a host reward"):
        RLTrainer(gd, CharTok(), lambda c, m: np.zeros(len(c)),
                  algorithm=algorithm_preset("grpo", group_size=2, **alg_kw), optim=OPTIM,
                  sampling=SamplingConfig(max_new_tokens=T),
                  rl=RLConfig(prompts_per_step=4, tokens_per_micro_batch=22, **rl_kw),
                  prompt_len=P)
