"""rljax.sharding.hlo_cost: FLOPs and HBM bytes read from compiled HLO, loops counted
(experiments/roofline.py's input). About 2 s on 2 cores."""

import jax
import jax.numpy as jnp

from rljax.sharding.hlo_cost import conv_flops, op_costs


def _scan_program(steps: int, b: int = 4, t: int = 32, d: int = 64, f: int = 128):
    def fn(x, w):
        def body(c, _):
            h = jnp.einsum("btd,df->btf", c, w)
            return jnp.einsum("btf,df->btd", h, w), None
        return jax.lax.scan(body, x, None, length=steps)[0]
    args = (jax.ShapeDtypeStruct((b, t, d), jnp.float32),
            jax.ShapeDtypeStruct((d, f), jnp.float32))
    return jax.jit(fn).lower(*args).compile().as_text(), 2 * (2 * b * t * d * f)


def test_loop_bodies_count_once_per_trip():
    hlo, per_step = _scan_program(steps=7)
    ops = op_costs(hlo)
    assert sum(o.flops * o.executions for o in ops) == 7 * per_step
    assert sum(o.flops for o in ops) == per_step  # what cost_analysis() would count
    assert all(o.hbm_bytes >= 0 for o in ops)


def test_unknown_trip_counts_are_asked_for():
    def fn(x):  # a while loop whose trip count depends on the data
        return jax.lax.while_loop(lambda c: c[1] < c[0].sum(), lambda c: (c[0] @ c[0], c[1] + 1),
                                  (x, 0.0))[0]
    hlo = jax.jit(fn).lower(jax.ShapeDtypeStruct((16, 16), jnp.float32)).compile().as_text()
    asked = []
    ops = op_costs(hlo, lambda name, loops: asked.append(name) or 5)
    assert len(asked) == 1
    assert sum(o.flops * o.executions for o in ops) == 5 * 2 * 16**3


def test_convolution_counts_valid_window_positions_only():
    # XLA:TPU's dot written as a convolution with a padded, reversed window over a batch
    # dimension of size 1 (seen in the recipes' programs): one valid position of 2.
    rest = ("%a, %b), window={size=2 pad=1_1 rhs_reversal=1}, dim_labels=bf0_0oi->b0f, "
            "metadata={}")
    assert conv_flops((320, 64, 1), (2, 64, 64), (320, 2, 64), rest) == 2.0 * 320 * 64 * 64 * 2
    plain = "%a, %b), dim_labels=bf_io->bf"
    assert conv_flops((64, 896), (896, 4864), (64, 4864), plain) == 2.0 * 64 * 896 * 4864
