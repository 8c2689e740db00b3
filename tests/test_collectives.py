"""The collective audit on the 8-device CPU mesh: the HLO parser (replica groups, loops,
trip counts), rows per device in the learning program and a decode step, and the rules
of `rljax.sharding.collectives.classify` with a control that compiles the old forms.

XLA's SPMD partitioner decides shardings the same way on CPU as on TPU
(docs/pods.md, "Collective audit"); the TPU figures come from
`experiments/collective_budget.py`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from _train_common import tiny_config
from rljax.models import Decoder, kv_cache_shardings
from rljax.sharding import (batch_sharding, inference_shardings, logical_constraints,
                            state_shardings)
from rljax.sharding.collectives import (Expectation, Loop, activation_rows, classify,
                                        group_axes, parse_collectives, state_parameter_sizes)
from rljax.train.learn.layout import Padded, head_one_pass
from rljax.train.learn.logprobs import linear_logprobs, policy_logprobs
from rljax.train.learn.onepass import one_pass_head
from rljax.train.learn.update import accumulate, batch_constrainer

P_LEN, T_LEN, CHUNK, BATCH, MICRO = 10, 14, 4, 96, 3  # 3 micro-batches of 32 rows
HIDDEN, MLP = 48, 80  # widths no other dimension has: activation_rows reads them
# A vocabulary that splits over tensor, as the recipes' do.
CFG = tiny_config(vocab_size=32, hidden_size=HIDDEN, intermediate_size=MLP, num_heads=4,
                  num_kv_heads=2, scan_layers=True)


def _mesh(data, fsdp, tensor):
    return jax.make_mesh((data, fsdp, tensor), ("data", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)


def _abstract(tree, shardings):
    return jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                        tree, shardings)


def _params(mesh, layout=state_shardings):
    with jax.set_mesh(mesh):
        gd, state = nnx.split(nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0))))
    return gd, state, _abstract(state, layout(state, mesh))


def _ones(aux, logp, ent, start):
    return jnp.ones_like(logp), jnp.zeros_like(ent)


def _compile_learn(mesh, constraints: bool = True):
    """Reference log-probs over micro-batches (`Padded.over_micro`), then `accumulate`'s micro-batch scan over a
    loss through the one-pass head (chunk loops in both)."""
    gd, state, params = _params(mesh)

    def loss_fn(p, mb, coef):
        mask = mb["completion_mask_BxT"]
        surrogate, logp, _ = head_one_pass(Padded(), gd, p, mb, _ones, None, chunk=CHUNK)
        return surrogate + jnp.sum(logp * mask), jnp.sum(mask), {}

    def program(p, batch):
        ref = Padded(num_micro=MICRO).over_micro(
            lambda s: policy_logprobs(gd, p, s, chunk=CHUNK)[0], batch)
        grads, *_ = accumulate(loss_fn, p, batch, None, MICRO, batch_constrainer(mesh))
        return grads, ref

    f32, i32 = jnp.float32, jnp.int32
    batch = {k: jax.ShapeDtypeStruct((BATCH, n), dt, sharding=batch_sharding(mesh))
             for k, n, dt in (("prompt_BxP", P_LEN, i32), ("prompt_mask_BxP", P_LEN, f32),
                              ("completion_BxT", T_LEN, i32),
                              ("completion_mask_BxT", T_LEN, f32))}
    p_sh = jax.tree.map(lambda x: x.sharding, params)
    with jax.set_mesh(mesh), logical_constraints(constraints):
        jitted = jax.jit(program, out_shardings=(p_sh, batch_sharding(mesh)))
        hlo = jitted.lower(params, batch).compile().as_text()
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = BATCH // MICRO // shards
    exp = Expectation(dict(mesh.shape), state_parameter_sizes(state, mesh), MICRO,
                      rows * (P_LEN + T_LEN) * max(HIDDEN, MLP))
    return hlo, rows, exp


@pytest.fixture(scope="module", params=[(1, 8, 1), (1, 4, 2)], ids=["fsdp", "fsdp_tensor"])
def learn(request):
    return _compile_learn(_mesh(*request.param))


@pytest.fixture(scope="module")
def learn_old():
    """The learning program as it was: no residual-stream constraints, one [D, V]
    head-gradient accumulator (`logical_constraints(False)`)."""
    return _compile_learn(_mesh(1, 8, 1), constraints=False)


def _unexpected_in_loops(hlo, exp):
    """``(collective, why)`` for each unexpected collective inside a while loop."""
    return [(c, why) for c in parse_collectives(hlo) if c.loops
            for ok, why in [classify(c, exp)] if not ok]


def test_learning_program_holds_the_ideal_rows_per_device(learn):
    hlo, rows, _ = learn
    assert activation_rows(hlo, P_LEN + T_LEN, (HIDDEN, MLP)) == rows


def test_no_unexpected_collective_inside_a_loop(learn):
    hlo, _, exp = learn
    assert [(c.kind, c.operand_shapes, c.loop_text(), why)
            for c, why in _unexpected_in_loops(hlo, exp)] == []
    kinds = {classify(c, exp)[1] for c in parse_collectives(hlo)}
    assert {"a weight gather", "b gradient reduction"} <= kinds


def test_control_catches_rows_lost_in_micro_batch_loops(learn_old):
    hlo, rows, exp = learn_old
    # Every row of a micro-batch on each chip, so activation-sized collectives over fsdp
    # inside the loops.
    assert activation_rows(hlo, P_LEN + T_LEN, (HIDDEN, MLP)) == BATCH // MICRO > rows
    found = _unexpected_in_loops(hlo, exp)
    assert any(why == "over fsdp" and c.bytes > 2**10 for c, why in found)


def _head_grad_program(mesh, one_pass: bool, constraints: bool):
    """The unexpected collectives of `_head_grad_hlo`."""
    v, d = 40, HIDDEN
    hlo = _head_grad_hlo(mesh, one_pass, constraints)
    exp = Expectation(dict(mesh.shape), {v * d: 1, v * d // 8: 1}, 1, 0)
    return [(c, why) for c in parse_collectives(hlo) for ok, why in [classify(c, exp)]
            if not ok]


def _head_grad_hlo(mesh, one_pass: bool, constraints: bool) -> str:
    """d/dW of a linear head's log-probs over batch-split hidden states, chunked: the
    rows (64 x 4 per chunk) outnumber the vocabulary, so the partitioner reduces dW."""
    b, t, d, v = 64, 3 * CHUNK, HIDDEN, 40
    w = jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=NamedSharding(
        mesh, PartitionSpec(None, "fsdp")))
    h = jax.ShapeDtypeStruct((b, t, d), jnp.float32, sharding=batch_sharding(mesh, 3))
    tgt = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=batch_sharding(mesh))

    def loss(w, h, tgt):
        if one_pass:
            surrogate, logp, _ = one_pass_head(w, h, tgt, _ones, None, vocab_major=True,
                                               chunk=CHUNK)
            return surrogate + jnp.sum(logp)
        return jnp.sum(linear_logprobs(w, h, tgt, vocab_major=True, chunk=CHUNK)[0])

    with jax.set_mesh(mesh), logical_constraints(constraints):
        fn = jax.jit(jax.grad(loss), out_shardings=w.sharding)
        return fn.lower(w, h, tgt).compile().as_text()


@pytest.mark.parametrize("one_pass", [False, True], ids=["linear_logprobs", "one_pass"])
def test_head_gradient_is_reduce_scattered(one_pass):
    """dW [D, V] is summed over the batch shards straight into each chip's D / fsdp slice
    (a reduce-scatter), not all-reduced whole and sliced (twice the bytes)."""
    d, v = HIDDEN, 40
    colls = parse_collectives(_head_grad_hlo(_mesh(1, 8, 1), one_pass, constraints=True))
    reductions = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
    assert [(c.kind, c.bytes) for c in reductions] == [("reduce-scatter", d * v * 4)]


@pytest.mark.parametrize("one_pass", [False, True], ids=["linear_logprobs", "one_pass"])
def test_head_gradient_reduced_once_not_per_chunk(one_pass):
    mesh = _mesh(1, 8, 1)
    assert _head_grad_program(mesh, one_pass, constraints=True) == []
    # The control: one [D, V] accumulator, reduced in every chunk.
    old = _head_grad_program(mesh, one_pass, constraints=False)
    assert any("more than once per micro-batch" in why and c.executions == 3
               for c, why in old)


def test_decode_step_holds_the_ideal_rows_per_device():
    mesh = _mesh(1, 4, 2)
    gd, state, params = _params(mesh, inference_shardings)
    rows = 16
    with jax.set_mesh(mesh):
        cache = jax.eval_shape(lambda: nnx.merge(gd, state).init_cache(rows, P_LEN + T_LEN))
    cache = _abstract(cache, kv_cache_shardings(cache, mesh))

    def step(p, ids, cache):
        model = nnx.merge(gd, p)
        h, cache = model.forward_cached(ids, jnp.zeros_like(ids), ids > 0, cache, P_LEN)
        return model.logits_from_hidden(h), cache

    ids = jax.ShapeDtypeStruct((rows, 1), jnp.int32, sharding=batch_sharding(mesh))
    with jax.set_mesh(mesh):
        hlo = jax.jit(step).lower(params, ids, cache).compile().as_text()
    assert activation_rows(hlo, 1, (HIDDEN, MLP)) == rows // 4


def test_parser_reads_nested_loops_groups_and_bytes():
    mesh = _mesh(2, 2, 2)
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32,
                             sharding=NamedSharding(mesh, PartitionSpec("fsdp", "tensor")))

    def f(x):
        inner = lambda i, acc: acc + jnp.sum(x * i.astype(jnp.float32), axis=0)  # noqa: E731
        outer = lambda j, acc: jax.lax.fori_loop(0, 5, inner, acc)  # noqa: E731
        return jax.lax.fori_loop(0, 3, outer, jnp.zeros(256))

    with jax.set_mesh(mesh):
        hlo = jax.jit(f).lower(x).compile().as_text()
    looped = [c for c in parse_collectives(hlo) if c.loops]
    assert len(looped) == 1
    c = looped[0]
    assert (c.kind, [lp.trip_count for lp in c.loops], c.executions) == ("all-reduce", [3, 5], 15)
    assert group_axes(c, dict(mesh.shape)) == ("fsdp",)
    assert c.bytes == 128 * 4  # 256 floats split over tensor


_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %r = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=GROUPS, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %r)
}

ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8]{0}) tuple(%z, %x)
  ROOT %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


@pytest.mark.parametrize("text,groups", [
    ("mesh['a'=2,'b'=4] {'b'}", {(0, 1, 2, 3), (4, 5, 6, 7)}),
    ("mesh['a'=2,'b'=4] {'a'}", {(0, 4), (1, 5), (2, 6), (3, 7)}),
    ("mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}", {(0, 2, 4, 6), (1, 3, 5, 7)}),
    ("mesh['a'=8] {'a':(2)2}", {(0, 2), (1, 3), (4, 6), (5, 7)}),
    ("[2,4]<=[4,2]T(1,0)", {(0, 2, 4, 6), (1, 3, 5, 7)}),
    ("{{0,1},{2,3},{4,5},{6,7}}", {(0, 1), (2, 3), (4, 5), (6, 7)}),
])
def test_replica_group_formats(text, groups):
    (c,) = parse_collectives(_HLO.replace("GROUPS", text))
    assert set(c.groups) == groups
    assert (c.kind, c.executions, c.bytes) == ("all-reduce", 4, 32)


def test_rules():
    shape = {"data": 1, "fsdp": 4, "tensor": 2}
    exp = Expectation(shape, {1024: 1, 256: 4}, micro_batches=2, activation_elems=4096)

    def coll(kind, groups, n, loops=()):
        return dataclasses.replace(
            parse_collectives(_HLO.replace("GROUPS", "{{0,1}}"))[0], kind=kind,
            groups=groups, operand_shapes=(("f32", (n,)),), result_shapes=(("f32", (n,)),),
            unpadded_shapes=(("f32", (n,)),), loops=tuple(Loop(f"w{i}", t) for i, t in enumerate(loops)))

    over_fsdp = ((0, 2, 4, 6), (1, 3, 5, 7))  # device i = (data, fsdp, tensor) unravelled
    over_tensor = ((0, 1), (2, 3), (4, 5), (6, 7))
    assert classify(coll("all-gather", over_fsdp, 1024), exp) == (True, "a weight gather")
    assert classify(coll("all-gather", over_fsdp, 2048), exp)[0] is False
    assert classify(coll("reduce-scatter", over_fsdp, 256, (2, 4)), exp)[0] is True  # layers
    assert classify(coll("all-reduce", over_fsdp, 1024, (2, 4)), exp)[0] is False  # per chunk
    assert classify(coll("all-reduce", over_tensor, 4096), exp) == (True, "c tensor activation")
    assert classify(coll("all-reduce", over_tensor, 8192), exp)[0] is False
    assert classify(coll("all-to-all", over_fsdp, 256), exp) == (True, "d small")
    # (f) rows between batch shards: an exchange up to one activation; a float all-gather
    # of activations stays unexpected, an integer one (token ids) is rows moved.
    assert classify(coll("all-to-all", over_fsdp, 4096), exp) == (
        True, "f rows between batch shards")
    assert classify(coll("all-to-all", over_fsdp, 8192), exp)[0] is False
    assert classify(coll("all-gather", over_fsdp, 4096), exp)[0] is False
    ids = dataclasses.replace(coll("all-gather", over_fsdp, 4096),
                              operand_shapes=(("s32", (4096,)),))
    assert classify(ids, exp) == (True, "f rows between batch shards")


def test_a_gradient_crosses_dcn_once_per_update():
    """On two slices (data = 2 over DCN) a gradient all-reduce over data may run once per
    update, not once per micro-batch; over fsdp alone (inside a slice) once per
    micro-batch stays fine."""
    shape = {"data": 2, "fsdp": 4, "tensor": 1}
    exp = Expectation(shape, {1024: 1}, micro_batches=4, activation_elems=0, updates=1,
                      dcn_axes=frozenset({"data"}))
    base = parse_collectives(_HLO.replace("GROUPS", "{{0,1}}"))[0]

    def grad(groups, trips):
        return dataclasses.replace(base, kind="all-reduce", groups=groups,
                                   operand_shapes=(("f32", (1024,)),),
                                   result_shapes=(("f32", (1024,)),),
                                   unpadded_shapes=(("f32", (1024,)),),
                                   loops=tuple(Loop("w", t) for t in trips))

    over_data = ((0, 4), (1, 5), (2, 6), (3, 7))
    over_fsdp = ((0, 1, 2, 3), (4, 5, 6, 7))
    assert classify(grad(over_data, ()), exp) == (True, "b gradient reduction")
    assert classify(grad(over_data, (4,)), exp) == (
        False, "gradient crosses DCN 4x, more than once per update")
    assert classify(grad(over_fsdp, (4,)), exp) == (True, "b gradient reduction")
    one_slice = dataclasses.replace(exp, dcn_axes=frozenset())  # control: ICI only
    assert classify(grad(over_data, (4,)), one_slice) == (True, "b gradient reduction")


def test_dcn_sends_are_read_and_held_to_once_per_update():
    """XLA:TPU's cross-slice part of a reduction: a host-transfer send for the megascale
    runtime (the form 0.5b-v5e16x2's learning program has), here inside a loop of 4."""
    send = ('%aa = token[] after-all()\n  %sd = (f32[8,8,128]{2,1,0}, u32[], token[]) '
            'send(%x, %aa), channel_id=2, is_host_transfer=true, frontend_attributes={'
            '_xla_host_transfer_handler_name="xla_megascale_runtime",'
            '_xla_megascale_reduce_operation="SUM",_xla_megascale_transfer_type="ALL_REDUCE"}')
    hlo = _HLO.replace("GROUPS", "{{0,1}}").replace(
        "  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %r)", f"  {send}\n  ROOT %t = (s32[], "
        "f32[8]{0}) tuple(%i, %r)")
    (_, c) = parse_collectives(hlo)
    assert (c.kind, c.bytes, c.executions) == ("dcn-all-reduce", 8 * 8 * 128 * 4, 4)
    shape = {"data": 2, "fsdp": 4, "tensor": 1}
    exp = Expectation(shape, {1024: 1, 256: 2}, micro_batches=4, activation_elems=0)
    assert classify(c, exp) == (False, "over DCN 4x: not a gradient reduction once per "
                                       "update")
    assert classify(c, dataclasses.replace(exp, updates=4)) == (
        True, "e gradient reduction over DCN")  # one per update
    layers = dataclasses.replace(exp, param_sizes={1024: 1, 256: 4})  # the loop: 4 layers
    assert classify(c, layers) == (True, "e gradient reduction over DCN")


def test_a_reduce_scatter_lowered_as_an_all_reduce_of_a_padded_gradient_is_a_reduction():
    """XLA:TPU's form on gsm8k_llama3_grpo/8b-v5p64 (fsdp 8): the gradient [4096, 3584] is
    padded to [4480, 3584] and all-reduced over fsdp, each chip keeping its slice."""
    hlo = _HLO.replace("%r = f32[8]{0} all-reduce(%x)", "%q = f32[400]{0} pad(%x, %zero), "
                       "padding=0_392\n  %r = f32[400]{0} all-reduce(%q)").replace(
        "%x = f32[8]{0} get-tuple-element(%p), index=1",
        "%x = f32[8]{0} get-tuple-element(%p), index=1\n  %zero = f32[] constant(0)").replace(
        "GROUPS", "{{0,2,4,6},{1,3,5,7}}")
    (c,) = parse_collectives(hlo)
    assert c.operand_shapes == (("f32", (400,)),) and c.unpadded_shapes == (("f32", (8,)),)
    shape = {"data": 1, "fsdp": 4, "tensor": 2}
    grads = Expectation(shape, {8: 1}, micro_batches=4, activation_elems=4096)
    assert classify(c, grads) == (True, "b gradient reduction")
    assert classify(c, dataclasses.replace(grads, param_sizes={400: 1}))[0] is False  # control


@pytest.mark.parametrize("sizes", [(1, 8, 1), (2, 2, 2)])
def test_embedding_gradient_needs_no_table_reduction(sizes):
    """The table's gradient is scattered into each chip's own shard after the rows'
    cotangents are moved (an all-to-all): no [V, D] reduction over fsdp; with data 2 only
    the shard's reduction over data. Equal to `jnp.take`'s gradient."""
    import numpy as np

    from rljax.models.decoder import constrain_residual
    from rljax.models.embedding import lookup

    v, d, b, t = 64, 32, 16, 8
    mesh = _mesh(*sizes)
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    w = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    want = jax.grad(lambda tb: jnp.sum(jnp.take(tb, ids, axis=0) * w))(table)
    with jax.set_mesh(mesh):
        sh = NamedSharding(mesh, PartitionSpec("tensor", "fsdp"))
        fn = jax.jit(jax.grad(lambda tb, ids, w: jnp.sum(constrain_residual(lookup(tb, ids))
                                                         * w)), out_shardings=sh)
        args = (jax.device_put(table, sh), jax.device_put(ids, batch_sharding(mesh, 2)),
                jax.device_put(w, batch_sharding(mesh, 3)))
        got = fn(*args)
        hlo = fn.lower(*args).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)
    reductions = [c for c in parse_collectives(hlo) if c.kind in ("all-reduce", "reduce-scatter")]
    shard = v // sizes[2] * d // sizes[1] * 4
    assert all(c.bytes <= shard and group_axes(c, dict(mesh.shape)) == ("data",)
               for c in reductions), [(c.kind, c.bytes) for c in reductions]
    assert len(reductions) == (sizes[0] > 1)
