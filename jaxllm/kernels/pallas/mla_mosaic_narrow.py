"""MLA decode at few query heads (<= 32) on Hopper: the scores transposed, tokens as M.

mla_mosaic.py makes 64 query heads the M of every wgmma and pads fewer heads to 64, so at
16 heads it does four times the products and is bound by them, not by the latent read
(128 us at 16 heads against 126 at 64 on an H100, G1 in docs/performance.md). Here the
64 tokens of a latent tile are the M and the query heads, padded to N = 16 or 32, the N
(a wgmma's N may be that small):

    S^T  = tile @ Q^T                       # [64 tokens, N], wgmma from shared memory
    m, l: per head, over the tile's rows     # column reductions across the warpgroup
    P^T  = exp2(S^T - m)                     # bf16, staged in shared memory (wgmma's B)
    O^T  = O^T * alpha + tile[:, :v]^T @ P^T # v_dim/64 wgmmas of [64, N], A transposed

O^T [v_dim, N] (float32) is v_dim / 64 accumulators of [64, N]: 64 (N 16) or 128 (N 32)
registers a thread at v_dim 512. One CTA per (context split, sequence), one compute
warpgroup and the producer of mla_mosaic (`produce_tiles`): a 2-deep ring of 64-token
tiles (72 KiB each at Dk 576) beside Q [N, Dk] and the output's staging tile [v_dim, N]
(216 KiB at N 32). Every tile is swizzled by 2N bytes, the width of P^T's rows (a wgmma's
operands share a swizzle). Each CTA writes its normalised O^T and log-sum-exp; splits are
merged by log-sum-exp after the kernel.

Not yet timed on a GPU; `impl="pallas_mosaic"` takes it at <= 32 heads, "auto" still
picks the Triton kernel there.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.pallas import mosaic_common as mg
from jaxllm.kernels.pallas.mla_mosaic import checked_pool, produce_tiles, split_tiles
from jaxllm.kernels.pallas.mosaic_common import LN2, LOG2E
from jaxllm.kernels.pallas.paged_triton import merge_partials

MAX_HEADS = 32
BK = 64  # tokens a tile: the M of the score product
STAGES = 2
REGISTERS = (232, 40)


def padded_heads(hq: int) -> int:
    """The N query heads are padded to: 16 or 32."""
    return 16 if hq <= 16 else 32


def smem_bytes(n: int, dk: int, v_dim: int, itemsize: int = 2) -> int:
    """Q, the ring, P^T and the output's staging tile, the LSE, and 2 KiB of reduction
    scratch (the softmax's column reductions cross the warpgroup's warps)."""
    return (n * dk + STAGES * BK * dk + BK * n + v_dim * n) * itemsize + n * 4 + 2048


def _kernel(layer_ref, lengths_ref, tables_ref, q_ref, kv_ref, o_ref, lse_ref,
            q_smem, ring, p_smem, o_smem, lse_smem, q_bar, kv_bar, kv_free, *,
            n: int, v_dim: int, page: int, tiles_per_split: int, n_table: int, pool_pages: int,
            scale_log2: float, sim: bool):
    """q_ref [B, n, Dk]; kv_ref [L * P, page, Dk]; o_ref [B, S, v_dim, n] (O^T, q's
    dtype), lse_ref [B, S, n] (float32, natural log)."""
    split, b, wg = lax.axis_index("splits"), lax.axis_index("batch"), lax.axis_index("wg")
    dtype = q_smem.dtype
    length = jnp.minimum(lengths_ref[b], n_table * page)
    first = split * tiles_per_split
    n_steps = jnp.minimum(mg.cdiv_nonneg(length - first * BK, BK), tiles_per_split)
    n_blk = v_dim // 64

    @pl.when(wg == 0)
    def _compute():
        plgpu.set_max_registers(REGISTERS[0], action="increase")
        rows = mg.iota((BK, n), 0, sim)
        cols = plgpu.Layout.WGMMA.reduce(0)

        def v_t(slot, i):  # V^T's i-th 64-column block of the tile: [64, BK]
            if sim:
                return ring[slot, :, pl.ds(i * 64, 64)].T
            return ring.at[slot, :, pl.ds(i * 64, 64)].transpose((1, 0))

        def tile(j, carry):
            acc, m, l = carry
            slot = lax.rem(j, jnp.int32(STAGES))
            plgpu.barrier_wait(kv_bar.at[slot])
            st = mg.dot(ring.at[slot], q_smem, trans_b=True, sim=sim)  # S^T [BK, n]
            tok = rows + (first + j) * BK
            st = jnp.where(tok < length, st * scale_log2, -jnp.inf)
            m_new = jnp.maximum(m, st.max(axis=0))  # every tile holds a token < length
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(st - mg.bcast_cols(m_new, st.shape))
            l = l * alpha + p.sum(axis=0)
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            acc = list(mg.dots_into(  # every V^T block's product issued, awaited once
                [a * mg.bcast_cols(alpha, a.shape) for a in acc],
                [(i, v_t(slot, i), p_smem) for i in range(n_blk)], sim=sim))
            plgpu.barrier_arrive(kv_free.at[slot])
            return acc, m_new, l

        carry = ([mg.zeros((64, n), sim) for _ in range(n_blk)],
                 mg.layout(jnp.full((n,), -jnp.inf, jnp.float32), cols, sim),
                 mg.layout(jnp.zeros((n,), jnp.float32), cols, sim))
        plgpu.barrier_wait(q_bar)
        acc, m, l = lax.fori_loop(0, n_steps, tile, carry)

        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        for i, a in enumerate(acc):
            o_smem.at[pl.ds(i * 64, 64)][...] = (
                a * mg.bcast_cols(1.0 / l_safe, a.shape)).astype(dtype)
        lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, split], commit_group=False)
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _produce():
        plgpu.set_max_registers(REGISTERS[1], action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, q_bar)
        produce_tiles(kv_ref, tables_ref, ring, kv_bar, kv_free, b=b,
                      base=layer_ref[0] * pool_pages, first=first, n_steps=n_steps,
                      length=length, bk=BK, page=page, stages=STAGES)


def unsupported_reason(q, kv_pages, v_dim: int) -> str | None:
    """Why this kernel cannot take q [B, Hq, Dk] over latent pages [(L,) P, page, Dk] (None
    if it can)."""
    hq, dk, page = q.shape[1], q.shape[-1], kv_pages.shape[-2]
    if hq > MAX_HEADS:
        return f"Hq={hq} is over {MAX_HEADS}"
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it takes bfloat16 or float16; got {jnp.dtype(q.dtype)}"
    if dk % padded_heads(hq) or v_dim % 64:  # a swizzle row of Q is N columns
        return f"Dk={dk} is not a multiple of {padded_heads(hq)} or v_dim={v_dim} of 64"
    if page < 8 or page & (page - 1):
        return f"page_size={page} is not a power of two >= 8"
    if smem_bytes(padded_heads(hq), dk, v_dim, jnp.dtype(q.dtype).itemsize) > mg.SMEM_BUDGET:
        return f"Dk={dk}: Q and a 2-stage ring of {BK}-token tiles exceed shared memory"
    return None


@functools.partial(jax.jit, static_argnames=("v_dim", "sm_scale", "num_splits", "interpret"))
def mla_decode(q, kv_pages, block_tables, lengths, *, v_dim: int, sm_scale: float, layer=None,
               num_splits: int | None = None, interpret: bool | None = None):
    """As mla_mosaic.mla_decode, for q of at most 32 heads. num_splits: CTAs per sequence
    along the context (default: one wave of one CTA an SM)."""
    kv_pages, n_layers = checked_pool(q, kv_pages, layer, v_dim, unsupported_reason,
                                      "narrow pallas_mosaic")
    batch, hq, dk = q.shape
    rows_total, page, _ = kv_pages.shape
    n_table = block_tables.shape[1]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    n_tiles = -(-n_table * page // BK)
    if num_splits is None:
        num_splits = max(1, mg.sm_count(interpret) // batch)
    num_splits, tiles_per_split = split_tiles(n_tiles, num_splits)

    n = padded_heads(hq)
    swizzle = 2 * n  # bytes: P^T's rows
    kernel = functools.partial(
        _kernel, n=n, v_dim=v_dim, page=page, tiles_per_split=tiles_per_split, n_table=n_table,
        pool_pages=rows_total // n_layers, scale_log2=float(sm_scale) * LOG2E,
        sim=bool(interpret))
    dtype = q.dtype
    scratch = [
        mg.smem((n, dk), dtype, swizzle),
        mg.smem((STAGES, BK, dk), dtype, swizzle),
        mg.smem((BK, n), dtype, swizzle),
        mg.smem((v_dim, n), dtype, swizzle),
        plgpu.SMEM((n,), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=max(1, BK // page), num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
    ]
    out_type = [jax.ShapeDtypeStruct((batch, num_splits, v_dim, n), dtype),
                jax.ShapeDtypeStruct((batch, num_splits, n), jnp.float32)]
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    o_t, lse = mg.launch(
        kernel, out_type, scratch, grid=(num_splits, batch), grid_names=("splits", "batch"),
        compute_wgs=1, name=f"mla_decode_narrow_n{n}_p{page}_s{num_splits}",
        interpret=interpret, reduction_scratch=None,
    )(layer, lengths.astype(jnp.int32), block_tables.astype(jnp.int32),
      mg.pad_axis(q, 1, n), kv_pages)
    o = o_t.transpose(0, 1, 3, 2)  # [B, S, n, v_dim]
    if num_splits == 1:
        return o[:, 0, :hq]
    return merge_partials(o.astype(jnp.float32), lse).astype(dtype)[:, :hq]
