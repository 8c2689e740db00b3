"""Explicit matmul precision per dtype path and float32 query scaling (issue 58 part 6).
About 3 s on 2 cores."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models.attention_kernels import scale_queries
from rljax.models.layers import dense, matmul_precision


@pytest.mark.parametrize("dtype, want", [(jnp.float32, "HIGHEST"), (jnp.bfloat16, "DEFAULT")])
def test_dense_states_its_precision(dtype, want):
    x = jax.ShapeDtypeStruct((4, 8), dtype)
    w = jax.ShapeDtypeStruct((8, 16), dtype)
    text = jax.jit(lambda a, b: dense(a, b, preferred_element_type=jnp.float32)).lower(
        x, w).as_text()
    assert matmul_precision(dtype).name == want
    assert f"precision = [{want}, {want}]" in text


def _query_errors(h: int):
    """Max relative error against float32 ``q / sqrt(h)`` of the old path (cast to bf16,
    then scaled in bf16) and the new one (scaled in float32, then cast)."""
    q = jax.random.normal(jax.random.key(0), (4096, h), jnp.float32)
    exact = np.asarray(q * h**-0.5, np.float64)
    old = np.asarray(scale_queries(q.astype(jnp.bfloat16), None), np.float64)
    new = np.asarray(scale_queries((q * h**-0.5).astype(jnp.bfloat16), 1.0), np.float64)
    rel = lambda got: np.max(np.abs(got - exact) / np.abs(exact))  # noqa: E731
    return rel(old), rel(new)


def test_float32_scaling_rounds_once_for_head_dim_128():
    old, new = _query_errors(128)
    assert new <= 2.0**-8  # one bfloat16 rounding: half an ulp of an 8-bit significand
    assert old > 2.0**-8  # two roundings: 128**-0.5 is not a power of two


def test_head_dim_64_was_exact_already():
    old, new = _query_errors(64)  # 64**-0.5 = 1/8: the bf16 multiply is exact
    assert old == new
