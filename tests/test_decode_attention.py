"""`kernels.decode_attention` (its pallas_triton kernel, in interpret mode on the CPU, and
its xla einsums) against the einsum attention over a contiguous cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import decode_attention
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
    kw = dict(impl="pallas_triton", num_splits=num_splits, block_k=32,
              merge="kernel" if in_kernel else "xla")
    if in_kernel:  # counters given (as the model's q/k/v kernel writes them)
        kw["counters"] = jnp.zeros((b * hkv,), jnp.int32)
    got = decode_attention(q, k, v, lengths, **kw)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    # keys past a row's length are never read: garbage there changes nothing
    k_bad = k.at[0, :, q_len:].set(jnp.nan)
    got_bad = decode_attention(q, k_bad, v, lengths, **kw)
    np.testing.assert_allclose(got_bad[0], want[0], atol=2e-5, rtol=2e-5)


def test_xla_impl_and_auto():
    """The einsums (they leave counters unused), and "auto" taking them on the CPU."""
    b, s, hq, hkv, d, t = 2, 2, 4, 2, 16, 12
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (b, s, hq, d))
    k, v = (jax.random.normal(x, (b, hkv, t, d)) for x in keys[1:])
    lengths = jnp.array([2, 9], jnp.int32)
    positions = lengths[:, None] - s + jnp.arange(s)[None]
    want = cached_attention(q, k, v, positions)
    got = decode_attention(q, k, v, lengths, impl="xla", counters=jnp.zeros(b * hkv, jnp.int32))
    np.testing.assert_allclose(got, want, atol=1e-6)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(decode_attention(q, k, v, lengths), got)
