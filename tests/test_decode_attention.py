"""The contiguous-cache decode kernel (`paged_triton.decode_attention`) against the einsum
attention of the model's KV cache, in interpret mode on the CPU (on the GPU when present)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.pallas.paged_triton import decode_attention
from jaxllm.kernels.xla import cached_attention


@pytest.mark.parametrize("q_len,hkv,d,max_len,num_splits,in_kernel", [
    (1, 2, 64, 200, None, False),  # GQA 4, a cache length that is no multiple of the block
    (3, 2, 64, 200, 2, False),     # speculative verify: 3 queries per row, split context
    (4, 8, 32, 96, 1, False),      # MHA, a cache shorter than one default block
    (1, 2, 64, 200, 5, True),      # splits merged inside the kernel, counters given
    (3, 2, 64, 200, 3, True),      # the same, 3 queries per row (6 rows per kv head)
])
def test_decode_attention_matches_cached_attention(q_len, hkv, d, max_len, num_splits,
                                                   in_kernel):
    b, hq = 3, 8
    keys = jax.random.split(jax.random.key(q_len * 100 + hkv), 4)
    q = jax.random.normal(keys[0], (b, q_len, hq, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, hkv, max_len, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, hkv, max_len, d), jnp.float32)
    # visible keys of the last query: the shortest possible, a middle one, the whole cache
    lengths = jnp.array([q_len, 77, max_len], jnp.int32)
    positions = lengths[:, None] - q_len + jnp.arange(q_len)[None]
    with jax.default_matmul_precision("highest"):  # no TF32 in the reference on a GPU
        want = cached_attention(q, k, v, positions)
    kw = dict(sm_scale=d**-0.5, num_splits=num_splits, block_k=32,
              merge="kernel" if in_kernel else "xla")
    if in_kernel:  # counters given (as the model's q/k/v kernel writes them)
        kw["counters"] = jnp.zeros((b * hkv,), jnp.int32)
    got = decode_attention(q, k, v, lengths, **kw)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    # keys past a row's length are never read: garbage there changes nothing
    k_bad = k.at[0, :, q_len:].set(jnp.nan)
    got_bad = decode_attention(q, k_bad, v, lengths, **kw)
    np.testing.assert_allclose(got_bad[0], want[0], atol=2e-5, rtol=2e-5)
