import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import flash_attention, reference


def _qkv(key, b, sq, skv, hq, hkv, d, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, sq, hq, d), dtype),
            jax.random.normal(kk, (b, skv, hkv, d), dtype),
            jax.random.normal(kv, (b, skv, hkv, d), dtype))


def _naive(q, k, v, causal, scale):
    """Independent check: repeat K/V per head and loop nothing clever."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, skv = q.shape[1], k.shape[1]
        mask = np.tril(np.ones((sq, skv), bool), k=skv - sq)
        s = jnp.where(mask, s, -np.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize("sq,skv", [(16, 16), (5, 16), (1, 9)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_impls_match_naive(impl, causal, hq, hkv, sq, skv):
    q, k, v = _qkv(jax.random.key(sq * 7 + hkv), 2, sq, skv, hq, hkv, 16)
    out = flash_attention(q, k, v, causal=causal, impl=impl)
    chex.assert_shape(out, q.shape)
    np.testing.assert_allclose(out, _naive(q, k, v, causal, 16**-0.5), atol=2e-5, rtol=2e-5)


def test_lse_matches_logsumexp():
    q, k, v = _qkv(jax.random.key(3), 1, 6, 6, 2, 1, 8)
    _, lse = reference.flash_attention_with_lse(q, k, v, causal=True)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, 2)) * 8**-0.5
    s = jnp.where(np.tril(np.ones((6, 6), bool)), s, -np.inf)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(s, -1), atol=1e-5)


def test_bad_inputs_raise():
    q, k, v = _qkv(jax.random.key(0), 1, 4, 4, 3, 2, 8)
    with pytest.raises(ValueError, match="not divisible"):
        flash_attention(q, k, v, impl="reference")
    q, k, v = _qkv(jax.random.key(0), 1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="unknown flash attention impl"):
        flash_attention(q, k, v, impl="fast")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="available"):
            flash_attention(q, k, v, impl="cudnn")
    with pytest.raises(ValueError, match="rank 4"):
        flash_attention(q[0], k, v)


def test_paged_reference_matches_contiguous():
    rng = np.random.default_rng(0)
    hkv, hq, d, page, npages, b = 2, 4, 8, 4, 12, 3
    kp = jnp.asarray(rng.normal(size=(hkv, npages, page, d)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(hkv, npages, page, d)), jnp.float32)
    tables = jnp.asarray(rng.permutation(npages)[: b * 3].reshape(b, 3), jnp.int32)
    lengths = jnp.array([0, 5, 12], jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, hq, d)), jnp.float32)
    out = reference.paged_attention(q, kp, vp, tables, lengths)
    np.testing.assert_array_equal(out[0], 0.0)
    for i in (1, 2):
        n = int(lengths[i])
        kc = reference.gather_pages(kp, tables)[i : i + 1, :n]
        vc = reference.gather_pages(vp, tables)[i : i + 1, :n]
        want = _naive(q[i : i + 1, None], kc, vc, False, d**-0.5)[:, 0]
        np.testing.assert_allclose(out[i : i + 1], want, atol=1e-5)
