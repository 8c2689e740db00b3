"""The AVX2 small-batch matmul kernel: values against float64 numpy, tails of every tile
dimension, the threaded path, the max output, NaN, bad input, the off switch, the build."""

import os
import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.kernels import cpu_build, cpu_matmul

ON_X86_AVX2 = (
    platform.system() == "Linux"
    and platform.machine() == "x86_64"
    and {"avx2", "fma"} <= cpu_build._cpu_flags()
    and shutil.which("g++") is not None
)
needs_kernel = pytest.mark.skipif(not ON_X86_AVX2, reason="needs x86-64 Linux, AVX2, g++")

# Each output is a float32 sum of D products; against float64 the error stays below
# D * eps * max|term| summed; for |w| ~ 0.05, |h| ~ 1, D <= 300 this is < 1e-5.
TOL = 1e-5


def _case(n, d, r, seed=0):
    rng = np.random.default_rng(seed)
    w_NxD = (0.05 * rng.standard_normal((n, d))).astype(np.float32)
    h_RxD = rng.standard_normal((r, d)).astype(np.float32)
    return w_NxD, h_RxD, h_RxD.astype(np.float64) @ w_NxD.T.astype(np.float64)


@needs_kernel
def test_available_where_it_can_build():
    assert cpu_matmul.available(), cpu_matmul.unavailable_reason()
    assert cpu_matmul.unavailable_reason() == ""


# (N, D, R): tails of the 6-row panels (N % 6), of the 16-row parts of h (R % 16), odd D,
# a single row, N below one panel, and sizes above the threading threshold (2 N R D >= 4e6).
SHAPES = [(1, 1, 1), (5, 7, 3), (6, 16, 16), (61, 32, 5), (100, 33, 17), (1408, 256, 32),
          (32000, 256, 32), (257, 300, 70)]


@needs_kernel
@pytest.mark.parametrize("n,d,r", SHAPES)
def test_matmul_RxN_equals_float64(n, d, r):
    w, h, ref_RxN = _case(n, d, r)
    y = jax.jit(lambda h, wp: cpu_matmul.matmul_RxN(h, wp, n))(h, cpu_matmul.pack_weight_NxD(w))
    assert y.shape == (r, n) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref_RxN, atol=TOL, rtol=0)


@needs_kernel
@pytest.mark.parametrize("n,d,r", SHAPES)
def test_matmul_NxR_and_its_max_equal_float64(n, d, r):
    w, h, ref_RxN = _case(n, d, r, seed=1)
    y, m = jax.jit(lambda h, wp: cpu_matmul.matmul_NxR(h, wp, n))(h, cpu_matmul.pack_weight_NxD(w))
    assert y.shape == (n, r) and m.shape == (r,)
    np.testing.assert_allclose(np.asarray(y), ref_RxN.T, atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(m), np.asarray(y).max(axis=0))


@needs_kernel
def test_both_packings_give_the_same_panels():
    w, _, _ = _case(100, 33, 1)
    np.testing.assert_array_equal(cpu_matmul.pack_weight_DxN(jnp.asarray(w.T)),
                                  cpu_matmul.pack_weight_NxD(jnp.asarray(w)))
    wp = np.asarray(cpu_matmul.pack_weight_NxD(jnp.asarray(w)))
    assert wp.shape == (17, 33, 6)
    np.testing.assert_array_equal(wp[16, :, 4:], 0.0)  # rows 100, 101 pad the last panel
    np.testing.assert_array_equal(wp[3, :, 2], w[20])  # panel 3, slot 2 is row 20


@needs_kernel
def test_max_propagates_nan_and_handles_minus_inf():
    w, h, _ = _case(50, 8, 20, seed=2)
    h[3, 0] = np.nan  # row 3: every output NaN
    h[5] = -np.inf  # row 5: +-inf and NaN (inf * 0 never occurs: w has no zeros)
    w[7] = 0.0
    y, m = cpu_matmul.matmul_NxR(jnp.asarray(h), cpu_matmul.pack_weight_NxD(jnp.asarray(w)), 50)
    m = np.asarray(m)
    assert np.isnan(m[3]) and np.isnan(m[5])  # row 5: 0 * -inf = NaN at vocab row 7
    keep = [i for i in range(20) if i not in (3, 5)]
    np.testing.assert_array_equal(m[keep], np.asarray(y)[:, keep].max(axis=0))


@needs_kernel
def test_bad_shapes_and_dtypes_are_refused():
    w, h, _ = _case(12, 8, 4)
    wp = cpu_matmul.pack_weight_NxD(jnp.asarray(w))
    with pytest.raises(ValueError, match=r"not \[ceil\(13/6\), D, 6\]"):
        cpu_matmul.matmul_RxN(jnp.asarray(h), wp, 13)
    with pytest.raises(ValueError, match=r"activations \(4, 9\) are not \[R, 8\]"):
        cpu_matmul.matmul_RxN(jnp.zeros((4, 9)), wp, 12)
    with pytest.raises(ValueError, match="float32 rank-2 weight"):
        cpu_matmul.pack_weight_NxD(jnp.zeros((4, 4), jnp.bfloat16))
    with pytest.raises(ValueError, match="float32 rank-2 weight"):
        cpu_matmul.pack_weight_DxN(jnp.zeros((4,), jnp.float32))


def test_switched_off_it_says_so_and_refuses_calls():
    cpu_matmul.set_enabled(False)
    try:
        assert not cpu_matmul.available()
        assert cpu_matmul.unavailable_reason()
        with pytest.raises(RuntimeError, match="CPU kernels are unavailable"):
            cpu_matmul.matmul_RxN(jnp.zeros((2, 8)), jnp.zeros((2, 8, 6)), 12)
    finally:
        cpu_matmul.set_enabled(True)


@needs_kernel
def test_fresh_build_into_an_empty_cache_folder(tmp_path, monkeypatch):
    """The library builds from the packaged source alone, and only whole files land."""
    monkeypatch.setenv("RLJAX_KERNEL_CACHE", str(tmp_path))
    path = cpu_build._library_path()
    assert path.parent == tmp_path and not path.exists()
    cpu_build._build(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert os.path.getsize(path) > 0


@needs_kernel
@pytest.mark.parametrize("n,d,r,block,temperature", [
    (32000, 256, 32, 128, 1.0), (61, 32, 5, 8, 1.0), (1000, 40, 17, 7, 0.7), (5, 4, 2, 3, 2.0),
])
def test_softmax_block_sums_equal_float64(n, d, r, block, temperature):
    """Sums of exp((y - max) / T) over blocks of `block` outputs (the last one shorter)."""
    w, h, _ = _case(n, d, r, seed=3)
    w *= 10.0  # logits spread over ~+-15: many blocks far below the max
    y, m, sums = cpu_matmul.softmax_block_sums(
        jnp.asarray(h), cpu_matmul.pack_weight_NxD(jnp.asarray(w)), n, block, temperature)
    y64 = np.asarray(y, np.float64)
    np.testing.assert_array_equal(np.asarray(m), np.asarray(y).max(axis=0))
    e = np.exp((y64 - y64.max(axis=0)) / temperature)
    ref = np.stack([e[b:b + block].sum(axis=0) for b in range(0, n, block)])
    assert sums.shape == ref.shape
    # float32 sums of <= 128 terms, each exp within 2 ulp: relative 2e-6 of the block sum
    np.testing.assert_allclose(np.asarray(sums), ref, rtol=2e-6, atol=0)


@needs_kernel
def test_kernel_exp_is_within_2_ulp():
    """Block sums of single outputs are the kernel's exp of each logit minus the max (0).
    At D = 1 one group of rows in cache holds 49,152 outputs: fewer here, so no rescaling
    from a group's max to the row max adds its own rounding."""
    x = np.concatenate([np.linspace(-87.3, 0.0, 40_001), [-87.4, -100.0, -np.inf, 0.0]])
    x = x.astype(np.float32)
    _, m, sums = cpu_matmul.softmax_block_sums(
        jnp.ones((1, 1)), cpu_matmul.pack_weight_NxD(jnp.asarray(x[:, None])), x.size, 1)
    assert float(m[0]) == 0.0
    got, ref = np.asarray(sums)[:, 0], np.exp(x.astype(np.float64))
    normal = ref >= np.finfo(np.float32).tiny
    ulp = np.abs(got[normal] - ref[normal]) / np.spacing(ref[normal].astype(np.float32))
    assert ulp.max() <= 2.0, ulp.max()
    np.testing.assert_array_equal(got[~normal], 0.0)  # flushed below the normal range


@needs_kernel
def test_softmax_block_sums_refuse_bad_settings():
    wp = cpu_matmul.pack_weight_NxD(jnp.ones((12, 4)))
    with pytest.raises(ValueError, match="block must be an int >= 0"):
        cpu_matmul.softmax_block_sums(jnp.ones((2, 4)), wp, 12, -1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        cpu_matmul.softmax_block_sums(jnp.ones((2, 4)), wp, 12, 4, 0.0)


@needs_kernel
def test_unwritable_cache_folder_falls_back_to_the_temp_folder(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")  # mkdir under a file fails with an OSError
    monkeypatch.setenv("RLJAX_KERNEL_CACHE", str(blocked / "kernels"))
    monkeypatch.setattr(cpu_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(cpu_build, "_state", {"enabled": True})
    monkeypatch.setattr(cpu_build.jax.ffi, "register_ffi_target", lambda *a, **k: None)
    assert cpu_build.available(), cpu_build.unavailable_reason()
    built = list((tmp_path / "tmp").glob("rljax-*/rljax_cpu-*.so"))
    assert len(built) == 1
