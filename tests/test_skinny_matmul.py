"""The skinny decode matmul (`kernels/pallas/matmul_triton.py`) against a float32 dot, in
interpret mode on the CPU (on the GPU when present)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.pallas.matmul_triton import skinny_matmul, unsupported_reason


@pytest.mark.parametrize("m,k,n,dtype,split_k", [
    (1, 256, 192, jnp.float32, None),   # one row (batch-1 decode), N not a power of two
    (5, 176, 128, jnp.float32, 2),      # K = 16 x 11: power-of-two slices of 16
    (16, 512, 256, jnp.bfloat16, None),  # the most rows it takes, bf16 in and out
])
def test_skinny_matmul_matches_dot(m, k, n, dtype, split_k):
    kx, kw = jax.random.split(jax.random.key(m * 1000 + k))
    x = jax.random.normal(kx, (m, k), dtype)
    w = jax.random.normal(kw, (k, n), dtype)
    got = skinny_matmul(x, w, split_k=split_k)
    want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-4 if dtype == jnp.float32 else 2e-2  # bf16: the output's rounding
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * 4)


def test_skinny_matmul_refuses_what_it_cannot_take():
    x, w = jnp.ones((17, 64)), jnp.ones((64, 64))
    assert "17 rows" in unsupported_reason(x, w)
    assert "multiple of 64" in unsupported_reason(x[:2], jnp.ones((64, 96)))
    with pytest.raises(ValueError, match="skinny_matmul"):
        skinny_matmul(x, w)
