"""Pallas FlashAttention (Triton lowering) against the jnp reference: forward, LSE, gradients.

On the CPU the kernels run in interpret mode with 16-wide tiles, so small shapes still
cover many tiles, the causal diagonal and ragged tails. The GPU-only cases run long
sequences with the tuned tiles, in bf16.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_inputs import flash_inputs
from jaxllm.kernels import flash_attention, reference
from jaxllm.kernels.pallas import flash_triton

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="long sequences and bf16 need the GPU")
TINY = flash_triton.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                               block_q_dq=16, block_k_dq=16)
MIXED = flash_triton.BlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32,
                                block_q_dq=32, block_k_dq=16)




def _check(b, sq, skv, hq, hkv, d, causal, bs, dtype=jnp.float32, tol=2e-4, seed=0):
    q, k, v, do, dlse, seen = flash_inputs(seed, b, sq, skv, hq, hkv, d, causal, dtype)
    opts = {"block_sizes": bs} if bs else {}

    @jax.jit
    def both(q, k, v, do, dlse):
        kern = functools.partial(flash_triton.flash_attention_with_lse, causal=causal, **opts)
        out, vjp = jax.vjp(kern, q, k, v)
        with jax.default_matmul_precision("highest"):
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            ref = functools.partial(reference.flash_attention_with_lse, causal=causal)
            out_ref, vjp_ref = jax.vjp(ref, *f32)
            grads_ref = vjp_ref((do.astype(jnp.float32), dlse))
        return out, vjp((do, dlse)), out_ref, grads_ref

    (o, lse), grads, (o_ref, lse_ref), grads_ref = both(q, k, v, do, dlse)
    assert o.dtype == dtype and lse.dtype == jnp.float32 and lse.shape == (b, hq, sq)
    np.testing.assert_allclose(o[:, seen].astype(jnp.float32), o_ref[:, seen], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[:, :, seen], lse_ref[:, :, seen], atol=tol, rtol=tol)
    if not seen.all():
        np.testing.assert_array_equal(o[:, ~seen], 0.0)
        assert np.isneginf(np.asarray(lse[:, :, ~seen])).all()
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert g.dtype == dtype, name
        scale = float(jnp.abs(g_ref).max())
        # numpy's max, which keeps NaN (XLA's CPU reduction can drop it)
        err = float(np.abs(np.asarray(g, np.float32) - np.asarray(g_ref)).max())
        assert err <= tol * max(1.0, scale), f"d{name}: max error {err} (scale {scale})"


# (b, sq, skv, hq, hkv, d): GQA ratios 1, 4, 8; lengths 1, 37, 130; Sq < Skv and Sq > Skv.
SHAPES = [
    (2, 37, 37, 4, 1, 64),
    (1, 1, 37, 8, 1, 64),
    (1, 130, 130, 2, 2, 128),
    (1, 37, 130, 8, 1, 64),
    (1, 50, 20, 4, 4, 64),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_sq{}_skv{}_hq{}_hkv{}_d{}".format(*s))
def test_matches_reference(shape, causal):
    _check(*shape, causal=causal, bs=TINY)


def test_unequal_tiles_and_padded_head_dim():
    # Forward and backward tiles of different sizes; D = 96 is padded to 128 internally.
    _check(2, 45, 70, 6, 2, 96, causal=True, bs=MIXED)


def test_dispatch_default_tiles_and_overrides():
    q, k, v, *_ = flash_inputs(1, 1, 1, 70, 4, 2, 64, True, jnp.float32)
    want = reference.flash_attention(q, k, v, causal=True)
    # The tuned tiles, clamped to the short sequences; then one tile size overridden.
    for opts in ({}, {"block_k": 32}):
        out = flash_attention(q, k, v, causal=True, impl="pallas_triton", **opts)
        np.testing.assert_allclose(out, want, atol=2e-4, rtol=2e-4)


def test_bad_options_raise():
    q, k, v, *_ = flash_inputs(2, 1, 8, 8, 2, 1, 64, True, jnp.float32)
    with pytest.raises(ValueError, match="block_q=48 must be a power of two"):
        flash_triton.flash_attention(q, k, v, block_q=48)
    with pytest.raises(ValueError, match="unknown pallas_triton options"):
        flash_triton.flash_attention(q, k, v, blok_q=16)
    big = jnp.ones((1, 8, 2, 512))
    assert "head_dim=512" in flash_triton.unsupported_reason(big, big, big)
    assert flash_triton.unsupported_reason(q, k, v) is None
    with pytest.raises(ValueError, match="head_dim=512"):
        flash_triton.flash_attention(big, big[:, :, :1], big[:, :, :1])
    with pytest.raises(ValueError, match="not divisible"):
        flash_attention(q[:, :, :1], k[:, :, :1].repeat(2, 2), v[:, :, :1].repeat(2, 2),
                        impl="pallas_triton")


@gpu_only
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 8, 2, 128), (1, 1000, 2500, 8, 1, 64),
                                   (1, 777, 777, 4, 4, 256)],
                         ids=["gqa4_d128", "mqa_d64_sq_lt_skv", "mha_d256"])
def test_gpu_long_bf16(shape, causal):
    _check(*shape, causal=causal, bs=None, dtype=jnp.bfloat16, tol=3e-2)


@gpu_only
def test_gpu_long_f32_and_f16():
    _check(1, 1000, 1000, 4, 1, 128, causal=True, bs=None, dtype=jnp.float32, tol=1e-3)
    _check(1, 1000, 1000, 4, 1, 64, causal=False, bs=None, dtype=jnp.float16, tol=1e-2)
