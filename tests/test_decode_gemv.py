"""The fused decode matmuls (`kernels/pallas/gemv_triton.py`, and `kernels.decode_matmul`
over both impls) against `kernels/reference.decode_gemv`, in interpret mode on the CPU (on
the GPU when present)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import decode_matmul, reference
from jaxllm.kernels.pallas.gemv_triton import (DEFAULT, MAX_ROWS, GemvTuning, decode_gemv,
                                               unsupported_reason)

TOL = {jnp.float32: 2e-4, jnp.bfloat16: 3e-2}


def _close(got, want, dtype):
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)


# CUDA-core products for every row count, or tensor cores for every one (the default
# switches at DEFAULT.fma_rows)
FMA, DOT = GemvTuning(fma_rows=MAX_ROWS), GemvTuning(fma_rows=0)


@pytest.mark.parametrize("m,k,n,dtype,norm,residual,fma", [
    (1, 96, 32, jnp.float32, False, False, FMA),    # K = 32 x 3: 32-wide steps
    (3, 96, 32, jnp.float32, True, True, DOT),      # the same on tensor cores, 3 rows
    (5, 64, 48, jnp.float32, True, True, FMA),      # norm prologue, residual, 5 -> 8 rows
    (16, 128, 32, jnp.bfloat16, True, False, DEFAULT),  # the most rows it takes, bf16
])
def test_plain_and_residual(m, k, n, dtype, norm, residual, fma):
    ks = jax.random.split(jax.random.key(m * 100 + k), 4)
    x = jax.random.normal(ks[0], (m, k), dtype)
    w = (jax.random.normal(ks[1], (n, k)) / k ** 0.5).astype(dtype)
    opts = {}
    if norm:
        opts = dict(norm_scale=1 + 0.1 * jax.random.normal(ks[2], (k,), dtype), eps=1e-5)
    if residual:
        opts["residual"] = jax.random.normal(ks[3], (m, n), dtype)
    got = decode_gemv(x, w, tuning=fma, **opts)
    assert got.shape == (m, n) and got.dtype == dtype
    _close(got, reference.decode_gemv(x, w, **opts), dtype)


@pytest.mark.parametrize("m,dtype,fma", [(1, jnp.bfloat16, DEFAULT), (2, jnp.float32, DOT),
                                         (3, jnp.float32, FMA)])
def test_glu(m, dtype, fma):
    k, r = 64, 48
    ks = jax.random.split(jax.random.key(m), 3)
    x = jax.random.normal(ks[0], (m, k), dtype)
    w = (jax.random.normal(ks[1], (2, r, k)) / k ** 0.5).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(ks[2], (k,), dtype)
    got = decode_gemv(x, w, norm_scale=scale, eps=1e-6, epilogue="glu", tuning=fma)
    assert got.shape == (m, r)
    _close(got, reference.decode_gemv(x, w, norm_scale=scale, eps=1e-6, epilogue="glu"), dtype)


@pytest.mark.parametrize("batch,q_len,hq,hkv,dtype", [
    (1, 1, 4, 2, jnp.bfloat16),  # batch-1 decode, GQA, bf16 (CUDA-core products)
    (2, 3, 2, 1, jnp.float32),   # speculative verify: 3 new tokens per row, MQA (tensor cores)
])
def test_qkv_rope_and_cache_writes(batch, q_len, hq, hkv, dtype):
    k, d, t = 64, 32, 24
    m = batch * q_len
    ks = jax.random.split(jax.random.key(batch * 10 + q_len), 6)
    x = jax.random.normal(ks[0], (m, k), dtype)
    w = (jax.random.normal(ks[1], (hq + 2 * hkv, d, k)) / k ** 0.5).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(ks[2], (k,), dtype)
    k_cache = jax.random.normal(ks[3], (batch, hkv, t, d), dtype)
    v_cache = jax.random.normal(ks[4], (batch, hkv, t, d), dtype)
    start = jax.random.randint(ks[5], (batch,), 0, t - q_len)
    positions = (start[:, None] + jnp.arange(q_len)).reshape(m)
    inv_freq = 10000.0 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    opts = dict(norm_scale=scale, eps=1e-5, epilogue="qkv", positions=positions,
                inv_freq=inv_freq, q_len=q_len, q_heads=hq)
    want = reference.decode_gemv(x, w, k_cache=k_cache, v_cache=v_cache, **opts)
    # with the attention kernel's split counters (zeros) as a fourth output
    *got, zeros = decode_gemv(x, w, k_cache=k_cache, v_cache=v_cache, zeros=3 * hkv, **opts)
    assert got[0].shape == (m, hq, d)
    for g, wnt in zip(got, want):  # q, then every cache entry: new rows and untouched ones
        _close(g, wnt, dtype)
    np.testing.assert_array_equal(zeros, np.zeros(3 * hkv, np.int32))


def test_refuses_what_it_cannot_take():
    x = jnp.ones((17, 64))
    assert "17 rows" in unsupported_reason(x, jnp.ones((32, 64)))
    assert "multiple of 16" in unsupported_reason(x[:2, :40], jnp.ones((32, 40)))
    assert "output size" in unsupported_reason(x[:2], jnp.ones((24, 64)))
    with pytest.raises(ValueError, match="epilogue"):
        decode_gemv(x[:2], jnp.ones((32, 64)), epilogue="gelu")
    with pytest.raises(ValueError, match="norm_scale and eps"):
        decode_gemv(x[:2], jnp.ones((32, 64)), norm_scale=jnp.ones(64))
    with pytest.raises(ValueError, match="q_heads"):
        decode_gemv(x[:2], jnp.ones((5, 32, 64)), epilogue="qkv", q_heads=2)
    with pytest.raises(ValueError, match="zeros go with"):
        decode_gemv(x[:2], jnp.ones((32, 64)), zeros=4)


@pytest.mark.parametrize("prefetch,rows", [(0, 4), (2, (1, 2, 2))])
def test_cuda_core_launch_settings(prefetch, rows):
    """Loads issued 0 or 2 K steps ahead of their products (the last steps drain the queue),
    outputs per program given once or per epilogue: the same numbers."""
    tuning = dataclasses.replace(FMA, prefetch=prefetch, fma_block_rows=rows,
                                 fma_elems=256)  # K = 128 in 4 steps of 32
    ks = jax.random.split(jax.random.key(prefetch), 4)
    x = jax.random.normal(ks[0], (2, 128), jnp.float32)
    w = jax.random.normal(ks[1], (32, 128)) / 128 ** 0.5
    res = jax.random.normal(ks[2], (2, 32))
    _close(decode_gemv(x, w, residual=res, tuning=tuning),
           reference.decode_gemv(x, w, residual=res), jnp.float32)
    wg = jax.random.normal(ks[3], (2, 16, 128)) / 128 ** 0.5
    g = jnp.ones((128,))
    _close(decode_gemv(x, wg, epilogue="glu", norm_scale=g, eps=1e-5, tuning=tuning),
           reference.decode_gemv(x, wg, epilogue="glu", norm_scale=g, eps=1e-5), jnp.float32)


def test_tuning_is_checked():
    assert DEFAULT.of("num_warps", "none") == 8 and DEFAULT.of("num_stages", "qkv") == 3
    with pytest.raises(ValueError, match="one per epilogue"):
        GemvTuning(num_warps=(4, 4))
    with pytest.raises(ValueError, match="block_k=0 must be ints >= 1"):
        GemvTuning(block_k=0)
    with pytest.raises(ValueError, match="must be a gemv_triton.GemvTuning"):
        decode_gemv(jnp.ones((1, 64)), jnp.ones((32, 64)), tuning="fast")


@pytest.mark.parametrize("impl", ["xla", "pallas_triton"])
def test_decode_matmul_impls(impl):
    """The facade over both impls: every epilogue, the q/k/v one with its zeros output."""
    batch, hq, hkv, k, d, t = 2, 2, 1, 64, 32, 8
    ks = jax.random.split(jax.random.key(7), 8)
    x = jax.random.normal(ks[0], (batch, k), jnp.float32)
    scale = 1 + 0.1 * jax.random.normal(ks[1], (k,))
    norm = dict(norm_scale=scale, eps=1e-5)
    w = jax.random.normal(ks[2], (32, k)) / k ** 0.5
    res = jax.random.normal(ks[3], (batch, 32))
    _close(decode_matmul(x, w, residual=res, impl=impl, **norm),
           reference.decode_gemv(x, w, residual=res, **norm), jnp.float32)
    wg = jax.random.normal(ks[4], (2, 16, k)) / k ** 0.5
    _close(decode_matmul(x, wg, epilogue="glu", impl=impl, **norm),
           reference.decode_gemv(x, wg, epilogue="glu", **norm), jnp.float32)
    wqkv = jax.random.normal(ks[5], (hq + 2 * hkv, d, k)) / k ** 0.5
    caches = dict(k_cache=jax.random.normal(ks[6], (batch, hkv, t, d)),
                  v_cache=jax.random.normal(ks[7], (batch, hkv, t, d)))
    opts = dict(epilogue="qkv", positions=jnp.array([3, 5]), q_heads=hq,
                inv_freq=10000.0 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d), **norm)
    *got, zeros = decode_matmul(x, wqkv, zeros=batch * hkv, impl=impl, **opts, **caches)
    for g, want in zip(got, reference.decode_gemv(x, wqkv, **opts, **caches)):
        _close(g, want, jnp.float32)
    np.testing.assert_array_equal(zeros, np.zeros(batch * hkv, np.int32))


def test_decode_matmul_checks_its_arguments():
    x, w = jnp.ones((2, 64)), jnp.ones((32, 64))
    with pytest.raises(ValueError, match="epilogue='gelu'"):
        decode_matmul(x, w, epilogue="gelu")
    with pytest.raises(ValueError, match="zeros go with"):
        decode_matmul(x, w, zeros=4, impl="xla")
    with pytest.raises(ValueError, match="needs positions"):
        decode_matmul(x, jnp.ones((4, 32, 64)), epilogue="qkv", q_heads=2)
    with pytest.raises(ValueError, match="cannot take these inputs: 17 rows"):
        decode_matmul(jnp.ones((17, 64)), w, impl="pallas_triton")
