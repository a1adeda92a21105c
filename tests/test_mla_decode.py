"""The pallas_triton MLA decode kernel against the jnp reference (interpret mode on the CPU),
the facade's checks and the registry's choice."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import mla_decode, reference, registry
from jaxllm.kernels.pallas import mla_triton


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


def test_auto_takes_the_kernel_on_a_gpu(monkeypatch):
    q = jax.ShapeDtypeStruct((2, 128, 576), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((10, 64, 576), jnp.bfloat16)
    assert registry.pick("mla", "auto", q, pages, 512).name == "reference"  # the CPU
    monkeypatch.setattr(registry, "_platform", lambda: "gpu")
    assert registry.pick("mla", "auto", q, pages, 512).name == "pallas_triton"
    assert registry.pick("mla", "auto", q, pages, 384).name == "reference"  # v_dim
