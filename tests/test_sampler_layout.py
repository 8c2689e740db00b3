"""The sampler decodes with the inference layout (issue 18, part 3).

On a 2-way fsdp x 2-way tensor mesh the training layout splits every weight's "embed"
dimension over fsdp, and the SPMD partitioner places the weights' all-gathers inside a
decode loop over that layout, at every step (and every layer of the scan). The decode
program, fed the training layout, must gather them once, before its while loops: right
after SPMD partitioning no all-gather inside a loop body makes a weight-sized array.
(The partitioner's output is checked, not the optimised program: XLA:CPU's loop passes
hoist such gathers later, other backends' need not.) A control, the same program traced
without the inference layout (the sampler before it), shows the check finds those
gathers. Sampling on that mesh gives the one-device sampler's tokens and log-probs.
"""

import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, ModelConfig
from rljax.sampling import generate, sampler as sampler_mod
from rljax.sampling.generate import prepare
from rljax.sampling.head import state_vocab_major_weight
from rljax.sharding import MeshConfig, inference_shardings, make_mesh, state_shardings

TOL = 1e-5  # float32 log-probs, sharded vs one device (as in test_sampling_generate)

# Sizes chosen so a weight's per-chip element count (>= 1024) matches no activation's
# in the loop (rows 8, hidden 64, vocab 80: at most 8 x 80 = 640 elements).
CFG = ModelConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, qkv_bias=True, architecture="qwen2",
                  max_position_embeddings=64, scan_layers=True)
PROMPTS = [[5, 9, 2, 33, 7], [11], [40, 41, 42, 43], [3, 3]]
KW = dict(max_new_tokens=20, num_samples=2, top_k=20)  # G = 2: the cache rows repeat


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    train = jax.device_put(state, state_shardings(state, mesh))
    return mesh, model, graphdef, train


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


def _loop_gathers(hlo: str) -> list[tuple[int, ...]]:
    """Output shapes of the all-gathers in while bodies (and what they call)."""
    comps = _computations(hlo)
    todo = [b for text in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", text)]
    assert todo, "the decode program has no while loop"
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [c for c in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)",
                                           comps[name]) if c in comps]
    shapes = []
    for name in seen:
        for dims in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", comps[name]):
            shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes


def _weight_sizes(params, mesh) -> set[int]:
    """Per-chip element counts, in the inference layout, of the weights that the training
    layout splits over fsdp (those a decode step would otherwise gather), whole and per
    layer (a scanned decoder slices its stacked `[L, ...]` weights inside the loop)."""
    sizes = set()
    infer = dict(nnx.to_flat_state(inference_shardings(params, mesh)))
    for path, var in nnx.to_flat_state(params):
        x = var.get_value()
        if "fsdp" in str(x.sharding.spec):
            n = math.prod(infer[path].get_value().shard_shape(x.shape))
            sizes |= {n, n // CFG.num_layers} if path[0] == "layers" else {n}
    return sizes


def _partitioned_decode(decode, mesh, graphdef, train, dump) -> str:
    """The decode program's text right after SPMD partitioning, fed the training layout
    (as inside `rljax.train.programs.device`) and the output weight built from it."""
    batch, spec = prepare(CFG, PROMPTS, **KW)
    prompts = [jax.device_put(x, sampler_mod.logical_sharding(("batch", None), x.shape, mesh))
               for x in (batch.tokens_BxP, batch.mask_BxP, batch.positions_BxP)]
    head = state_vocab_major_weight(train, CFG)
    s, cache, _ = sampler_mod._prefill(graphdef, spec, mesh, train, head, *prompts,
                                       jax.random.key(0))
    decode.lower(graphdef, spec, mesh, train, head, s, cache).compile(compiler_options={
        "xla_dump_to": str(dump), "xla_dump_hlo_pass_re": "spmd-partitioning"})
    (path,) = dump.glob("*jit__decode*after_spmd-partitioning*.txt")
    return path.read_text()


def test_no_weight_all_gather_inside_the_decode_loop(setup, monkeypatch, tmp_path):
    mesh, _, graphdef, train = setup
    weights = _weight_sizes(train, mesh)
    assert min(weights) >= 1024, weights
    hlo = _partitioned_decode(sampler_mod._decode, mesh, graphdef, train, tmp_path / "new")
    gathered = [s for s in _loop_gathers(hlo) if math.prod(s) in weights]
    assert not gathered, f"weights all-gathered inside the decode loop: {gathered}"

    # Control: the same program without the inference layout gathers weights per step.
    monkeypatch.setattr(sampler_mod, "inference_layout", lambda p, h, m: (p, h))

    def _decode(*args):  # a new function: jax would reuse the traced program otherwise
        return sampler_mod._decode.__wrapped__(*args)

    old = jax.jit(_decode, static_argnums=(0, 1, 2), donate_argnums=(5,))
    hlo = _partitioned_decode(old, mesh, graphdef, train, tmp_path / "old")
    gathered = [s for s in _loop_gathers(hlo) if math.prod(s) in weights]
    assert gathered, "the check found no weight all-gather even in the training layout"


def test_scanned_weights_drop_fsdp_and_keep_tensor(setup):
    mesh, _, _, train = setup
    specs = dict(nnx.to_flat_state(inference_shardings(train, mesh)))
    q = specs[("layers", "attn", "q")].get_value().spec  # stacked [L, D, N, H]
    assert tuple(q) == (None, None, "tensor", None), q
    assert tuple(specs[("embed",)].get_value().spec) == ("tensor", None)
    assert all("fsdp" not in str(s.spec) for s in jax.tree.leaves(specs))


def test_mesh_sampler_equals_one_device(setup):
    mesh, model, graphdef, train = setup
    ref = generate(model, PROMPTS, key=jax.random.key(3), **KW)
    res = generate((graphdef, train), PROMPTS, key=jax.random.key(3), **KW)
    assert "fsdp" in str(res.tokens.sharding.spec[0])  # rows over data x fsdp
    np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(res.lengths), np.asarray(ref.lengths))
    for name in ("logprobs", "sampling_logprobs"):
        np.testing.assert_allclose(np.asarray(getattr(res, name)),
                                   np.asarray(getattr(ref, name)), atol=TOL)
    # The caller's parameters stay in the training layout.
    q = dict(nnx.to_flat_state(train))[("layers", "attn", "q")].get_value()
    assert "fsdp" in str(q.sharding.spec)
