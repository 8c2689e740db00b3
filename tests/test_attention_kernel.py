"""Attention through maintained kernels: splash (Pallas TPU, interpret mode here) vs `attend`.

The kernel runs in Pallas interpret mode on CPU: the same kernel body and grid as on a
TPU, executed as XLA ops. Its TPU lowering is compiled ahead of time where `libtpu` is
installed (not a project dependency: the wheel is ~700 MB), for a v5e topology.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, ModelConfig, config_from_hf, config_to_hf
from rljax.models.attention import attend
from rljax.models.attention_kernels import cudnn_attend, splash_attend

# Same math, different summation order (one 512 block vs whole-row einsums): forward
# outputs (|o| ~ 1) to TOL absolute; gradients to TOL times the largest gradient entry.
TOL = 1e-5
B, T, N, K, H = 2, 512, 4, 2, 32


def _segments():
    """Row 0: left padding, two packed sequences, right padding. Row 1: left padding,
    two sequences, right padding, with other boundaries. -1 is padding."""
    seg = np.full((B, T), -1, np.int32)
    seg[0, 20:300], seg[0, 300:490] = 0, 1
    seg[1, 41:200], seg[1, 200:500] = 3, 7
    return jnp.asarray(seg)


def _allowed(seg_BxT):
    """`attend`'s mask for the same segments, built the way the decoder builds its own."""
    i = jnp.arange(seg_BxT.shape[1])
    causal = (i[:, None] >= i[None, :])[None]
    same = (seg_BxT[:, :, None] == seg_BxT[:, None, :]) & (seg_BxT >= 0)[:, None, :]
    return (causal & same) | (i[:, None] == i[None, :])[None]


def _loss(o_BxTxNxH, real_BxT):
    """A nonlinear loss over real query rows only (padding rows' outputs are unused)."""
    return jnp.sum(jnp.where(real_BxT[:, :, None, None], jnp.sin(3 * o_BxTxNxH) * o_BxTxNxH, 0))


@pytest.fixture(scope="module")
def results():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
    seg = _segments()
    real = seg >= 0

    def xla(q, k, v):
        o = attend(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), _allowed(seg))
        return _loss(o, real), o

    def kernel(q, k, v):
        o = splash_attend(q, k, v, seg, interpret=True)
        return _loss(o, real), o

    out = {}
    for name, fn in (("xla", xla), ("splash", kernel)):
        (_, o), grads = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        out[name] = (np.asarray(o), [np.asarray(g) for g in grads])
    return out, np.asarray(real)


def test_splash_forward_matches_attend_on_real_rows(results):
    (o_x, _), (o_s, _) = results[0]["xla"], results[0]["splash"]
    real = results[1]
    assert np.isfinite(o_s).all()  # padding rows too: each attends to itself
    np.testing.assert_array_less(np.abs(o_s - o_x)[real], TOL)


@pytest.mark.parametrize("i,name", [(0, "q"), (1, "k"), (2, "v")])
def test_splash_gradients_match_attend(results, i, name):
    g_x, g_s = results[0]["xla"][1][i], results[0]["splash"][1][i]
    assert np.isfinite(g_s).all(), name
    assert np.abs(g_s - g_x).max() <= TOL * np.abs(g_x).max(), name
    # Padding slots get no gradient: no real row attends to them, their rows are unused.
    pad = ~results[1]
    assert not np.any(g_s[pad]), name


def test_attention_choice_is_validated():
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=1,
                num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"attention='flash'.*'xla', 'splash', 'cudnn'"):
        ModelConfig(**base, attention="flash")
    with pytest.raises(ValueError, match="cudnn.*bfloat16"):
        ModelConfig(**base, attention="cudnn")
    cfg = ModelConfig(**base, attention="splash")
    # An implementation choice: never in config.json; chosen again when loading.
    hf = config_to_hf(cfg)
    assert "attention" not in hf
    assert config_from_hf(hf, attention="splash") == cfg
    assert config_from_hf(hf) == dataclasses.replace(cfg, attention="xla")
    if jax.default_backend() != "gpu":
        x = jnp.zeros((1, 8, 4, 16), jnp.bfloat16)
        with pytest.raises(ValueError, match="needs a GPU backend"):
            cudnn_attend(x, x[:, :, :2], x[:, :, :2], jnp.zeros((1, 8), jnp.int32))


TINY = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, rope_theta=500.0)


@nnx.jit(static_argnums=(3,))
def _logits_and_prefill(model, ids, mask, max_len):
    full = model(ids, mask_BxT=mask)
    pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    h, cache = model.forward_cached(ids, pos, mask, model.init_cache(ids.shape[0], max_len), 0)
    return full, model.logits_from_hidden(h), cache.keys[-1]


def test_decoder_with_splash_equals_xla():
    """A whole forward and a prefill (T = 40, padded to one 128 block inside splash)."""
    rng = np.random.default_rng(1)
    t = 40
    ids = jnp.asarray(rng.integers(1, TINY.vocab_size, (2, t)), jnp.int32)
    mask = np.zeros((2, t), bool)
    mask[0, 5:], mask[1, :33] = True, True  # left padding; right padding
    mask = jnp.asarray(mask)
    outs = {}
    for impl in ("xla", "splash"):
        model = Decoder(dataclasses.replace(TINY, attention=impl), rngs=nnx.Rngs(0))
        outs[impl] = [np.asarray(a) for a in _logits_and_prefill(model, ids, mask, 48)]
    m = np.asarray(mask)
    scale = np.abs(outs["xla"][0]).max()
    for got, want in zip(outs["splash"][:2], outs["xla"][:2]):
        np.testing.assert_array_less(np.abs(got - want)[m], TOL * scale)
    # The prefill still fills the cache the decode steps read (keys of real tokens).
    k_s, k_x = outs["splash"][2], outs["xla"][2]
    np.testing.assert_array_less(np.abs(k_s - k_x)[..., :t].transpose(0, 3, 1, 2)[m], TOL)


def test_splash_under_a_mesh_equals_one_device(mesh8):
    """Under `jax.set_mesh` the kernel runs per device (batch over data x fsdp, heads over
    tensor) in `shard_map`: the same outputs as without a mesh."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((4, 128, 4, 16), (4, 128, 2, 16), (4, 128, 2, 16)))
    seg = jnp.asarray(np.repeat([[-1] * 8 + [0] * 60 + [1] * 60], 4, axis=0), jnp.int32)
    fn = jax.jit(lambda *a: splash_attend(*a, interpret=True))
    one = np.asarray(fn(q, k, v, seg))
    with jax.set_mesh(mesh8):
        sharded = np.asarray(fn(q, k, v, seg))
    np.testing.assert_array_less(np.abs(sharded - one), TOL)


def test_splash_lowers_for_tpu():
    """Forward + fused backward compile for TPU v5e chips, ahead of time on this host.

    bfloat16, H = 64, T = 300 (padded to 384 inside), on a 2 x 2 (fsdp x tensor) mesh of
    a v5e:2x2 topology: the kernel runs per chip in `shard_map`, with no all-gather.
    """
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(1, 2, 2),
                             ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    t, h = 300, 64

    def loss(q, k, v, seg):
        return jnp.sum(splash_attend(q, k, v, seg, interpret=False).astype(jnp.float32) ** 2)

    shapes = [((4, t, 4, h), jnp.bfloat16), ((4, t, 2, h), jnp.bfloat16),
              ((4, t, 2, h), jnp.bfloat16), ((4, t), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=rows) for s, d in shapes]
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 2  # forward, fused backward
    assert "all-gather" not in hlo


def test_trainers_trace_the_kernel_per_chip_on_their_mesh(mesh8, monkeypatch):
    """A real run's programs (the sampler's prefill, the RL learning program, the SFT
    update) are traced under their mesh (`rljax.sharding.on_mesh`), so the kernel runs per
    chip in `shard_map` there too, and not only where a caller set `jax.set_mesh`."""
    from _train_common import CharTok, tiny_model
    from rljax.train.batching import encode_pairs
    from rljax.models import attention_kernels
    from rljax.train.config import (OptimConfig, RLConfig, SamplingConfig, SFTConfig,
                                    algorithm_preset)
    from rljax.train.rl import RLTrainer
    from rljax.train.sft import SFTTrainer

    seen = []

    def spy(fn, q_BxNxTxH, *rest):
        """Notes the mesh the kernel is traced under. Returns zeros instead of the
        kernel's output: what runs per chip is test_splash_under_a_mesh_equals_one_device's
        subject, and the interpreted kernel's backward would cost this test most of its time."""
        seen.append(dict(jax.sharding.get_abstract_mesh().shape))
        return jnp.zeros_like(q_BxNxTxH)

    monkeypatch.setattr(attention_kernels, "_on_mesh", spy)
    gd, st = tiny_model(mesh=mesh8, attention="splash")
    tok = CharTok()
    tr = RLTrainer(gd, tok, lambda c, m: np.array([len(x) % 2 for x in c], np.float32),
                   algorithm=algorithm_preset("grpo", group_size=2), optim=OptimConfig(lr=1e-3),
                   sampling=SamplingConfig(max_new_tokens=2),
                   rl=RLConfig(steps=1, prompts_per_step=4, logp_chunk=2), prompt_len=8,
                   mesh=mesh8)
    state, m = tr.step(tr.init_state(jax.tree.map(jnp.copy, st)),
                       lambda start, n: (["1+2="] * n, [{}] * n))
    assert np.isfinite(m["loss"])
    sft = SFTTrainer(gd, SFTConfig(steps=1, batch_size=8), mesh=mesh8)
    _, m = sft.step(sft.init_state(st), encode_pairs(tok, ["1+2="] * 8, ["3"] * 8, 4, 2))
    assert np.isfinite(float(m["loss"]))
    want = {"data": 2, "fsdp": 2, "tensor": 2}
    # prefill, learning program (forward + backward), SFT update: each traced on the mesh
    assert len(seen) >= 3 and all(s == want for s in seen), seen


def test_splash_blocks_are_sized_for_the_chip():
    """A padded length up to 1024 runs as one block; longer ones are padded to 512s."""
    from rljax.models.attention_kernels import padded_length, splash_blocks

    assert [padded_length(t) for t in (40, 300, 832, 1024, 1025, 1100)] == [
        128, 384, 896, 1024, 1536, 1536]
    assert splash_blocks(832) == (896, 896)  # was 7 blocks of 128
    assert splash_blocks(1100) == (512, 512)
    assert splash_blocks(512, prefix=320) == (512, 896)  # shared prompt: 384 + 512 keys
    assert splash_blocks(1100, prefix=320) == (512, 128)  # 384 + 1536 keys: 15 x 128


@pytest.mark.parametrize("t", [300, 1100])
def test_splash_matches_attend_at_one_block_and_at_512_blocks(t):
    """T = 300 runs as one 384 block, T = 1100 as 3 x 3 blocks of 512 (1536 padded):
    forward and gradients equal `attend`'s on real rows, in interpret mode."""
    b, n, k, h = 1, 2, 1, 16
    rng = np.random.default_rng(1)
    q, kk, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
                for s in ((b, t, n, h), (b, t, k, h), (b, t, k, h)))
    seg = np.full((b, t), -1, np.int32)
    seg[0, 7:t // 2], seg[0, t // 2:t - 5] = 0, 1
    seg = jnp.asarray(seg)
    real = seg >= 0

    def run(fn):
        def f(q, kk, v):
            o = fn(q, kk, v)
            return _loss(o, real), o
        (_, o), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, kk, v)
        return np.asarray(o), [np.asarray(x) for x in g]

    want_o, want_g = run(lambda q, kk, v: attend(q, kk.transpose(0, 2, 3, 1),
                                                 v.transpose(0, 2, 1, 3), _allowed(seg)))
    got_o, got_g = run(lambda q, kk, v: splash_attend(q, kk, v, seg, interpret=True))
    r = np.asarray(real)
    np.testing.assert_array_less(np.abs(got_o - want_o)[r], TOL)
    for got, want in zip(got_g, want_g):
        np.testing.assert_array_less(np.abs(got - want), TOL * np.abs(want).max())
