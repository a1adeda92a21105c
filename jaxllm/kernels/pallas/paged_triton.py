"""Paged decode attention: a Pallas kernel with the Triton lowering.

One program per (sequence, kv head, split). The program loads the query heads of its
GQA group once, as a [G, D] tile padded to at least 16 rows so the score and value
products run on tensor cores, then walks its share of the sequence's pages a few pages
per step: the step's page ids come from the block table, its K and V rows are gathered
with masked loads (tokens past the sequence length are never read), and an online
softmax in float32 (base-2 exponentials) accumulates the output. Every K/V page is read
once per kv head, whatever the group size.

Long contexts are split across programs (flash-decoding): each split writes its
normalised partial output and log-sum-exp, and a small jnp epilogue merges them. With a
single split the kernel writes the final output directly.

`lengths[b] == 0` gives a zero output row; lengths past the block table's capacity read
only the table's pages (as the reference does).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_NEG = -1e30  # finite "minus infinity" for masked scores and empty running maxima
_MIN_ROWS = 16  # tl.dot wants at least 16 rows


def _decode_kernel(layer_ref, lengths_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *lse_ref,
                   group: int, kv_heads: int,
                   page_size: int, pages_per_step: int, pages_per_split: int, n_table: int,
                   scale_log2: float, allow_tf32: bool):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_row = layer_ref[0] * kv_heads + h  # k/v are [layers * Hkv, tokens, D]
    rows, head_dim = q_ref.shape
    block_k = pages_per_step * page_size
    row_ok = jnp.arange(rows) < group

    length = jnp.minimum(lengths_ref[b], n_table * page_size)
    first_page = split * pages_per_split
    n_pages = jnp.minimum(pl.cdiv(length, page_size) - first_page, pages_per_split)
    n_steps = pl.cdiv(jnp.maximum(n_pages, 0), pages_per_step)

    q = pltriton.load(q_ref, mask=jnp.broadcast_to(row_ok[:, None], (rows, head_dim)), other=0)
    tok = jnp.arange(block_k)
    cols = jnp.broadcast_to(jnp.arange(head_dim)[None, :], (block_k, head_dim))

    def step(i, carry):
        acc, m, l = carry
        page_pos = first_page + i * pages_per_step + tok // page_size  # [block_k]
        valid = page_pos * page_size + tok % page_size < length
        page = pltriton.load(tables_ref.at[b, page_pos], mask=valid, other=0)
        kv_rows = jnp.broadcast_to((page * page_size + tok % page_size)[:, None],
                                   (block_k, head_dim))
        kv_mask = jnp.broadcast_to(valid[:, None], (block_k, head_dim))
        k = pltriton.load(k_ref.at[kv_row, kv_rows, cols], mask=kv_mask, other=0)
        v = pltriton.load(v_ref.at[kv_row, kv_rows, cols], mask=kv_mask, other=0)

        # scores [rows, block_k] in log2 units
        s = pltriton.dot(q, k, trans_b=True, allow_tf32=allow_tf32) * scale_log2
        s = jnp.where(valid[None, :], s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + pltriton.dot(p.astype(v.dtype), v, allow_tf32=allow_tf32)
        return acc, m_new, l

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_steps, step, init)

    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[:, None]
    pltriton.store(o_ref, out.astype(o_ref.dtype),
                   mask=jnp.broadcast_to(row_ok[:, None], (rows, head_dim)))
    if lse_ref:
        lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * _LN2, -jnp.inf)
        pltriton.store(lse_ref[0], lse, mask=row_ok)


def _sm_count() -> int:
    dev = jax.devices()[0]
    if dev.platform != "gpu":  # the interpreter: a few splits keep the split path exercised
        return 2
    return int(getattr(dev, "core_count", 0) or 132)


def _pick_splits(batch: int, kv_heads: int, n_steps_total: int) -> int:
    """Enough programs to fill the GPU a few times over, but >= 2 steps per split."""
    want = pl.cdiv(4 * _sm_count(), batch * kv_heads)
    return max(1, min(want, n_steps_total // 2 if n_steps_total >= 4 else 1))


def merge_partials(o_parts, lse_parts):
    """Merge split outputs by log-sum-exp: o_parts [..., S, G, D] f32, lse [..., S, G]."""
    mx = lse_parts.max(axis=-2, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse_parts - mx)  # 0 for empty splits
    den = w.sum(axis=-2)
    num = (w[..., None] * o_parts).sum(axis=-3)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale: float,
                    layer=None, block_k: int | None = None, num_splits: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    interpret: bool | None = None):
    """q [B, Hq, D]; k/v pages [Hkv, P, page, D]; block_tables [B, n]; lengths [B] -> [B, Hq, D].

    k/v pages may also be a whole layer stack [L, Hkv, P, page, D] with `layer` in [0, L)
    (an int or a traced int32 scalar, e.g. the index inside a scan over layers): the kernel
    reads that layer in place, so no per-layer slice of the pool is ever copied.
    block_k: tokens per inner step (a multiple of the page size, default ~128);
    num_splits: programs per (sequence, kv head) along the context (default: fill the GPU).
    """
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError(f"k/v pages of shape {k_pages.shape} are a layer stack; pass layer=")
        n_layers = k_pages.shape[0]
        k_pages, v_pages = (x.reshape(n_layers * x.shape[1], *x.shape[2:])
                            for x in (k_pages, v_pages))
        kv_heads = k_pages.shape[0] // n_layers
    elif layer is not None:
        raise ValueError(f"layer={layer!r} needs k/v pages [L, Hkv, P, page, D]; got "
                         f"{k_pages.shape}")
    else:
        kv_heads = k_pages.shape[0]
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    batch, hq, head_dim = q.shape
    rows_total, num_pages, page_size, _ = k_pages.shape
    n_table = block_tables.shape[1]
    group = hq // kv_heads
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if page_size & (page_size - 1) or head_dim & (head_dim - 1):
        raise ValueError(f"page_size={page_size} and head_dim={head_dim} must be powers of two "
                         f"for the pallas_triton paged kernel")

    if block_k is None:
        block_k = max(page_size, 128)
    if block_k % page_size or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power-of-two multiple of "
                         f"page_size={page_size}")
    pages_per_step = block_k // page_size
    pages_per_step = min(pages_per_step, 1 << max(0, (n_table - 1).bit_length()))
    n_steps_total = pl.cdiv(n_table, pages_per_step)
    if num_splits is None:
        num_splits = _pick_splits(batch, kv_heads, n_steps_total)
    num_splits = max(1, min(num_splits, n_steps_total))
    pages_per_split = pl.cdiv(n_steps_total, num_splits) * pages_per_step
    num_splits = pl.cdiv(n_table, pages_per_split)
    rows = max(_MIN_ROWS, 1 << (group - 1).bit_length())
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 3

    kernel = functools.partial(
        _decode_kernel, group=group, kv_heads=kv_heads, page_size=page_size,
        pages_per_step=pages_per_step, pages_per_split=pages_per_split, n_table=n_table,
        scale_log2=sm_scale * _LOG2E,
        allow_tf32=q.dtype != jnp.float32)  # float32 inputs get float32 products
    qg = q.reshape(batch, kv_heads, group, head_dim)
    k_flat = k_pages.reshape(rows_total, num_pages * page_size, head_dim)
    v_flat = v_pages.reshape(rows_total, num_pages * page_size, head_dim)
    in_specs = [
        pl.no_block_spec,  # layer: a scalar
        pl.no_block_spec,  # lengths: read as a scalar per program
        pl.no_block_spec,  # block tables: gathered per step
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        pl.no_block_spec,  # k: gathered by page
        pl.no_block_spec,  # v
    ]
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), q.dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group), jnp.float32))
        out_specs = (
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)))
    out = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_decode_p{page_size}_bk{block_k}_s{num_splits}",
    )(layer, lengths.astype(jnp.int32), block_tables.astype(jnp.int32), qg, k_flat, v_flat)
    if num_splits > 1:
        out = merge_partials(*out).astype(q.dtype)
    return out.reshape(batch, hq, head_dim)
