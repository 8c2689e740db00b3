"""An MoE policy in RL beyond the single-turn step (issue 57): multi-turn rollouts record
the expert ids of every position the learner forwards (prompt, drawn tokens,
observations), so replay is exact there too; Clip-Cov's selection forward replays them;
the update's loss adds the router losses with the same statistics whether a group's
prompt is computed once or per row. One multi-turn rollout of a near-tied MoE policy
(`rollout`) serves every test."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _moe_common import near_tied
from _mp_multiturn import source, trainer
from _train_common import tiny_config
from rljax.models import Decoder
from rljax.models.config import MoeConfig
from rljax.models.moe import aux_loss, z_loss
from rljax.train import learn
from rljax.train.config import algorithm_preset
from rljax.train.learn import algorithms as alg
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.learn.layout import Padded
from rljax.train.learn.loss import rl_loss

TOL = 1e-5  # the dense sampler's tolerance (test_moe)
MOE = MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=16,
                norm_topk_prob=False)


def _graphdef(replay: str, **moe):
    cfg = tiny_config(architecture="qwen3_moe", qk_norm=True, head_dim=8, scan_layers=True,
                      moe=dataclasses.replace(MOE, router_replay=replay, **moe))
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))[0], cfg


@pytest.fixture(scope="module")
def rollout():
    """``(state, rollout)``: 4 prompts x 2 episodes of up to 3 turns (tests/_mp_multiturn.py)
    sampled by a 2-layer MoE policy whose router logits tie to float32 rounding."""
    _, cfg = _graphdef("off")
    gd, st = nnx.split(near_tied(Decoder(cfg, rngs=nnx.Rngs(2)), 3e-7))
    out = trainer(gd).multiturn.sample(st, source, 0, 4, jax.random.key(0))
    return st, out.rollout


def _gap(logp, ro):
    m = np.asarray(ro.loss_mask_BxT) > 0
    return np.abs(np.asarray(logp) - np.asarray(ro.sampler_logp_BxT))[m].max()


def test_multiturn_rollout_records_every_fed_position(rollout):
    """Every real prompt column and every completion column but a row's last (drawn,
    never fed) holds expert ids, observations included."""
    _, ro = rollout
    ids = np.asarray(ro.expert_ids_BxLxSxK)
    b, p = ro.prompt_BxP.shape
    t = ro.completion_BxT.shape[1]
    assert ids.dtype == np.int8 and ids.shape == (b, 2, p + t, 2)
    obs = (np.asarray(ro.completion_mask_BxT) > 0) & (np.asarray(ro.loss_mask_BxT) == 0)
    assert obs.sum() > 10  # the rollout has observations
    fed = np.concatenate([np.asarray(ro.prompt_mask_BxP) > 0, np.asarray(
        ro.completion_mask_BxT) > 0], axis=1)
    last = p + np.asarray(ro.completion_mask_BxT).sum(axis=1).astype(int) - 1
    fed[np.arange(b), last] = False
    assert (ids.min(axis=(1, 3)) >= 0)[fed].all()
    assert (ids.max(axis=(1, 3)) == -1)[~fed].all()


def test_multiturn_replay_makes_learner_logprobs_equal_the_samplers(rollout):
    """The learner's forward of the whole episode routed by the recorded ids gives the
    sampler's log-probs on the model's tokens (TOL, padded and shared-prompt forms);
    routed by its own router it does not."""
    st, ro = rollout
    gaps = {}
    for mode, group in (("off", 1), ("replay", 1), ("replay", 2)):
        gd, _ = _graphdef(mode)
        fn = jax.jit(lambda st, seqs: policy_logprobs(gd, st, seqs, chunk=8, group=group)[0])
        gaps[mode, group] = _gap(fn(st, ro.seqs()), ro)
    assert gaps["replay", 1] <= TOL and gaps["replay", 2] <= TOL, gaps
    assert gaps["off", 1] > 100 * TOL, gaps  # what replay closes


def test_clip_cov_selection_forward_replays(rollout, monkeypatch):
    """Clip-Cov's selection forward (``learn._cov_selector``) reads the replay ids: its
    log-probs equal the sampler's on the model's tokens."""
    st, ro = rollout
    gd, _ = _graphdef("replay")
    monkeypatch.setattr(alg, "cov_tokens", lambda cfg, logp, mb, key: logp)  # its input
    spec = types.SimpleNamespace(alg=algorithm_preset("clip_cov", group_size=2),
                                 layout=Padded(), chunk=8, temperature=1.0, policy_gd=gd)
    mb = dict(ro.seqs(), adv_BxT=jnp.zeros_like(ro.sampler_logp_BxT))
    select = jax.jit(lambda st: learn._cov_selector(spec)({"policy": st}, mb, jax.random.key(0)))
    assert _gap(select(st), ro) <= TOL


def test_router_losses_enter_the_update_loss(rollout):
    """``rl_loss`` adds ``count x (aux_coef x aux + z_coef x z)`` of the policy's forward,
    whose statistics are those of a plain forward of the rows (the padded form and the
    shared-prompt form agree); the router's gradient changes with it."""
    st, ro = rollout
    assert float(ro.completion_mask_BxT[:, -1].max()) == 0  # both forms see the same tokens
    mb = dict(ro.seqs(), sampler_logp_BxT=ro.sampler_logp_BxT, loss_mask_BxT=ro.loss_mask_BxT,
              adv_BxT=jnp.ones_like(ro.sampler_logp_BxT))
    a = algorithm_preset("grpo", group_size=2, kl_coef=0.0)
    objective, coef = alg.make_objective(a, 48), alg.make_coef(a)
    out = {}
    for name, group, moe in (("off", 1, {}), ("on", 1, dict(aux_loss_coef=0.5, z_loss_coef=0.1)),
                             ("on_grouped", 2, dict(aux_loss_coef=0.5, z_loss_coef=0.1))):
        gd, cfg = _graphdef("replay", **moe)
        loss = lambda p, g=group, gd=gd: rl_loss(
            p, mb, coef, policy_gd=gd, value_gd=None, objective=objective, chunk=8,
            temperature=1.0, remat=False, self_old=True, use_sampler=False,
            entropy_grad=False, layout=Padded(g))[:2]
        # The grouped form's loss only (a backward compiles slowly on 2 cores).
        fn = (lambda p: (loss(p), None)) if group > 1 else jax.value_and_grad(loss, has_aux=True)
        out[name] = jax.jit(fn)({"policy": st})
    ids = jnp.concatenate([ro.prompt_BxP, ro.completion_BxT], axis=1)
    mask = jnp.concatenate([ro.prompt_mask_BxP, ro.completion_mask_BxT], axis=1) > 0
    rec = nnx.merge(gd, st).routed_hidden_states(
        ids, mask_BxT=mask, replay_ids_LxBxTxK=jnp.swapaxes(ro.expert_ids_BxLxSxK, 0, 1))[1]
    count = float(out["off"][0][1])  # the objective's count (a constant of the batch)
    want = count * (0.5 * float(aux_loss(rec)) + 0.1 * float(z_loss(rec)))
    for name in ("on", "on_grouped"):
        added = float(out[name][0][0] - out["off"][0][0])
        assert abs(added - want) <= 1e-4 * abs(want), (name, added, want)
    router_grad = lambda g: g["policy"]["layers"]["mlp"]["router"][...]
    assert float(jnp.abs(router_grad(out["on"][1]) - router_grad(out["off"][1])).max()) > 1e-4
