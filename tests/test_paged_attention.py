"""The pallas_triton paged decode kernel against the jnp reference (interpret mode on the CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import paged_attention, reference
from jaxllm.kernels.pallas import paged_triton


def _case(seed, page_size, hq, hkv, lengths, d=32, extra_pages=3, dtype=jnp.float32):
    """Random q and pool; each sequence's pages are a random (shuffled) subset of the pool.

    Pool slots no sequence may read (past its length) are NaN, so reading them shows.
    """
    rng = np.random.default_rng(seed)
    b = len(lengths)
    n = max(1, max(-(-ln // page_size) for ln in lengths))
    num_pages = b * n + extra_pages
    k = rng.standard_normal((hkv, num_pages, page_size, d)).astype(np.float32)
    v = rng.standard_normal((hkv, num_pages, page_size, d)).astype(np.float32)
    tables = rng.permutation(num_pages)[: b * n].reshape(b, n).astype(np.int32)
    live = np.zeros((num_pages, page_size), bool)
    for i, ln in enumerate(lengths):
        for t in range(ln):
            live[tables[i, t // page_size], t % page_size] = True
    k[:, ~live], v[:, ~live] = np.nan, np.nan
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))


def _ref(q, k, v, tables, lengths, scale=None):
    # The reference reads whole pages; give it the NaN-free pool (masked slots are zeros).
    k0, v0 = jnp.nan_to_num(k), jnp.nan_to_num(v)
    return reference.paged_attention(q, k0, v0, tables, lengths, sm_scale=scale)


@pytest.mark.parametrize("page_size", [8, 16, 64])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2), (16, 2)])
def test_ragged_lengths_shuffled_pages(page_size, hq, hkv):
    p = page_size
    lengths = [0, 1, p - 1, p, p + 1, 3 * p + 5]
    q, k, v, tables, lens = _case(page_size + hq, p, hq, hkv, lengths)
    out = paged_attention(q, k, v, tables, lens, impl="pallas_triton")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(out, _ref(q, k, v, tables, lens), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[0], 0.0)  # length 0 -> zeros


@pytest.mark.parametrize("num_splits,block_k,merge", [(1, 16, "kernel"), (2, 16, "kernel"),
                                                      (4, 32, "xla"), (16, 8, "kernel")])
def test_splits_and_block_sizes(num_splits, block_k, merge):
    """Flash-decoding splits (empty splits included) merge to the same answer, in the
    kernel or after it."""
    lengths = [37, 0, 64, 9, 101]
    q, k, v, tables, lens = _case(num_splits, 8, 8, 2, lengths)
    out = paged_triton.paged_attention(q, k, v, tables, lens, sm_scale=0.3,
                                       num_splits=num_splits, block_k=block_k, merge=merge)
    np.testing.assert_allclose(out, _ref(q, k, v, tables, lens, 0.3), atol=2e-5, rtol=2e-5)


def test_long_context_bf16():
    lengths = [700, 1, 333]
    q, k, v, tables, lens = _case(7, 16, 8, 1, lengths, d=64, dtype=jnp.bfloat16)
    out = paged_attention(q, k, v, tables, lens, impl="pallas_triton")
    assert out.dtype == jnp.bfloat16
    ref = _ref(q, k, v, tables, lens)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)


def test_table_wider_than_needed_and_garbage_entries():
    """Table entries past a sequence's pages may hold anything (here: out-of-range ids)."""
    q, k, v, tables, lens = _case(11, 8, 4, 2, [20, 3])
    wide = jnp.concatenate([tables, jnp.full((2, 5), 10**6, jnp.int32)], axis=1)
    out = paged_triton.paged_attention(q, k, v, wide, lens, sm_scale=32**-0.5, num_splits=3)
    np.testing.assert_allclose(out, _ref(q, k, v, tables, lens), atol=2e-5, rtol=2e-5)


def test_stacked_layer_pool_reads_the_named_layer():
    q, k, v, tables, lens = _case(5, 8, 4, 2, [13, 30, 0])
    k_stack = jnp.stack([jnp.nan_to_num(k) * 0.5, jnp.nan_to_num(k), -jnp.nan_to_num(k)])
    v_stack = jnp.stack([jnp.nan_to_num(v) * 2.0, jnp.nan_to_num(v), jnp.nan_to_num(v) + 1])
    for layer in (2, jnp.int32(0)):
        out = paged_triton.paged_attention(q, k_stack, v_stack, tables, lens, layer=layer,
                                           sm_scale=0.25)
        want = reference.paged_attention(q, k_stack[int(layer)], v_stack[int(layer)], tables,
                                         lens, sm_scale=0.25)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="pass layer="):
        paged_triton.paged_attention(q, k_stack, v_stack, tables, lens, sm_scale=0.25)
    with pytest.raises(ValueError, match="needs k/v pages"):
        paged_triton.paged_attention(q, k, v, tables, lens, layer=0, sm_scale=0.25)


@pytest.mark.parametrize("impl", ["reference", "pallas_triton"])
def test_facade_reads_a_layer_stack(impl):
    q, k, v, tables, lens = _case(6, 8, 4, 2, [13, 30])
    k0, v0 = jnp.nan_to_num(k), jnp.nan_to_num(v)
    k_stack, v_stack = jnp.stack([k0, -k0]), jnp.stack([v0, v0 + 1])
    out = paged_attention(q, k_stack, v_stack, tables, lens, layer=1, impl=impl)
    want = reference.paged_attention(q, -k0, v0 + 1, tables, lens)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


def test_what_the_kernel_cannot_take_raises():
    q, k, v, tables, lens = _case(0, 8, 2, 2, [5], d=24)
    with pytest.raises(ValueError, match="head_dim=24 is not a power of two"):
        paged_attention(q, k, v, tables, lens, impl="pallas_triton")
    q, k, v, tables, lens = _case(0, 12, 2, 2, [5])
    with pytest.raises(ValueError, match="page_size=12 is not a power of two"):
        paged_attention(q, k, v, tables, lens, impl="pallas_triton")


def test_merge_partials_matches_logsumexp():
    rng = np.random.default_rng(0)
    o = jnp.asarray(rng.standard_normal((3, 4, 2, 8)), jnp.float32)  # [B, S, G, D]
    lse = jnp.asarray(rng.standard_normal((3, 4, 2)), jnp.float32)
    lse = lse.at[1].set(-jnp.inf).at[2, 0].set(-jnp.inf)  # an empty row, an empty split
    got = paged_triton.merge_partials(o, lse)
    w = jax.nn.softmax(jnp.where(jnp.isinf(lse), -1e30, lse), axis=1)
    want = jnp.einsum("bsg,bsgd->bgd", w, o).at[1].set(0.0)
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Triton kernel needs a GPU")
def test_gpu_bf16_matches_reference():
    lengths = [0, 1, 15, 16, 17, 4000, 2048, 513]
    q, k, v, tables, lens = _case(3, 16, 32, 8, lengths, d=128, dtype=jnp.bfloat16)
    out = paged_attention(q, k, v, tables, lens, impl="pallas_triton")
    ref = _ref(q, k, v, tables, lens)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)
