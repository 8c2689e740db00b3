"""Sampling with the vocabulary split over "tensor" (rljax.sampling.vocab_shards).

1. For fixed keys the sharded sampler draws the one-device sampler's tokens, in every mode
   (greedy; temperature 1; temperature with top-k and top-p, top-k by per-slice top-k with
   tensor 2 and by bisection with tensor 4), on 10,240 draws each, with tensor 2 and 4.
   V = 301 is a multiple of neither the block size (16) nor tensor, so slices are padded
   and blocks cross slice edges. Log-probs agree to float32 rounding (TOL). No collective
   of these programs moves a vocabulary-sized operand.
2. The compiled decode program (V = 968) on the 8-device CPU mesh (tensor 2 and 4) moves nothing
   vocabulary-sized in a collective inside its loops: every all-gather, all-reduce,
   reduce-scatter, all-to-all and collective-permute there has fewer than
   ``ceil(V / tensor) * rows per chip`` elements. A control, the same program with the
   one-device sampler (what the sampler did before), shows the check catching its
   per-step gather of the logits.

The HLO reader is this file's own (``rljax.sharding`` may grow a general one).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rljax.models import Decoder, ModelConfig
from rljax.sampling import ops, sampler as sampler_mod
from rljax.sampling.generate import prepare
from rljax.sampling.vocab_shards import _Plan, sample_tokens_sharded, vocab_shards
from rljax.sharding import MeshConfig, make_mesh, state_shardings

TOL = 1e-5  # float32 log-probs, sharded vs one device (as tests/test_sampler_layout.py)
V, ROWS = 301, 10_240
MESHES = {2: MeshConfig(data=2, fsdp=2, tensor=2), 4: MeshConfig(data=1, fsdp=2, tensor=4)}
# top_k=40 takes the per-slice top-k with tensor 2 (2 * 40 < 151 tokens a slice) and the
# bisection with tensor 4 (4 * 40 >= 76).
MODES = {
    "greedy": ops.SamplingParams(0.0),
    "temperature 1": ops.SamplingParams(1.0),
    "T, top-k, top-p": ops.SamplingParams(0.7, top_k=40, top_p=0.9),
}


@functools.cache
def _mesh(t):
    return make_mesh(MESHES[t])


@pytest.fixture(scope="module")
def logits_VxR():
    """Rows of three temperatures, quantised to quarter steps so ties are common."""
    rng = np.random.default_rng(0)
    scale = rng.choice([0.5, 2.0, 6.0], size=(1, ROWS))
    return (np.round(rng.normal(0, 1, (V, ROWS)) * scale * 4) / 4).astype(np.float32)


@functools.cache
def _one_device(mode):
    params = MODES[mode]
    return jax.jit(lambda k, x: ops.sample_tokens_VxR(k, x, params))


def test_plan_covers_every_block_once():
    for t in (2, 4, 8):
        p = _Plan.make(V, t)
        assert (p.bs, p.nb, p.L) == (16, 19, -(-V // t))
        assert sum(p.counts) == p.nb and 0 < p.edge < p.bs
        assert all(0 <= o < p.bs for o in p.offsets)
    big = _Plan.make(151_936, 2)  # Qwen2.5's vocabulary: 297 blocks of 512
    assert (big.bs, big.nb, sum(big.counts)) == (512, 297, 297)
    assert vocab_shards(None, V) == 1 and vocab_shards(_mesh(4), 24) == 1  # slice < block


@pytest.mark.parametrize("t", sorted(MESHES))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_sharded_draws_equal_one_device(logits_VxR, mode, t):
    mesh, params, cfg = _mesh(t), MODES[mode], MESHES[t]
    key = jax.random.key(7)
    want = [np.asarray(a) for a in _one_device(mode)(key, jnp.asarray(logits_VxR))]
    x = jax.device_put(logits_VxR, NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"))))
    fn = jax.jit(lambda k, x: sample_tokens_sharded(k, x, params, mesh))
    compiled = fn.lower(key, x).compile()
    got = [np.asarray(a) for a in compiled(key, x)]
    assert got[0].dtype == np.int32 and got[0].max() < V
    np.testing.assert_array_equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0)
    if mode != "greedy":  # the draws are varied: every block is reached
        assert len(np.unique(got[0] // 16)) == 19
    # No collective of the program, loops or not, moves a vocabulary-sized operand.
    found = collectives(compiled.as_text(), loops_only=False)
    assert found and not _vocab_sized(found, V, t, ROWS // (cfg.data * cfg.fsdp)), found


# --- the decode program's collectives -------------------------------------------------

# The model's vocabulary divides by tensor, as Qwen2.5's does, so the head's logits leave it
# split (a vocabulary that does not divide is replicated: nothing to gather). 968 = 31
# blocks of 32 less 24; like Qwen2.5's 297 blocks of 512, an odd number of blocks cannot
# stay split over tensor in the one-device sampler's [blocks, block] reshape, so XLA
# gathers the logits there (with an even number its partitioner keeps them split).
CFG = ModelConfig(vocab_size=968, hidden_size=64, intermediate_size=96, num_layers=1,
                  num_heads=4, num_kv_heads=4, architecture="qwen2",
                  max_position_embeddings=64, scan_layers=True)
PROMPTS = [[5, 9, 2, 33, 7], [11], [40, 41, 42, 43], [3, 3]]
KW = dict(max_new_tokens=8, num_samples=2)  # temperature 1, as the recipes sample
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def _computations(hlo: str) -> dict[str, str]:
    """HLO module text -> {computation name: its body text}."""
    out, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name, out[m.group(1)] = m.group(1), ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def collectives(hlo: str, loops_only: bool = True) -> list[tuple[str, int]]:
    """(kind, largest element count of its result) of every collective of a compiled
    program, or (``loops_only``) of those in a while loop's body or condition, or in what
    they call."""
    comps = _computations(hlo)
    todo = [b for text in comps.values()
            for b in re.findall(r"(?:body|condition)=%?([\w.\-]+)", text)]
    if not loops_only:
        todo = list(comps)
    assert todo, "the program has no while loop"
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen and name in comps:
            seen.add(name)
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[name])
    found = []
    kinds = "|".join(KINDS)
    for name in seen:
        for typ, kind in re.findall(rf"= (.*?) ({kinds})(?:-start)?\(", comps[name]):
            sizes = [math.prod(int(d) for d in dims.split(",") if d)
                     for dims in re.findall(r"\w+\[([\d,]*)\]", typ)]
            found.append((kind, max(sizes, default=0)))
    return found


@pytest.fixture(scope="module")
def model():
    """The decoder's graphdef and abstract state (compiling needs no weights)."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0))))


def _decode_hlo(decode, model, t) -> tuple[str, int]:
    """The compiled decode program's text on the tensor-``t`` mesh (the parameters in the
    training layout, the head built inside), and its rows per chip."""
    graphdef, state = model
    mesh = _mesh(t)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          state, state_shardings(state, mesh))
    batch, spec = prepare(CFG, PROMPTS, **KW)
    prompts = [jax.device_put(x, sampler_mod.logical_sharding(("batch", None), x.shape, mesh))
               for x in (batch.tokens_BxP, batch.mask_BxP, batch.positions_BxP)]
    s, prefix, _ = jax.eval_shape(functools.partial(sampler_mod._prefill, graphdef, spec, mesh),
                                  params, None, *prompts, jax.random.key(0))
    hlo = decode.lower(graphdef, spec, mesh, params, None, s, prefix).compile().as_text()
    return hlo, len(PROMPTS) * KW["num_samples"] // (MESHES[t].data * MESHES[t].fsdp)


def _vocab_sized(found, v, t, rows):
    """The collectives of ``found`` with ``ceil(V / t)`` elements or more per row."""
    return [(k, n) for k, n in found if n >= -(-v // t) * rows]


@pytest.mark.parametrize("t", sorted(MESHES))
def test_no_vocabulary_sized_collective_in_the_decode_loop(model, t):
    hlo, rows = _decode_hlo(sampler_mod._decode, model, t)
    found = collectives(hlo)
    assert any(k == "collective-permute" for k, _ in found), found  # the slices do exchange
    assert not _vocab_sized(found, CFG.vocab_size, t, rows), found


def test_the_check_catches_the_one_device_sampler(model, monkeypatch):
    monkeypatch.setattr(sampler_mod, "sample_tokens_sharded",
                        lambda k, x, p, mesh: ops.sample_tokens_VxR(k, x, p))

    def _decode(*args):  # a new function: jax would reuse the traced program otherwise
        return sampler_mod._decode.__wrapped__(*args)

    old = jax.jit(_decode, static_argnums=(0, 1, 2), donate_argnums=(5,))
    hlo, rows = _decode_hlo(old, model, 2)
    assert _vocab_sized(collectives(hlo), CFG.vocab_size, 2, rows)
