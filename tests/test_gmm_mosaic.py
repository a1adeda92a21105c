"""Grouped matmul with the Mosaic GPU kernels (JAX's Mosaic GPU simulator on the CPU)
against the jnp reference: forward, d lhs (the transposed-rhs kernel) and d rhs (the
Triton transposed kernel it falls back to), and its input checks. Its lowering for the
GPU is in test_gpu_lowering.py.

The simulator is slow, so the shapes are small: 128-row tiles of two 64-row warpgroup
halves, 64-column tiles (two a row tile), two K steps, two persistent programs that each
run several units (the ring's steps run on across units)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import grouped_matmul, pick
from jaxllm.kernels.pallas import gmm_mosaic

# Groups 0 and 3 empty; group 2 (5 rows) inside one warpgroup's half of a tile; group 1
# (37 rows) and 4 (140 rows) straddle tiles and halves; rows 182..199 are past the last
# group (zeros, no gradient); M = 200 is no multiple of the 128-row tile (lhs is padded).
SIZES = (0, 37, 5, 0, 140)
M, K, N = 200, 128, 128
TILES = dict(block_n=64)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((M, K))
    rhs = rng.standard_normal((len(SIZES), K, N)) / np.sqrt(K)
    dout = rng.standard_normal((M, N))
    return (jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16),
            jnp.asarray(SIZES, jnp.int32), jnp.asarray(dout, jnp.bfloat16))


def _out_and_grads(impl, lhs, rhs, sizes, dout, **kw):
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, impl=impl, **kw), lhs, rhs)
    return (out, *vjp(dout))


def test_kernel_matches_reference_forward_and_gradients():
    lhs, rhs, sizes, dout = _inputs()
    got = jax.jit(lambda *a: _out_and_grads("pallas_mosaic", *a, **TILES))(lhs, rhs, sizes,
                                                                            dout)
    f32 = [x.astype(jnp.float32) for x in (lhs, rhs)]
    want = jax.jit(lambda *a: _out_and_grads("reference", *a))(*f32, sizes,
                                                                dout.astype(jnp.float32))
    for name, g, w in zip(("out", "d lhs", "d rhs"), got, want):
        assert g.shape == w.shape and g.dtype == jnp.bfloat16, name
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=1e-2 * scale, rtol=2e-2,
                                   err_msg=name)
    end = sum(SIZES)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[end:], 0.0)
    np.testing.assert_array_equal(np.asarray(got[1], np.float32)[end:], 0.0)
    np.testing.assert_array_equal(np.asarray(got[2], np.float32)[[0, 3]], 0.0)


def test_float32_output_with_wide_tiles():
    # one 128-column tile (bn = N), 256-row tiles of two 128-row halves, f32 staging
    lhs, rhs, sizes, _ = _inputs(1)
    got = jax.jit(lambda a, b, g: grouped_matmul(
        a, b, g, impl="pallas_mosaic", preferred_element_type=jnp.float32, block_m=256,
        block_n=128))(lhs, rhs, sizes)
    want = grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                          impl="reference")
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_bad_inputs_raise_value_error():
    lhs, rhs, sizes, _ = _inputs()
    with pytest.raises(ValueError, match="N=96 must be multiples of 64"):
        grouped_matmul(lhs, rhs[..., :96], sizes, impl="pallas_mosaic")
    with pytest.raises(ValueError, match="float32 inputs"):
        pick("gmm", "pallas_mosaic", lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    with pytest.raises(ValueError, match="block_m=64 must be 128 or 256"):
        gmm_mosaic.grouped_matmul(lhs, rhs, sizes, block_m=64)
    with pytest.raises(ValueError, match="exceeds 64x256; use block_n <= 128"):
        gmm_mosaic.grouped_matmul(lhs, rhs, sizes, block_m=256, block_n=256)
    with pytest.raises(ValueError, match="num_stages=6 .* needs"):
        gmm_mosaic.grouped_matmul(jnp.zeros((128, 2048), jnp.bfloat16),
                                  jnp.zeros((2, 2048, 256), jnp.bfloat16),
                                  jnp.asarray([64, 64], jnp.int32), num_stages=6)
    with pytest.raises(ValueError, match=r"unknown pallas_mosaic options \['block_k'\]"):
        gmm_mosaic.grouped_matmul(lhs, rhs, sizes, block_k=64)


def test_tiles_and_stages_fit_shared_memory():
    assert gmm_mosaic.col_tile(1408, 256) == 128 and gmm_mosaic.col_tile(2048, 256) == 256
    assert gmm_mosaic.col_tile(192, 256) == 192
    bs = gmm_mosaic.BlockSizes()
    assert gmm_mosaic._stages(bs, 256, 2, 2) == 3  # 3 x 48 KiB ring + 64 KiB staging
    assert gmm_mosaic._stages(bs, 128, 2, 2) == 4
    assert gmm_mosaic._stages(bs, 256, 2, 4) == 2  # float32 output: 128 KiB staging
