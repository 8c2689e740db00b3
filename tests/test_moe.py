"""Mixture-of-experts layers: dropless expert forms agree with a per-expert reference,
router losses follow their papers (and HF's load-balance loss), replay routes as told."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from _moe_common import near_tied
from rljax.models import Decoder, ModelConfig
from rljax.models.config import MoeConfig
from rljax.models.hf_config import config_from_hf, config_to_hf
from rljax.models.lora import LoraConfig
from rljax.models.moe_parallel import expert_axis_size
from rljax.sampling import generate
from rljax.sharding import MeshConfig, batch_sharding, make_mesh, state_shardings
from rljax.train.config.dicts import config_from_dict, config_to_dict
from rljax.train.learn.layout import Packed, frozen_logprobs
from rljax.train.learn.logprobs import REPLAY_KEY, policy_logprobs
from rljax.models.moe import (active_params, aux_loss, compact_ids, experts_ragged, experts_tiled,
                              mismatch_kl, route, router_loss, router_metrics, tile_rows,
                              z_loss)

TOL = 1e-5  # float32, same math in another summation order

MOE = MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=16)
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                  architecture="qwen3_moe", moe=MOE)


def _reference(x, ids, wg, wu, wd):
    """Per pair (n, j), expert ids[n, j]'s SwiGLU, one token at a time (numpy)."""
    out = np.zeros((*ids.shape, x.shape[1]), np.float64)
    for n in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]
            g, u = x[n] @ wg[e], x[n] @ wu[e]
            out[n, j] = (g / (1 + np.exp(-g)) * u) @ wd[e]
    return out


def _weights(seed, e=4, d=8, f=6):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (e, d, f)), jax.random.normal(ks[1], (e, d, f)),
            jax.random.normal(ks[2], (e, f, d)))


@pytest.mark.parametrize("skew", [False, True])
def test_dropless_forms_match_reference(skew):
    """Every pair is computed, also when every token picks the same expert (no capacity
    drops): tiled and ragged equal a token-by-token reference."""
    n, k, e = 37, 2, 4
    x = jax.random.normal(jax.random.key(1), (n, 8))
    ids = jax.random.randint(jax.random.key(2), (n, k), 0, e)
    if skew:
        ids = ids.at[:, 0].set(3)
    ws = _weights(3, e)
    want = _reference(np.asarray(x, np.float64), np.asarray(ids), *map(np.asarray, ws))
    tiled = jax.jit(experts_tiled, static_argnames="tile")
    for got in (jax.jit(experts_ragged)(x, ids, *ws), tiled(x, ids, *ws, tile=8)):
        assert np.abs(np.asarray(got) - want).max() <= TOL * max(1.0, np.abs(want).max())


def test_tiled_gradients_equal_ragged():
    n, k = 40, 2
    x = jax.random.normal(jax.random.key(4), (n, 8))
    ids = jax.random.randint(jax.random.key(5), (n, k), 0, 4)
    ws = _weights(6)

    def loss(fn, x, ws):
        return jnp.sum(jnp.sin(fn(x, ids, *ws)))

    g_r = jax.jit(jax.grad(lambda x, ws: loss(experts_ragged, x, ws), (0, 1)))(x, ws)
    g_t = jax.jit(jax.grad(lambda x, ws: loss(lambda *a: experts_tiled(*a, tile=8), x, ws),
                           (0, 1)))(x, ws)
    for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_t)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= TOL * max(1.0, np.abs(a).max())


def test_tile_rows_bounds_padding():
    assert tile_rows(8192, 8) == 256
    assert tile_rows(64, 128) == 8  # a decode step: the smallest tile
    for pairs, e in ((8192, 8), (4096, 16), (2048, 4)):
        assert e * tile_rows(pairs, e) <= pairs / 4


def test_aux_loss_equals_transformers_and_z_loss_its_formula():
    """One MoE layer: our Switch loss equals HF's `load_balancing_loss_func` (with a
    padding mask); z-loss is mean(logsumexp^2) over real tokens."""
    logits = jax.random.normal(jax.random.key(7), (24, 4)) * 2
    mask = np.arange(24) % 5 != 0
    _, ids, probs, _ = route(logits, 2, True)
    from rljax.models.moe import record

    rec = jax.tree.map(lambda a: a[None], record(ids, probs, logits, jnp.asarray(mask), (4, 6)))
    want = load_balancing_loss_func((torch.tensor(np.asarray(logits)),), 4, 2,
                                    torch.tensor(mask.reshape(4, 6)))
    assert abs(float(aux_loss(rec)) - float(want)) <= 1e-6
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    assert abs(float(z_loss(rec)) - (lse[mask] ** 2).mean()) <= 1e-5
    m = router_metrics(rec)
    assert m["moe/load_E"].shape == (4,) and abs(float(m["moe/load_E"].sum()) - 1) <= 1e-6
    assert float(router_loss(rec, MOE)) == 0.0  # coefficients default off
    both = dataclasses.replace(MOE, aux_loss_coef=0.01, z_loss_coef=0.001)
    assert abs(float(router_loss(rec, both)) - (0.01 * float(want) + 0.001 * float(z_loss(rec)))) <= 1e-7


def test_replay_routes_by_given_ids_and_router_still_learns():
    graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))  # unscanned layers
    ids = jax.random.randint(jax.random.key(8), (2, 7), 0, 64)

    def loss(st, replay):
        h, rec = nnx.merge(graphdef, st).routed_hidden_states(ids, replay_ids_LxBxTxK=replay)
        return jnp.sum(h ** 2), (h, rec.ids_BxTxK)

    forward = jax.jit(jax.value_and_grad(loss, has_aux=True))  # one program for every call
    unset = jnp.full((2, 2, 7, 2), -1, jnp.int8)  # -1: every token routes by its own top-k
    (_, (h, own)), _ = forward(state, unset)
    own = own.astype(jnp.int8)
    (_, (h_same, _)), _ = forward(state, own)
    assert float(jnp.abs(h_same - h).max()) == 0.0  # replaying its own choices changes nothing
    flipped = (own + 1) % 4  # other experts everywhere
    (_, (h_flip, ids_flip)), g = forward(state, flipped)
    assert (ids_flip == flipped).all() and float(jnp.abs(h_flip - h).max()) > 1e-3
    assert float(jnp.abs(g["layers"][0]["mlp"]["router"][...]).max()) > 0  # the router learns
    assert compact_ids(flipped, 4).dtype == jnp.int8
    assert compact_ids(flipped, 300).dtype == jnp.int16


def test_config_round_trips_and_refusals():
    moe = dataclasses.replace(MOE, mlp_only_layers=(1,), router_replay="replay")
    cfg = dataclasses.replace(CFG, moe=moe)
    assert config_from_dict(ModelConfig, config_to_dict(cfg)) == cfg  # a run's config.json
    assert config_from_hf(config_to_hf(cfg)).moe == dataclasses.replace(moe, router_replay="off")
    # Active parameters: the dense model of MLP width k F plus the routers.
    dense = dataclasses.replace(CFG, architecture="qwen3", moe=None, intermediate_size=32)
    count = lambda c: sum(x.size for x in jax.tree.leaves(
        nnx.state(nnx.eval_shape(lambda: Decoder(c, rngs=nnx.Rngs(0))), nnx.Param)))
    assert active_params(count(CFG), CFG) == count(dense) + 2 * 32 * 4
    assert active_params(count(dense), dense) == count(dense)
    with pytest.raises(ValueError, match="scan_layers"):
        dataclasses.replace(CFG, scan_layers=True,
                            moe=dataclasses.replace(MOE, mlp_only_layers=(0,)))
    with pytest.raises(ValueError, match="experts_per_token"):
        MoeConfig(num_experts=2, experts_per_token=3, intermediate_size=4)
    with pytest.raises(ValueError, match="impl"):
        MoeConfig(num_experts=2, experts_per_token=1, intermediate_size=4, impl="dense")
    with pytest.raises(ValueError, match="qwen3_moe"):
        dataclasses.replace(CFG, architecture="qwen3")
    with pytest.raises(ValueError, match="attention projections"):
        dataclasses.replace(CFG, lora=LoraConfig(rank=2))
    assert dataclasses.replace(CFG, lora=LoraConfig(rank=2, targets=("q", "v"))).lora.rank == 2
    hf = dict(model_type="qwen2_moe", vocab_size=8, hidden_size=8, intermediate_size=8,
              num_hidden_layers=1, num_attention_heads=2, num_experts=4)
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf(hf)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        config_from_hf({**hf, "model_type": "qwen3_moe", "num_experts_per_tok": 2,
                        "moe_intermediate_size": 4, "shared_expert_intermediate_size": 8})
    with pytest.raises(ValueError, match="num_experts"):
        config_from_hf({**hf, "model_type": "qwen3", "num_experts": 4})


EP_CFG = dataclasses.replace(CFG, scan_layers=True,
                             moe=dataclasses.replace(MOE, num_experts=8, norm_topk_prob=False))
EP_MESH = MeshConfig(data=2, fsdp=4, tensor=1)  # 2 experts a chip
GRAD_TOL = 1e-5  # relative to the gradient norm (DESIGN.md testing policy)
# One sampler setting for both sampler tests, so the one-device programs compile once.
PROMPTS = [[5, 9, 2, 33], [11, 4], [40, 41, 42], [3]]
SAMPLE = dict(max_new_tokens=8, num_samples=2)


def _loss_and_grads(graphdef, state, ids, mask):
    def loss(st):
        h, rec = nnx.merge(graphdef, st).routed_hidden_states(ids, mask_BxT=mask)
        logits = nnx.merge(graphdef, st).logits_from_hidden(h)
        return jnp.sum(jnp.sin(logits) * mask[..., None]), (logits, rec)

    return jax.value_and_grad(loss, has_aux=True)(state)


def test_expert_parallel_equals_one_device():
    """EP x FSDP on the 8-device mesh (experts over fsdp 4, rows over data 2 x fsdp 4)
    equals one device: logits, router record, gradients, and the sampler's tokens."""
    model = Decoder(EP_CFG, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(9), (8, 6), 0, 64)
    mask = jnp.arange(6)[None, :] >= jnp.arange(8)[:, None] % 3  # some left padding
    step = jax.jit(functools.partial(_loss_and_grads, graphdef))
    (_, (logits, rec)), grads = step(state, ids, mask)
    mesh = make_mesh(EP_MESH)
    with jax.set_mesh(mesh):
        assert expert_axis_size(8, 8) == 4
        sharded = jax.device_put(state, state_shardings(state, mesh))
        rows = batch_sharding(mesh)
        compiled = step.lower(sharded, jax.device_put(ids, rows),
                              jax.device_put(mask, rows)).compile()
        (_, (logits_ep, rec_ep)), grads_ep = compiled(sharded, jax.device_put(ids, rows),
                                                       jax.device_put(mask, rows))
    text = compiled.as_text()
    assert "all-gather" in text and "reduce-scatter" in text  # dispatch and combine
    spec = dict(nnx.to_flat_state(sharded))[("layers", "mlp", "gate")].get_value().sharding.spec
    assert spec[1] == "fsdp", spec  # [L, E, D, F]: experts over fsdp
    assert np.abs(np.asarray(logits_ep) - np.asarray(logits)).max() <= TOL
    assert (np.asarray(rec_ep.ids_BxTxK) == np.asarray(rec.ids_BxTxK)).all()
    assert np.allclose(np.asarray(rec_ep.load_E), np.asarray(rec.load_E))
    g1, g8 = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for g in (grads, grads_ep))
    assert np.abs(g8 - g1).max() <= GRAD_TOL * np.linalg.norm(g1)
    ref = generate(model, PROMPTS, key=jax.random.key(3), **SAMPLE)
    res = generate((graphdef, sharded), PROMPTS, key=jax.random.key(3), mesh=mesh, **SAMPLE)
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))


def _learner_logp(graphdef, state, result, group, packed=False):
    """The learner's log-probs of the sampled tokens (`policy_logprobs`, the trainer's
    forward; ``group`` G: each group's prompt once; ``packed``: rows packed by length,
    `rljax.train.learn.packing`), with the sampler's expert ids in its batch: routed by
    them when the graphdef's config says router_replay="replay"."""
    seqs = {"prompt_BxP": result.prompt_tokens, "prompt_mask_BxP": result.prompt_mask,
            "completion_BxT": result.tokens, "completion_mask_BxT": result.completion_mask,
            REPLAY_KEY: result.expert_ids}
    if packed:
        width = seqs["prompt_BxP"].shape[1] + seqs["completion_BxT"].shape[1]
        layout = Packed(4 * width).sized(8, width)  # 4 packed rows a micro-batch
        return frozen_logprobs(layout, graphdef, state, layout.plan(seqs)[0], chunk=8,
                               temperature=1.0)
    return policy_logprobs(graphdef, state, seqs, chunk=8, group=group)[0]


def _agreement(graphdef, state, result):
    """`moe/routing_agreement` of a full forward replaying the sampler's ids."""
    ids, mask, pos = result.sequences()
    rec = nnx.merge(graphdef, state).routed_hidden_states(
        ids, pos, mask, replay_ids_LxBxTxK=jnp.swapaxes(result.expert_ids, 0, 1))[1]
    return router_metrics(rec)["moe/routing_agreement"]


def test_router_replay_makes_learner_logprobs_equal_the_samplers():
    """Near-tied router logits: the sampler's cached decode and the learner's full forward
    pick different experts for some tokens, and their log-probs differ; routed by the
    sampler's recorded ids the learner's log-probs equal the sampler's (TOL)."""
    model = near_tied(Decoder(EP_CFG, rngs=nnx.Rngs(2)), 3e-7)
    graphdef, state = nnx.split(model)
    res = generate(model, PROMPTS, key=jax.random.key(4), **SAMPLE)
    p = res.prompt_tokens.shape[1]
    assert res.expert_ids.dtype == jnp.int8 and res.expert_ids.shape == (8, 2, p + 8, 2)
    assert (np.asarray(res.expert_ids[:, :, -1]) == -1).all()  # the last token is never fed
    replaying = dataclasses.replace(EP_CFG, moe=dataclasses.replace(EP_CFG.moe,
                                                                    router_replay="replay"))
    graphdef_replay = nnx.split(nnx.eval_shape(lambda: Decoder(replaying, rngs=nnx.Rngs(0))))[0]
    learner = jax.jit(_learner_logp, static_argnums=(0, 3, 4))
    m = np.asarray(res.completion_mask)
    gaps = {}
    for gd, group, packed in ((graphdef, 1, False), (graphdef_replay, 1, False),
                              (graphdef_replay, 2, False), (graphdef, 1, True),
                              (graphdef_replay, 1, True)):
        logp = learner(gd, state, res, group, packed)
        gaps[gd is graphdef_replay, group + 10 * packed] = np.abs(
            np.asarray(logp - res.logprobs))[m].max()
        kl = mismatch_kl(res.logprobs, logp, m)
        assert all(np.isfinite(float(v)) for v in kl.values())
    assert gaps[True, 1] <= TOL and gaps[True, 2] <= TOL and gaps[True, 11] <= TOL, gaps
    assert gaps[False, 1] > 100 * TOL and gaps[False, 11] > 100 * TOL, gaps  # what replay closes
    agreement = jax.jit(_agreement, static_argnums=0)(graphdef, state, res)
    assert float(agreement) < 1.0  # the learner alone would have routed otherwise


def test_router_replay_with_lora_adapters():
    """LoRA (adapters on attention, experts frozen): the replayed learner equals the
    sampler with the adapters on (their B drawn non-zero, so they change the function)."""
    lora = LoraConfig(rank=2, targets=("q", "v"))
    cfg = dataclasses.replace(EP_CFG, lora=lora, moe=dataclasses.replace(
        EP_CFG.moe, router_replay="replay"))
    model = near_tied(Decoder(cfg, rngs=nnx.Rngs(5)), 3e-7)
    for pair in (model.layers.attn.q_lora, model.layers.attn.v_lora):
        pair.b[...] = 0.1 * jax.random.normal(jax.random.key(6), pair.b[...].shape)
    graphdef, state = nnx.split(model)
    res = generate(model, PROMPTS, key=jax.random.key(7), **SAMPLE)
    logp = jax.jit(_learner_logp, static_argnums=(0, 3))(graphdef, state, res, 2)
    m = np.asarray(res.completion_mask)
    assert np.abs(np.asarray(logp - res.logprobs))[m].max() <= TOL


class _IdTok:
    """Ids 2..63 as characters (pad 0, eos 1): a tokenizer for EP_CFG's 64-id vocabulary."""

    pad_token_id, eos_token_id = 0, 1

    def encode(self, s):
        return [2 + ord(c) - 48 for c in s]

    def decode(self, ids):
        return "".join(chr(48 + i - 2) for i in ids if i >= 2)


def test_rl_step_replays_the_samplers_routing(monkeypatch):
    """The RL step (host reward, ``rljax.train.driver``): the rollout carries the sampler's
    expert ids into the learning program, so on near-tied routers the first update's
    log-probs equal the sampler's (``sampler_gap`` and the mismatch KL at float rounding)
    with ``router_replay="replay"`` and differ without it. The step reports the router
    losses and the load histogram (``rljax.train.learn.router``), and its FLOPs count
    active parameters."""
    from rljax.train import throughput
    from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
    from rljax.train.rl import RLTrainer

    got = {}
    for mode in ("off", "replay"):
        cfg = dataclasses.replace(EP_CFG, moe=dataclasses.replace(
            EP_CFG.moe, router_replay=mode, aux_loss_coef=0.01, z_loss_coef=1e-3))
        graphdef, state = nnx.split(near_tied(Decoder(cfg, rngs=nnx.Rngs(2)), 3e-7))
        tr = RLTrainer(graphdef, _IdTok(), lambda c, m: np.arange(len(c), dtype=np.float32),
                       algorithm=algorithm_preset("grpo", group_size=2, kl_coef=0.0),
                       optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=8),
                       rl=RLConfig(steps=1, prompts_per_step=4, logp_chunk=8), prompt_len=8)
        prompts = lambda start, n: (["5920", "?4", "XYZ", "3"][:n], [{}] * n)  # noqa: E731
        _, got[mode] = tr.step(tr.init_state(state, seed=0), prompts)
    off, on = got["off"], got["replay"]
    assert on["sampler_gap"] <= 1e-6 and off["sampler_gap"] > 10 * on["sampler_gap"] + 1e-6
    assert on["moe/kl_sampler_learner"] <= 1e-10 < off["moe/kl_sampler_learner"], (on, off)
    assert on["moe/routing_agreement"] < 1.0 == off["moe/routing_agreement"]
    for m in (on, off):
        assert abs(sum(m[f"moe/load_e{j}"] for j in range(8)) - 1.0) <= 1e-6
        assert m["moe/aux_loss"] > 0 and m["moe/z_loss"] > 0
        assert 1.0 <= m["moe/load_max_over_mean_l0"] <= 8.0 and "moe/load_max_over_mean_l1" in m
    seen = []
    monkeypatch.setattr(throughput, "step_model_flops", lambda n, **kw: seen.append(n) or 1.0)
    tr.add_throughput(dict(on), throughput.PhaseTimes({"rollout": 1.0, "learn": 1.0}))
    assert seen == [active_params(tr.num_params, cfg)] and seen[0] < tr.num_params
