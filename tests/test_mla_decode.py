"""The MLA decode kernels against the jnp reference: pallas_triton in interpret mode and
pallas_mosaic in JAX's Mosaic GPU simulator on the CPU; the facade's checks and the
registry's choice.

The simulator runs a kernel's CTAs one after another (a few seconds each here), so the
pallas_mosaic cases keep their grids (sequences x head blocks x splits) small."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import mla_decode, reference, registry
from jaxllm.kernels.pallas import mla_mosaic, mla_triton


def _case(seed, page, hq, dk, lengths, dtype, extra_pages=3):
    """Random q and latent pool; each sequence's pages a random (shuffled) subset of the
    pool. Slots no sequence may read (past its length) are NaN, so reading them shows."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    n = max(1, max(-(-ln // page) for ln in lengths))
    num_pages = b * n + extra_pages
    kv = rng.standard_normal((num_pages, page, dk)).astype(np.float32)
    tables = rng.permutation(num_pages)[: b * n].reshape(b, n).astype(np.int32)
    live = np.zeros((num_pages, page), bool)
    for i, ln in enumerate(lengths):
        for t in range(ln):
            live[tables[i, t // page], t % page] = True
    kv[~live] = np.nan
    q = rng.standard_normal((b, hq, dk)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(tables),
            jnp.asarray(lengths, jnp.int32))


# the reference jitted: one compile instead of one per primitive
_reference = jax.jit(reference.mla_decode, static_argnames=("v_dim", "sm_scale"))


def _close(out, want, dtype):
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


def test_ragged_lengths_shuffled_pages():
    """DeepSeek-V3's latent row (Dk 576 = 512 + 64), bf16, pages of 64, one split."""
    lengths = [0, 1, 63, 64, 65, 197]
    q, kv, tables, lens = _case(0, 64, 16, 576, lengths, jnp.bfloat16)
    out = mla_decode(q, kv, tables, lens, v_dim=512, impl="pallas_triton")
    assert out.shape == (len(lengths), 16, 512) and out.dtype == jnp.bfloat16
    assert not np.isnan(np.asarray(out, np.float32)).any()
    want = _reference(q, jnp.nan_to_num(kv), tables, lens, v_dim=512, sm_scale=576**-0.5)
    _close(out, want, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # length 0 -> zeros


def test_split_context_over_a_layer_stack():
    """float32, a rope part of 8 columns (padded in the kernel), pages of 16: context
    splits (empty ones included) merged by log-sum-exp, two head blocks (the second part
    padding), the layer a traced index names, a table wider than needed."""
    lengths = [0, 1, 15, 16, 17, 70]
    q, kv, tables, lens = _case(1, 16, 20, 72, lengths, jnp.float32)
    stack = jnp.stack([jnp.nan_to_num(kv), kv])  # layer 1: NaN where nothing may read
    wide = jnp.concatenate([tables, jnp.full((6, 2), 10**6, jnp.int32)], axis=1)
    out = jax.jit(lambda layer: mla_decode(q, stack, wide, lens, v_dim=64, sm_scale=0.2,
                                           layer=layer, impl="pallas_triton", block_h=16,
                                           block_k=32, num_splits=4))(jnp.int32(1))
    assert not np.isnan(np.asarray(out)).any()
    want = _reference(q, jnp.nan_to_num(kv), tables, lens, v_dim=64, sm_scale=0.2)
    _close(out, want, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)


def test_bad_inputs_raise():
    q, kv, tables, lens = _case(0, 16, 4, 72, [5, 9], jnp.float32)
    with pytest.raises(ValueError, match="q and kv_pages must share one floating dtype"):
        mla_decode(q, kv.astype(jnp.bfloat16), tables, lens, v_dim=64)
    with pytest.raises(ValueError, match="disagree in Dk"):
        mla_decode(q[..., :64], kv, tables, lens, v_dim=64)
    with pytest.raises(ValueError, match="v_dim=80 must be an int in"):
        mla_decode(q, kv, tables, lens, v_dim=80)
    with pytest.raises(ValueError, match="layer=0 goes with kv pages of rank 4"):
        mla_decode(q, kv, tables, lens, v_dim=64, layer=0)
    with pytest.raises(ValueError, match="lengths"):
        mla_decode(q, kv, tables, lens[:1], v_dim=64)
    with pytest.raises(ValueError, match="block_tables must be integers"):
        mla_decode(q, kv, tables.astype(jnp.float32), lens, v_dim=64)
    with pytest.raises(ValueError, match="v_dim=48 is not a power of two"):
        mla_decode(q, kv, tables, lens, v_dim=48, impl="pallas_triton")
    with pytest.raises(ValueError, match="block_h=8 must be a power of two"):
        mla_triton.mla_decode(q, kv, tables, lens, v_dim=64, sm_scale=0.1, block_h=8)


def test_auto_takes_the_kernels_on_a_gpu(monkeypatch):
    q = jax.ShapeDtypeStruct((2, 128, 576), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((10, 64, 576), jnp.bfloat16)
    monkeypatch.setattr(registry, "_platform", lambda: "cpu")
    assert registry.pick("mla", "auto", q, pages, 512).name == "reference"
    monkeypatch.setattr(registry, "_platform", lambda: "gpu")
    monkeypatch.setattr(registry, "_hopper", lambda: False)
    assert registry.pick("mla", "auto", q, pages, 512).name == "pallas_triton"
    monkeypatch.setattr(registry, "_hopper", lambda: True)
    assert registry.pick("mla", "auto", q, pages, 512).name == "pallas_mosaic"
    q16 = jax.ShapeDtypeStruct((2, 16, 576), jnp.bfloat16)  # 16 heads or fewer: Triton
    assert registry.pick("mla", "auto", q16, pages, 512).name == "pallas_triton"
    q17 = jax.ShapeDtypeStruct((2, 17, 576), jnp.bfloat16)
    assert registry.pick("mla", "auto", q17, pages, 512).name == "pallas_mosaic"
    q32 = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    pages32 = jax.ShapeDtypeStruct(pages.shape, jnp.float32)
    assert registry.pick("mla", "auto", q32, pages32, 512).name == "pallas_triton"  # dtype
    assert registry.pick("mla", "auto", q, pages, 448).name == "reference"  # v_dim


def _finite(kv, value=30.0):
    """The case's pool with the slots no sequence may read set to a large finite value:
    pallas_mosaic reads whole tiles and gives the rows past a length weight 0, so those
    rows must be finite (a leak of these values into the softmax would show)."""
    return jnp.where(jnp.isnan(kv), value, kv).astype(kv.dtype)


def _mosaic_check(q, kv, tables, lens, v_dim, sm_scale, **kw):
    out = mla_mosaic.mla_decode(q, kv, tables, lens, v_dim=v_dim, sm_scale=sm_scale, **kw)
    assert out.shape == (*q.shape[:2], v_dim) and out.dtype == q.dtype
    want = _reference(q, kv[kw["layer"]] if "layer" in kw else kv, tables, lens,
                      v_dim=v_dim, sm_scale=sm_scale)
    _close(out, want, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out[lens == 0], np.float32), 0.0)


@pytest.mark.parametrize("hq", [16, 64])
def test_mosaic_ragged_lengths_shuffled_pages(hq):
    """DeepSeek-V3's latent row (Dk 576 = 512 + 64, v 512), bf16, pages of 64, one split:
    16 heads through the narrow kernel (64-token tiles as the products' M), 64 through the
    kernel of 64 heads a CTA (up to 7 tiles of 32 tokens through its 3-deep ring)."""
    q, kv, tables, lens = _case(0, 64, hq, 576, [0, 1, 63, 64, 65, 197], jnp.bfloat16)
    _mosaic_check(q, _finite(kv), tables, lens, 512, 576**-0.5)


@pytest.mark.parametrize("hq,kw", [(24, {}), (16, dict(block_k=32))],
                         ids=["narrow_n32", "heads_padded"])
def test_mosaic_split_context_over_a_layer_stack(hq, kw):
    """Context splits merged by log-sum-exp (a split that is empty for the short rows),
    pages of 16 (several copies a tile, past the length for 17), a layer stack read at a
    traced layer, a table wider than needed (its extra entries out of the pool: never
    read); 24 heads through the narrow kernel (padded to 32), and 16 padded to 64 with
    32-token tiles. (The lengths around a page: the test above.)"""
    q, kv, tables, lens = _case(1, 16, hq, 192, [0, 17, 70], jnp.bfloat16)
    stack = jnp.stack([jnp.zeros_like(kv), _finite(kv)])
    wide = jnp.concatenate([tables, jnp.full((len(lens), 2), 10**6, jnp.int32)], axis=1)
    out = jax.jit(lambda layer: mla_mosaic.mla_decode(
        q, stack, wide, lens, v_dim=128, sm_scale=0.2, layer=layer, num_splits=2, **kw))(
        jnp.int32(1))
    want = _reference(q, _finite(kv), tables, lens, v_dim=128, sm_scale=0.2)
    _close(out, want, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


def test_mosaic_two_head_blocks_whole_page_tiles():
    """float16, 80 heads (two CTAs of 64, the second mostly padding), 64-token tiles of
    whole pages through a 2-stage ring, through the facade."""
    q, kv, tables, lens = _case(2, 64, 80, 192, [65, 200], jnp.float16)
    out = mla_decode(q, _finite(kv), tables, lens, v_dim=128, impl="pallas_mosaic",
                     block_k=64, num_stages=2)
    want = _reference(q, _finite(kv), tables, lens, v_dim=128, sm_scale=192**-0.5)
    _close(out, want, jnp.float16)


def test_mosaic_bad_inputs_raise():
    q, kv, tables, lens = _case(0, 64, 4, 576, [5, 9], jnp.bfloat16)
    with pytest.raises(ValueError, match="v_dim=320 is not a multiple of 128"):
        mla_mosaic.mla_decode(q, kv, tables, lens, v_dim=320, sm_scale=0.1, block_k=32)
    with pytest.raises(ValueError, match="v_dim=96 is not a multiple of 128"):  # nor 64
        mla_mosaic.mla_decode(q, kv, tables, lens, v_dim=96, sm_scale=0.1)
    from jaxllm.kernels.pallas import mla_mosaic_narrow
    assert "Hq=33 is over 32" in mla_mosaic_narrow.unsupported_reason(
        jnp.zeros((2, 33, 576), jnp.bfloat16), kv, 512)
    with pytest.raises(ValueError, match="block_k=64 with num_stages=2 takes 280 KiB"):
        mla_mosaic.mla_decode(q, kv, tables, lens, v_dim=512, sm_scale=0.1, block_k=64)
    with pytest.raises(ValueError, match="block_k=16 must be 32 or 64"):
        mla_mosaic.mla_decode(q, kv, tables, lens, v_dim=512, sm_scale=0.1, block_k=16)
    assert "bfloat16 or float16" in mla_mosaic.unsupported_reason(
        q.astype(jnp.float32), kv, 512)
