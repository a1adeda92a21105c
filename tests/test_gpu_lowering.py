"""The Pallas kernels lower for the GPU (Triton: to Triton IR, then StableHLO; Mosaic GPU) on any
machine: the CPU tests run the kernels in the interpreter, which never sees the Triton
lowering rules, so a kernel can pass them and still fail to lower on a GPU (a fori_loop
index taken modulo with jnp's `%`, for one). Compiling and running stay GPU-only."""
import functools

import jax
import jax.numpy as jnp
import pytest

from jaxllm.kernels.pallas import (flash_mosaic, flash_triton, gemv_triton, gmm_mosaic,
                                   mla_mosaic, paged_triton)

BF16 = jnp.bfloat16


# The device the lowering targets: Pallas Triton on jax >= 0.11 reads the GPU's kind from the
# current (abstract) mesh when no GPU is attached.
_H100 = jax.sharding.AbstractMesh(
    (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))


def _lowers(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    with jax.sharding.use_abstract_mesh(_H100):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("epilogue,rows", [("none", 1), ("glu", 1), ("qkv", 1), ("none", 6)])
def test_decode_gemv_lowers(epilogue, rows):
    k, n, hd = 256, 64, 64
    kw = dict(interpret=False, epilogue=epilogue)
    if epilogue == "none":
        _lowers(functools.partial(gemv_triton.decode_gemv, **kw),
                ((rows, k), BF16), ((n, k), BF16))
        return
    norm = lambda f: lambda x, w, g, *a: f(x, w, *a, norm_scale=g, eps=1e-5)  # noqa: E731
    if epilogue == "glu":
        _lowers(norm(functools.partial(gemv_triton.decode_gemv, **kw)),
                ((rows, k), BF16), ((2, n, k), BF16), ((k,), BF16))
        return

    def qkv(x, w, g, pos, kc, vc):
        return gemv_triton.decode_gemv(x, w, norm_scale=g, eps=1e-5, positions=pos,
                                       inv_freq=jnp.ones(hd // 2), q_heads=4, k_cache=kc,
                                       v_cache=vc, zeros=2 * rows, **kw)
    cache = ((rows, 2, 32, hd), BF16)
    _lowers(qkv, ((rows, k), BF16), ((8, hd, k), BF16), ((k,), BF16), ((rows,), jnp.int32),
            cache, cache)


def test_decode_and_paged_attention_lower():
    _lowers(functools.partial(paged_triton.decode_attention, sm_scale=0.1, interpret=False),
            ((2, 1, 8, 64), BF16), ((2, 2, 256, 64), BF16), ((2, 2, 256, 64), BF16),
            ((2,), jnp.int32))
    _lowers(functools.partial(paged_triton.paged_attention, sm_scale=0.1, interpret=False),
            ((2, 8, 64), BF16), ((2, 32, 16, 64), BF16), ((2, 32, 16, 64), BF16),
            ((2, 8), jnp.int32), ((2,), jnp.int32))
    # the splits merged inside the kernel: barrier, atomic count, the last split's merge
    def merged_in_kernel(q, k, v, lengths, counters):
        return paged_triton.decode_attention(q, k, v, lengths, sm_scale=0.1, num_splits=2,
                                             counters=counters, interpret=False)
    _lowers(merged_in_kernel, ((2, 2, 8, 64), BF16), ((2, 2, 256, 64), BF16),
            ((2, 2, 256, 64), BF16), ((2,), jnp.int32), ((4,), jnp.int32))


def test_flash_triton_forward_and_backward_lower():
    def loss(q, k, v):
        return flash_triton.flash_attention(q, k, v, causal=True, interpret=False).sum()
    _lowers(jax.grad(loss, argnums=(0, 1, 2)), ((1, 128, 4, 64), BF16),
            ((1, 128, 2, 64), BF16), ((1, 128, 2, 64), BF16))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d,skv,opts", [
    (128, 384, {}),  # full attention here takes the overlapped schedule
    (64, 384, {}),
    (256, 384, {}),  # 64-key tiles; dK and dV split over two warpgroups, 64-byte swizzle
    (128, 100, {}),  # one 128-key tile: the forward's ring shrinks to its stream
    (128, 384, dict(block_kv=192)),  # one Q buffer: the 192-key ring takes 192 KiB
    (256, 384, dict(persistent=True)),  # one Q buffer
    (256, 384, dict(fixed_max=False))],  # the running max (not the default)
    ids=["d128", "d64", "d256", "one_key_tile", "kv192", "persistent_d256",
         "running_max_d256"])
def test_flash_mosaic_forward_and_backward_lower(causal, d, skv, opts):
    # Mosaic GPU lowers on any machine too; the simulator the CPU tests use never sees the
    # wgmma/TMA lowering.
    def loss(q, k, v):
        return flash_mosaic.flash_attention(q, k, v, causal=causal, interpret=False,
                                            **opts).astype(jnp.float32).sum()
    _lowers(jax.grad(loss, argnums=(0, 1, 2)), ((1, 256, 4, d), BF16),
            ((1, skv, 2, d), BF16), ((1, skv, 2, d), BF16))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("opts", [{}, dict(overlap_bwd=False), dict(persistent_dq=True)],
                         ids=["default", "serial_bwd", "persistent_dq"])
def test_flash_mosaic_mla_head_dims_lower(causal, opts):
    # MLA's query-key head dim 192 (three 64-column chunks) with value head dim 128: O has
    # its own staging tiles in the forward, dV and dO are narrower than dK and Q
    def loss(q, k, v):
        return flash_mosaic.flash_attention(q, k, v, causal=causal, interpret=False,
                                            **opts).astype(jnp.float32).sum()
    _lowers(jax.grad(loss, argnums=(0, 1, 2)), ((1, 256, 4, 192), BF16),
            ((1, 384, 2, 192), BF16), ((1, 384, 2, 128), BF16))


@pytest.mark.parametrize("opts", [
    {},  # DeepSeek-V3's shape: 32-token tiles (64-byte swizzle), 3 stages, one split
    dict(num_splits=2, num_stages=2)],  # partial outputs and LSE, a 2-stage ring
    ids=["default", "splits"])
def test_mla_mosaic_lowers(opts):
    _lowers(functools.partial(mla_mosaic.mla_decode, v_dim=512, sm_scale=0.1, interpret=False,
                              **opts),
            ((2, 128, 576), BF16), ((40, 64, 576), BF16), ((2, 8), jnp.int32),
            ((2,), jnp.int32))


@pytest.mark.parametrize("heads,page,splits", [(16, 64, 3), (8, 16, 1), (32, 64, 1)])
def test_mla_mosaic_narrow_lowers(heads, page, splits):
    # <= 32 heads: the narrow kernel (tokens as M); pages of 64 (one copy a tile) with
    # split partials, or of 16 (four copies a tile), 8 heads padded to 16; 32 heads
    # (64-byte swizzles, the most shared memory)
    fn = functools.partial(mla_mosaic.mla_decode, v_dim=512, sm_scale=0.1, interpret=False,
                           num_splits=splits)
    shapes = (((2, heads, 576), BF16), ((40, page, 576), BF16), ((2, 8), jnp.int32),
              ((2,), jnp.int32))
    assert "mla_decode_narrow" in str(jax.make_jaxpr(fn)(
        *(jax.ShapeDtypeStruct(*x) for x in shapes)))
    _lowers(fn, *shapes)


def test_mla_mosaic_layer_stack_whole_page_tiles_lower():
    # 64-token tiles (128-byte swizzle) of pages of 16 (four copies a tile), 80 heads
    def stacked(q, kv, tables, lengths, layer):
        return mla_mosaic.mla_decode(q, kv, tables, lengths, v_dim=128, sm_scale=0.1,
                                     layer=layer, block_k=64, num_stages=2, interpret=False)
    _lowers(stacked, ((2, 80, 192), BF16), ((2, 40, 16, 192), BF16), ((2, 8), jnp.int32),
            ((2,), jnp.int32), ((), jnp.int32))


@pytest.mark.parametrize("n,opts,out", [
    (192, {}, BF16),  # 192-column tiles, 3 stages; d lhs: 128-column tiles (K = 128)
    (256, dict(block_m=256, block_n=128), BF16),  # two 128-row warpgroup halves
    (256, dict(num_stages=2), jnp.float32)],  # float32 staging tiles
    ids=["default", "block_m256", "f32_out"])
def test_gmm_mosaic_forward_and_backward_lower(n, opts, out):
    # forward and d lhs: the Mosaic kernels (d lhs reads rhs tiles transposed); d rhs: Triton
    def loss(lhs, rhs, sizes):
        return gmm_mosaic.grouped_matmul(lhs, rhs, sizes, preferred_element_type=out,
                                         interpret=False, **opts).astype(jnp.float32).sum()
    _lowers(jax.grad(loss, argnums=(0, 1)), ((200, 128), BF16), ((3, 128, n), BF16),
            ((3,), jnp.int32))
