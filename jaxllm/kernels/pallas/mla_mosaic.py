"""MLA decode over a paged latent cache: a Pallas kernel with the Mosaic GPU lowering (Hopper).

The same op as mla_triton.py (absorbed multi-head latent attention: every query head
attends over one latent row per token, the key the whole row [Dk], the value its first
v_dim columns), built for Hopper's tensor cores: 64 query heads a CTA as the M of every
wgmma, latent tiles brought into shared memory by TMA, both products issued as
asynchronous wgmma.

One CTA per (block of 64 query heads, split of the context, sequence); query heads are
zero-padded to a multiple of 64. Three warpgroups, warp-specialised:

  producer   loads the Q block [64, Dk] once, then walks the split's tokens block_k at a
             time: reads the page id from the block table and copies the tile's latent
             rows [block_k, Dk] (block_k <= page: part of one page; else several whole
             pages) into a `num_stages`-deep shared-memory ring. The tile is both K and V:
             it is loaded once.
  two compute warpgroups, w = 0, 1: the output accumulator O [64, v_dim] in float32
             is too large for one warpgroup's registers (v_dim 512: 256 a thread), so
             warpgroup w owns O_w = O[:, w*v_dim/2 : (w+1)*v_dim/2]. The score product is
             split along its contraction instead of being done twice: warpgroup 0
             multiplies the first half of the columns of Q and the tile (rounded up to
             a swizzle row: 288 of 576 with 32-token tiles), warpgroup 1 the rest,
             each into a partial S_w [64, block_k] (float32):

    S_w   = Q[:, cols_w] @ tile[:, cols_w]^T          # partial scores, wgmma from SMEM
    S     = S_w + S_(1-w)                              # exchanged through shared memory
    P, m, l: the online softmax of S (base 2), identical in both warpgroups
    O_w   = O_w * alpha + P @ tile[:, v cols of w]     # P from registers, wgmma

The partials are exchanged through a double-buffered shared-memory slot per warpgroup and
one barrier of two arrivals per tile: a warpgroup writes its partial, arrives, waits for
the other's, and adds it. (A slot is written again two tiles later, after the other
warpgroup has passed the next tile's barrier, so it has read it.) The FLOPs stay those of
the op, and each warpgroup holds O_w (128 registers at v_dim 512), S, the other's
partial and P.

Schedule (FlashAttention-3's intra-warpgroup overlap): tile j's partial Q K_j^T and
P_{j-1} V_{j-1} are issued back to back; once the scores are in, the exchange and the
softmax of tile j run while P_{j-1} V_{j-1} is still in the tensor pipe.

Epilogue: each warpgroup divides O_w by l, stages it in bf16 in its own columns of the
spent Q tile (warpgroup w's O columns are columns the other warpgroup's score
products no longer read once the last exchange is passed) and TMA-stores it, 8 heads a
copy (a column slice is contiguous one 8-row tile at a time); warpgroup 0
stores the log-sum-exp. When B x head blocks CTAs would leave SMs idle, the context is
split over several CTAs (flash-decoding): each writes its normalised partial output (in
q's dtype) and log-sum-exp, merged by log-sum-exp after the kernel
(`paged_triton.merge_partials`).

Shared memory at DeepSeek-V3's shape (Dk 576, v_dim 512, bf16, block_k 32, 3 stages):
Q 72 KiB + ring 3 x 36 KiB + exchange 2 x 2 x 8 KiB = 212 KiB of the 225 a CTA may use;
64-token tiles do not fit beside Q and the exchange.

Lengths: `lengths[b] == 0` gives a zero row; lengths past the table's capacity read
only the table's pages. The kernel reads whole tiles: the rows of a tile past the
length are masked out of the softmax (weight 0) but still multiplied, so they must hold
finite values (the cache's pages start zeroed and are only written with finite rows).
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
from jaxllm.kernels.pallas.mla_triton import flat_layers

HEADS = 64  # query heads a CTA: the M of a warpgroup's wgmma
N_WG = 2  # compute warpgroups a CTA
# Registers a thread of the compute / producer warpgroups (2 x 128 compute threads and
# 128 producer threads must fit the SM's 64K registers), as the flash forward.
REGISTERS = (232, 40)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
COL = 64  # a 128-byte swizzle row of 16-bit values: Dk and v_dim / N_WG are multiples


def smem_bytes(dk: int, block_k: int, stages: int, itemsize: int = 2) -> int:
    """Shared memory of the Q block, the latent ring, the exchange slots and the LSE."""
    return ((HEADS + stages * block_k) * dk * itemsize
            + 2 * N_WG * HEADS * block_k * 4 + HEADS * 4)


def swizzle(block_k: int, itemsize: int = 2) -> int:
    """The shared-memory swizzle of Q and the ring: wgmma contracts in groups of a swizzle
    row (128 bytes: 64 16-bit values), and P V contracts over the tile's block_k tokens,
    so 32-token tiles take a 64-byte swizzle."""
    return min(128, block_k * itemsize)


def _smem(shape, dtype, swz: int):
    """Shared memory in the layout wgmma reads: tiles of 8 rows of one swizzle row."""
    cols = swz // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                                plgpu.SwizzleTransform(swz)))


def qk_columns(dk: int, w: int, unit: int) -> tuple[int, int]:
    """(first column, width) of warpgroup w's share of the score contraction, split at a
    multiple of `unit` columns (a swizzle row of Q and the ring: 32 columns with 32-token
    tiles): warpgroup 0 takes the first ceil(Dk / (2 unit)) units, warpgroup 1 the rest,
    so at Dk 576 each takes 288 columns."""
    split = unit * -(-dk // (2 * unit))
    return (0, split) if w == 0 else (split, dk - split)


def _kernel(layer_ref, lengths_ref, tables_ref, q_ref, kv_ref, o_ref, lse_ref,
            q_smem, ring, x_smem, lse_smem, q_bar, kv_bar, kv_free, x_bar, *,
            dk: int, v_dim: int, page: int, bk: int, stages: int, tiles_per_split: int,
            n_table: int, pool_pages: int, scale_log2: float, sim: bool):
    """q_ref [B, Hq_p, Dk]; kv_ref [L * P, page, Dk]; o_ref [B, S, Hq_p, v_dim] (q's
    dtype), lse_ref [B, S, Hq_p] (float32, natural log); see the module docstring."""
    hb, split, b = lax.axis_index("heads"), lax.axis_index("splits"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    dtype = q_smem.dtype
    length = jnp.minimum(lengths_ref[b], n_table * page)
    first = split * tiles_per_split  # the split's first tile
    n_steps = jnp.minimum(mg.cdiv_nonneg(length - first * bk, bk), tiles_per_split)
    vh = v_dim // N_WG

    def consumer(w: int):
        plgpu.set_max_registers(REGISTERS[0], action="increase")
        c0, cw = qk_columns(dk, w, swizzle(bk, dtype.itemsize) // dtype.itemsize)
        q_w = q_smem.at[:, pl.ds(c0, cw)]
        k_w = lambda slot: ring.at[slot, :, pl.ds(c0, cw)]  # noqa: E731
        v_w = lambda slot: ring.at[slot, :, pl.ds(w * vh, vh)]  # noqa: E731
        slot_of = lambda j: lax.rem(j, jnp.int32(stages))  # noqa: E731
        cols = mg.iota((HEADS, bk), 1, sim)

        def exchange(j, s_part):
            """The full scores of tile j from this warpgroup's partial and the other's."""
            par = lax.rem(j, jnp.int32(2))
            x_smem.at[par, w][...] = s_part
            plgpu.barrier_arrive(x_bar)
            plgpu.barrier_wait(x_bar)
            return s_part + x_smem.at[par, 1 - w][...]

        def softmax(j, s, m):
            """Scores of tile j -> (P in float32, new max m (log2 units), rescale alpha).
            Every tile streamed holds a token below the length, so m stays finite."""
            tok = cols + (first + j) * bk
            s = jnp.where(tok < length, s * scale_log2, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            return jnp.exp2(s - mg.bcast_rows(m_new, s.shape)), m_new, alpha

        def first_tile(carry):
            acc, m, l = carry
            plgpu.barrier_wait(kv_bar.at[0])
            s = exchange(0, mg.dot(q_w, k_w(0), trans_b=True, sim=sim))
            p, m, alpha = softmax(0, s, m)
            return acc, m, l * alpha + p.sum(axis=1), p.astype(dtype)

        def step(j, carry):  # issue Q K_j^T and P_{j-1} V_{j-1}; softmax j under P V
            acc, m, l, p_prev = carry
            slot, prev = slot_of(j), slot_of(j - 1)
            plgpu.barrier_wait(kv_bar.at[slot])

            def between(s_part):
                p, m_new, alpha = softmax(j, exchange(j, s_part), m)
                return p.astype(dtype), m_new, l * alpha + p.sum(axis=1), alpha

            acc, (p16, m_new, l_new, alpha) = mg.dot_overlapped(
                q_w, k_w(slot), p_prev, v_w(prev), acc, between, sim=sim)
            plgpu.barrier_arrive(kv_free.at[prev])
            return acc * mg.bcast_rows(alpha, acc.shape), m_new, l_new, p16

        def last_tile(carry):
            acc, m, l, p_prev = carry
            slot = slot_of(n_steps - 1)
            acc = mg.dot(p_prev, v_w(slot), acc=acc, a_ref=False, sim=sim)
            plgpu.barrier_arrive(kv_free.at[slot])
            return acc, m, l

        def pipeline(carry):
            carry = first_tile(carry)
            carry = lax.fori_loop(1, n_steps, step, carry)
            return last_tile(carry)

        rows = plgpu.Layout.WGMMA.reduce(1)
        carry = (mg.zeros((HEADS, vh), sim),
                 mg.layout(jnp.full((HEADS,), -jnp.inf, jnp.float32), rows, sim),
                 mg.layout(jnp.zeros((HEADS,), jnp.float32), rows, sim))
        plgpu.barrier_wait(q_bar)
        acc, m, l = lax.cond(n_steps > 0, pipeline, lambda c: c, carry)

        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o = acc * mg.bcast_rows(1.0 / l_safe, acc.shape)
        # Q is spent: both warpgroups' score products are done once the last exchange
        # is passed (each waited for its own before writing its partial).
        o_smem = q_smem.at[:, pl.ds(w * vh, vh)]
        o_smem[...] = o.astype(dtype)
        if w == 0:
            lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
        plgpu.commit_smem()
        # A column slice of Q is contiguous in shared memory one 8-row tile at a time,
        # and a TMA copy wants contiguous shared memory: one copy per 8 heads.
        for r in range(0, HEADS, 8):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(r, 8)],
                o_ref.at[b, split, pl.ds(hb * HEADS + r, 8), pl.ds(w * vh, vh)],
                commit_group=False)
        if w == 0:
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, split, pl.ds(hb * HEADS, HEADS)],
                                    commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    for w in range(N_WG):  # each warpgroup's column shares are static
        pl.when(wg == w)(functools.partial(consumer, w))

    @pl.when(wg == N_WG)
    def _produce():
        plgpu.set_max_registers(REGISTERS[1], action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(hb * HEADS, HEADS)], q_smem, q_bar)
        produce_tiles(kv_ref, tables_ref, ring, kv_bar, kv_free, b=b,
                      base=layer_ref[0] * pool_pages, first=first, n_steps=n_steps,
                      length=length, bk=bk, page=page, stages=stages)


def produce_tiles(kv_ref, tables_ref, ring, kv_bar, kv_free, *, b, base, first, n_steps,
                  length, bk: int, page: int, stages: int):
    """The producer: latent tiles first, ..., first + n_steps - 1 of sequence b (bk rows
    each, pages from its block table, pool rows from `base`) into the `stages`-deep ring,
    a slot refilled once the consumers free it (kv_free)."""
    rows = min(bk, page)  # rows a copy: part of one page, or one whole page
    last_page = mg.cdiv_nonneg(length, page) - 1

    def issue(j, slot):
        for c in range(bk // rows):
            tok = (first + j) * bk + c * rows
            # pages past the length (a tile of several pages) re-read the last one
            pos = jnp.minimum(lax.div(tok, jnp.int32(page)), last_page)
            src = kv_ref.at[base + tables_ref[b, pos],
                            pl.ds(lax.rem(tok, jnp.int32(page)), rows)]
            dst = ring.at[slot] if rows == bk else ring.at[slot, pl.ds(c * rows, rows)]
            plgpu.copy_gmem_to_smem(src, dst, kv_bar.at[slot])

    for i in range(stages):
        pl.when(i < n_steps)(functools.partial(issue, i, i))

    @pl.loop(0, jnp.maximum(n_steps - stages, 0))
    def _(j):
        slot = lax.rem(j, jnp.int32(stages))
        plgpu.barrier_wait(kv_free.at[slot])
        issue(j + stages, slot)

    # Drain: see the consumers free the last slots, so that every waiting thread has
    # observed all of a barrier's phases when the kernel ends.
    @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
    def _(j):
        plgpu.barrier_wait(kv_free.at[lax.rem(j, jnp.int32(stages))])


def unsupported_reason(q, kv_pages, v_dim: int) -> str | None:
    """Why this kernel cannot take q [B, Hq, Dk] over latent pages [(L,) P, page, Dk]
    with values the first v_dim columns (None if it can); "auto" then picks another."""
    dk, page = q.shape[-1], kv_pages.shape[-2]
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"pallas_mosaic takes bfloat16 or float16; got {jnp.dtype(q.dtype)}"
    if dk % COL:
        return f"Dk={dk} is not a multiple of {COL}"
    if v_dim % (N_WG * COL) or v_dim // N_WG > 256:
        return f"v_dim={v_dim} is not a multiple of {N_WG * COL} up to 512"
    if page < 8 or page & (page - 1):
        return f"page_size={page} is not a power of two >= 8"
    if smem_bytes(dk, 32, 2, jnp.dtype(q.dtype).itemsize) > mg.SMEM_BUDGET:
        return f"Dk={dk}: Q and a 2-stage ring of 32-token tiles exceed shared memory"
    return None


def checked_pool(q, kv_pages, layer, v_dim: int, unsupported, label: str):
    """(pool [L * P, page, Dk], L) of kv_pages once `unsupported` (an unsupported_reason)
    takes the inputs and q's dtype is the pool's; else ValueError naming the `label`
    kernel."""
    kv_pages, n_layers = flat_layers(kv_pages, layer)
    why = unsupported(q, kv_pages, v_dim)
    if why:
        raise ValueError(f"the {label} MLA kernel cannot take these inputs: {why}")
    if q.dtype != kv_pages.dtype:
        raise ValueError(f"q and kv_pages dtypes differ: {q.dtype}, {kv_pages.dtype}")
    return kv_pages, n_layers


def split_tiles(n_tiles: int, num_splits: int) -> tuple[int, int]:
    """(splits, tiles a split): at most one split a tile, then as few splits as the tiles
    a split, rounded up, need."""
    per = -(-n_tiles // max(1, min(num_splits, n_tiles)))
    return -(-n_tiles // per), per


def default_splits(batch: int, hq: int, n_table: int, page: int, sms: int,
                   block_k: int = 32) -> int:
    """The context splits `mla_decode` takes by default for `batch` rows of `hq` heads over
    tables of `n_table` pages of `page` tokens, on a GPU of `sms` SMs: one wave of one CTA
    an SM, at most one split a tile (before its rounding to whole tiles a split)."""
    n_tiles = -(-n_table * page // block_k)
    return max(1, min(sms // (batch * (mg.round_up(hq, HEADS) // HEADS)), n_tiles))


@functools.partial(jax.jit, static_argnames=("v_dim", "sm_scale", "block_k", "num_stages",
                                             "num_splits", "interpret"))
def mla_decode(q, kv_pages, block_tables, lengths, *, v_dim: int, sm_scale: float, layer=None,
               block_k: int | None = None, num_stages: int | None = None,
               num_splits: int | None = None, interpret: bool | None = None):
    """q [B, Hq, Dk]; kv_pages [P, page, Dk] (or a layer stack [L, P, page, Dk] with
    `layer`, read in place); block_tables int32 [B, W]; lengths int32 [B] -> [B, Hq, v_dim]
    in q's dtype: softmax(q kv^T * sm_scale) @ kv[..., :v_dim].

    block_k: tokens a tile (32 or 64; default 32, the most that fits beside Q at Dk 576);
    num_stages: depth of the ring (default: as deep as shared memory allows, at most 3);
    num_splits: CTAs per (sequence, head block) along the context (default: as many as
    fill one wave of one CTA an SM). `interpret` (default: on the CPU) runs the kernel
    in JAX's Mosaic GPU simulator. At <= 32 heads, unless block_k or num_stages is given,
    mla_mosaic_narrow's kernel runs instead (tokens as the products' M: no padded heads).
    """
    from jaxllm.kernels.pallas import mla_mosaic_narrow as narrow
    if (q.shape[1] <= narrow.MAX_HEADS and block_k is None and num_stages is None
            and narrow.unsupported_reason(q, kv_pages, v_dim) is None):
        return narrow.mla_decode(q, kv_pages, block_tables, lengths, v_dim=v_dim,
                                 sm_scale=sm_scale, layer=layer, num_splits=num_splits,
                                 interpret=interpret)
    kv_pages, n_layers = checked_pool(q, kv_pages, layer, v_dim, unsupported_reason,
                                      "pallas_mosaic")
    batch, hq, dk = q.shape
    rows_total, page, _ = kv_pages.shape
    n_table = block_tables.shape[1]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    itemsize = jnp.dtype(q.dtype).itemsize

    block_k = 32 if block_k is None else block_k
    if block_k not in (32, 64):
        raise ValueError(f"block_k={block_k} must be 32 or 64")
    if num_stages is None:
        num_stages = next((s for s in (3, 2) if smem_bytes(dk, block_k, s, itemsize)
                           <= mg.SMEM_BUDGET), 2)
    if num_stages < 2:
        raise ValueError(f"num_stages={num_stages} must be >= 2")
    need = smem_bytes(dk, block_k, num_stages, itemsize)
    if need > mg.SMEM_BUDGET:
        raise ValueError(f"block_k={block_k} with num_stages={num_stages} takes "
                         f"{need // 1024} KiB of shared memory at Dk={dk}; a CTA has "
                         f"{mg.SMEM_BUDGET // 1024} KiB: lower block_k or num_stages")

    hq_p = mg.round_up(hq, HEADS)
    head_blocks = hq_p // HEADS
    n_tiles = -(-n_table * page // block_k)
    if num_splits is None:
        num_splits = default_splits(batch, hq, n_table, page, mg.sm_count(interpret), block_k)
    num_splits, tiles_per_split = split_tiles(n_tiles, num_splits)

    kernel = functools.partial(
        _kernel, dk=dk, v_dim=v_dim, page=page, bk=block_k, stages=num_stages,
        tiles_per_split=tiles_per_split, n_table=n_table, pool_pages=rows_total // n_layers,
        scale_log2=float(sm_scale) * LOG2E, sim=bool(interpret))
    dtype = q.dtype
    swz = swizzle(block_k, itemsize)
    scratch = [
        _smem((HEADS, dk), dtype, swz),
        _smem((num_stages, block_k, dk), dtype, swz),
        mg.smem((2, N_WG, HEADS, block_k), jnp.float32),  # exchange: tile parity, warpgroup
        plgpu.SMEM((HEADS,), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=max(1, block_k // page), num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=N_WG, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=N_WG),
    ]
    out_type = [jax.ShapeDtypeStruct((batch, num_splits, hq_p, v_dim), dtype),
                jax.ShapeDtypeStruct((batch, num_splits, hq_p), jnp.float32)]
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    o, lse = mg.launch(
        kernel, out_type, scratch, grid=(head_blocks, num_splits, batch),
        grid_names=("heads", "splits", "batch"), compute_wgs=N_WG,
        name=f"mla_decode_p{page}_bk{block_k}_st{num_stages}_s{num_splits}",
        interpret=interpret, reduction_scratch=0,
    )(layer, lengths.astype(jnp.int32), block_tables.astype(jnp.int32),
      mg.pad_axis(q, 1, hq_p), kv_pages)
    if num_splits == 1:
        return o[:, 0, :hq]
    return merge_partials(o.astype(jnp.float32), lse).astype(dtype)[:, :hq]
