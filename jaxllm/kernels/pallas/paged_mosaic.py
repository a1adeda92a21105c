"""Paged decode attention: a Mosaic GPU (Hopper) Pallas kernel, K/V pages streamed by TMA.

One CTA per (sequence, kv head, split): a producer warpgroup walks the split's pages a
step of `block_k` tokens at a time and issues one TMA copy per page (page ids read from
the block table) into a ring of `num_stages` K and V slots; a compute warpgroup runs the
online softmax over each slot with wgmma. The query heads of the GQA group are the first
rows of a 64-row tile (wgmma's smallest M; the other rows are zeros and never stored), so
every K/V page is read once per kv head, whatever the group size.

The ring keeps `num_stages` steps of copies in flight per CTA without a register or a
thread per byte, which is what a decode kernel bound by memory latency needs. Pages of
the last step past the sequence's end are copied from its last page (already in L2) and
masked, so every step's barrier counts the same number of copies.

Splits write their normalised partial output and log-sum-exp (float32); an XLA epilogue
merges them (`paged_triton.merge_partials`). `lengths[b] == 0` gives a zero row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.pallas import mosaic_common as mg
from jaxllm.kernels.pallas.mosaic_common import LN2, LOG2E
from jaxllm.kernels.pallas.paged_triton import merge_partials

_MATH = True  # measurement switch: False skips the math (the consumer only waits and frees
# slots), leaving the bare page stream; read at trace time
ROWS = 64  # wgmma's M: the GQA group's query rows, padded


def _config(page, n_table, block_k, num_stages):
    if block_k is None:
        block_k = max(page, 64)
    if block_k % page or block_k % 64 or block_k > 256:
        raise ValueError(f"block_k={block_k} must be a multiple of page_size={page} and of "
                         f"64, at most 256")
    if num_stages is None:
        num_stages = 2 if block_k >= 128 else 4
    return block_k, num_stages


def _sm_count() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 2


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "num_splits",
                                             "num_stages", "programs", "interpret"))
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale: float,
                    layer=None, block_k: int | None = None, num_splits: int | None = None,
                    num_stages: int | None = None, programs: int | None = None,
                    interpret: bool | None = None):
    """q [B, Hq, D]; k/v pages [Hkv, P, page, D] (or [L, Hkv, P, page, D] with `layer`);
    block_tables [B, n]; lengths [B] -> [B, Hq, D].

    block_k: tokens a ring slot holds (a multiple of the page size and of 64);
    num_stages: ring slots; num_splits: CTAs per (sequence, kv head) along the context
    (default: about two CTAs per SM); programs: CTAs of a persistent grid, each running
    work items pid, pid + programs, ... on one ring (None: one CTA per item)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError(f"k/v pages of shape {k_pages.shape} are a layer stack; pass layer=")
        n_layers, kv_heads = k_pages.shape[:2]
        k_pages, v_pages = (x.reshape(n_layers * kv_heads, *x.shape[2:])
                            for x in (k_pages, v_pages))
    elif layer is not None:
        raise ValueError(f"layer={layer!r} needs k/v pages [L, Hkv, P, page, D]; got "
                         f"{k_pages.shape}")
    else:
        kv_heads = k_pages.shape[0]
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    batch, hq, d = q.shape
    _, num_pages, page, _ = k_pages.shape
    group = hq // kv_heads
    n_table = block_tables.shape[1]
    if d % 64 or d > 256:
        raise ValueError(f"head_dim={d}: the Mosaic paged kernel takes 64, 128, 192 or 256")
    if page % 8:
        raise ValueError(f"page_size={page} must be a multiple of 8")
    if group > ROWS:
        raise ValueError(f"GQA group {group} is larger than {ROWS} rows")
    dtype = jnp.dtype(q.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"the Mosaic paged kernel takes bf16 or f16, not {dtype}")
    bk, stages = _config(page, n_table, block_k, num_stages)
    pps = bk // page  # pages a step
    n_steps_total = pl.cdiv(n_table, pps)
    if num_splits is None:
        num_splits = pl.cdiv(2 * _sm_count(), batch * kv_heads)
    num_splits = max(1, min(num_splits, n_steps_total))
    pages_per_split = pl.cdiv(n_steps_total, num_splits) * pps
    num_splits = pl.cdiv(n_table, pages_per_split)
    rows = mg.round_up(group, 8)  # the rows a TMA moves in and out
    c = sm_scale * LOG2E

    qg = q.reshape(batch, kv_heads, group, d)
    if rows != group:
        qg = mg.pad_axis(qg, 2, rows)

    one = num_splits == 1  # the final output in q's dtype, staged in Q's buffer
    n_items = batch * kv_heads * num_splits
    programs = n_items if programs is None else max(1, min(programs, n_items))

    def kernel(layer_ref, len_ref, tab_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem,
               k_ring, v_ring, *scratch):
        *o_smem, lse_smem, q_bar, k_bar, v_bar, k_free, v_free = scratch
        o_smem = q_smem if one else o_smem[0]
        pid, wg = lax.axis_index("programs"), lax.axis_index("wg")
        n_mine = mg.cdiv_nonneg(n_items - pid, programs)

        def item(i):
            """Work item i of this program: (batch, kv head, split, first token, end token,
            steps); items pid, pid + programs, ... with the split fastest."""
            t = pid + i * programs
            split, rest = lax.rem(t, jnp.int32(num_splits)), lax.div(t, jnp.int32(num_splits))
            h, bi = lax.rem(rest, jnp.int32(kv_heads)), lax.div(rest, jnp.int32(kv_heads))
            length = jnp.minimum(len_ref[bi], n_table * page)
            first_tok = split * (pages_per_split * page)
            end_tok = jnp.minimum(length, first_tok + pages_per_split * page)
            n_steps = mg.cdiv_nonneg(end_tok - first_tok, bk)
            return bi, h, split, first_tok, end_tok, n_steps

        @pl.when(wg == 0)
        def _compute():
            # rows past the group stay finite (zeros, later a staged output): never NaN
            q_smem[...] = mg.zeros((ROWS, d), interpret).astype(dtype)
            plgpu.commit_smem()

            def attend(i, base):
                bi, h, split, first_tok, end_tok, n_steps = item(i)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's output
                plgpu.copy_gmem_to_smem(q_ref.at[bi, h], q_smem.at[pl.ds(0, rows)], q_bar)
                plgpu.barrier_wait(q_bar)

                def step(s, carry, masked):
                    acc, m, l = carry
                    slot = lax.rem(base + s, jnp.int32(stages))
                    if not _MATH:
                        plgpu.barrier_wait(k_bar.at[slot])
                        plgpu.barrier_arrive(k_free.at[slot])
                        plgpu.barrier_wait(v_bar.at[slot])
                        plgpu.barrier_arrive(v_free.at[slot])
                        return carry
                    plgpu.barrier_wait(k_bar.at[slot])
                    sc = mg.dot(q_smem, k_ring.at[slot], trans_b=True, sim=interpret) * c
                    plgpu.barrier_arrive(k_free.at[slot])
                    if masked:
                        cols = mg.iota(sc.shape, 1, interpret) + (first_tok + s * bk)
                        sc = jnp.where(cols < end_tok, sc, -jnp.inf)
                    m_new = jnp.maximum(m, sc.max(axis=1))  # log2 units
                    alpha = jnp.exp2(m - m_new)
                    p = jnp.exp2(sc - mg.bcast_rows(m_new, sc.shape))
                    l = l * alpha + p.sum(axis=1)
                    acc = acc * mg.bcast_rows(alpha, acc.shape)
                    plgpu.barrier_wait(v_bar.at[slot])
                    acc = mg.dot(p.astype(dtype), v_ring.at[slot], acc=acc, a_ref=False,
                                 sim=interpret)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l

                row_layout = plgpu.Layout.WGMMA.reduce(1)
                carry = (mg.zeros((ROWS, d), interpret),
                         mg.layout(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout,
                                   interpret),
                         mg.layout(jnp.zeros((ROWS,), jnp.float32), row_layout, interpret))
                n_full = lax.div(jnp.maximum(end_tok - first_tok, 0), jnp.int32(bk))
                carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
                acc, m, l = lax.fori_loop(n_full, n_steps, functools.partial(step, masked=True),
                                          carry)
                empty = l == 0.0
                l_safe = jnp.where(empty, 1.0, l)
                o = acc * mg.bcast_rows(1.0 / l_safe, acc.shape)
                o_smem[...] = o.astype(o_smem.dtype)
                lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_ref.at[bi, h, split],
                                        commit_group=False)
                plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows)], lse_ref.at[bi, h, split],
                                        commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                return base + n_steps

            lax.fori_loop(0, n_mine, attend, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _produce():
            def stream(i, base):
                """Item i's K/V pages onto ring steps base, base + 1, ...: the ring runs
                on across items without draining."""
                bi, h, split, first_tok, end_tok, n_steps = item(i)
                kv_row = layer_ref[0] * kv_heads + h
                first_page = split * pages_per_split
                last_page = jnp.maximum(mg.cdiv_nonneg(end_tok, page) - 1, 0)

                def page_ids(s):
                    """The step's page ids (past the end: the sequence's last page again,
                    in L2, masked), loaded together so that their latencies overlap."""
                    return tuple(tab_ref[bi, jnp.minimum(first_page + s * pps + i, last_page)]
                                 for i in range(pps))

                def step(s, ids):
                    nxt = page_ids(s + 1)  # a step ahead: the loads run during this step
                    slot = lax.rem(base + s, jnp.int32(stages))

                    @pl.when(base + s >= stages)
                    def _():
                        plgpu.barrier_wait(k_free.at[slot])
                        plgpu.barrier_wait(v_free.at[slot])
                    for j, pg in enumerate(ids):
                        dst = pl.ds(j * page, page)
                        plgpu.copy_gmem_to_smem(k_ref.at[kv_row, pg], k_ring.at[slot, dst],
                                                k_bar.at[slot])
                        plgpu.copy_gmem_to_smem(v_ref.at[kv_row, pg], v_ring.at[slot, dst],
                                                v_bar.at[slot])
                    return nxt

                lax.fori_loop(0, n_steps, step, page_ids(0))
                return base + n_steps

            total = lax.fori_loop(0, n_mine, stream, jnp.int32(0))
            mg.drain(total, stages, [k_free, v_free])

    scratch = [
        mg.smem((ROWS, d), dtype),
        mg.smem((stages, bk, d), dtype), mg.smem((stages, bk, d), dtype),
        *([] if one else [plgpu.SMEM((ROWS, d), jnp.float32)]), plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=pps, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pps, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
    ]
    out_type = [jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, d),
                                     dtype if one else jnp.float32),
                jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32)]
    o, lse = mg.launch(kernel, out_type, scratch,
                       grid=(programs,), grid_names=("programs",),
                       compute_wgs=1, name=f"paged_mgpu_p{page}_bk{bk}_st{stages}",
                       interpret=interpret, reduction_scratch=0)(
        layer, lengths.astype(jnp.int32), block_tables.astype(jnp.int32), qg, k_pages, v_pages)
    o, lse = o[:, :, :, :group], lse[:, :, :, :group]
    out = o[:, :, 0] if one else merge_partials(o, lse)
    return out.astype(dtype).reshape(batch, hq, d)
