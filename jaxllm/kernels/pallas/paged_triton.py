"""Paged decode attention: a Pallas kernel with the Triton lowering.

One program per (sequence, kv head, split). The program loads the query heads of its
GQA group once, as a [G, D] tile padded to at least 16 rows so the score and value
products run on tensor cores, then walks its share of the sequence's pages a few pages
per step: the step's page ids come from the block table, its K and V rows are gathered
with masked loads (tokens past the sequence length are never read), and an online
softmax in float32 (base-2 exponentials) accumulates the output. Every K/V page is read
once per kv head, whatever the group size.

`decode_attention` runs the same kernel over a contiguous cache [B, Hkv, T, D]: a row's
"pages" are then its own consecutive blocks (no table), and the S new tokens of a
speculative verify share the program with their group (S x G query rows, each masked at
its own position).

Long contexts are split across programs (flash-decoding): each split writes its
normalised partial output and log-sum-exp, and the partials are merged by log-sum-exp.
By default (`paged_attention`; `decode_attention` when given counters) the last split to
finish merges them inside the kernel: each split stores its partials and counts itself
in on an int32 counter per (sequence, kv head) with an atomic add (acquire-release, after
a barrier of its program, so all of the program's stores are ordered before it); the
split that sees every other one counted reads the partials back from L2, writes the
final output and sets the counter back to zero. `merge="xla"` merges with a small jnp
epilogue instead (two more XLA kernels). With a single split the kernel writes the final
output directly.

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


def _decode_kernel(layer_ref, lengths_ref, tables_ref, q_ref, k_ref, v_ref, *refs,
                   group: int, kv_heads: int,
                   page_size: int, pages_per_step: int, pages_per_split: int, n_table: int,
                   scale_log2: float, allow_tf32: bool, q_len: int = 1,
                   contiguous: bool = False, merge: str = "none", num_splits: int = 1,
                   interpret: bool = False):
    """merge: "none" (one split: refs = o block), "jnp" (refs = partial o, lse blocks;
    merged after the kernel) or "kernel" (refs = counters in, final o, partial o, lse,
    counters out (the same buffer): whole arrays, merged by the last split to finish, see
    the module docstring)."""
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if merge != "kernel":
        o_ref, *lse_ref = refs
    # k/v are [layers * Hkv, tokens, D] (paged) or [B * Hkv, tokens, D] (contiguous)
    kv_row = (b if contiguous else layer_ref[0]) * kv_heads + h
    rows, head_dim = q_ref.shape
    block_k = pages_per_step * page_size
    # row r = s * group + g: query s of the q_len consecutive new tokens, head g of the
    # group; query s sees the first length - (q_len - 1 - s) tokens
    row_ok = jnp.arange(rows) < group * q_len
    row_skip = q_len - 1 - jnp.arange(rows) // group  # [rows]

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
        token = page_pos * page_size + tok % page_size
        valid = token < length
        if contiguous:  # the "pages" of a row are its own consecutive blocks
            page = page_pos
        else:
            page = pltriton.load(tables_ref.at[b, page_pos], mask=valid, other=0)
        kv_rows = jnp.broadcast_to((page * page_size + tok % page_size)[:, None],
                                   (block_k, head_dim))
        kv_mask = jnp.broadcast_to(valid[:, None], (block_k, head_dim))
        k = pltriton.load(k_ref.at[kv_row, kv_rows, cols], mask=kv_mask, other=0)
        v = pltriton.load(v_ref.at[kv_row, kv_rows, cols], mask=kv_mask, other=0)

        # scores [rows, block_k] in log2 units
        s = pltriton.dot(q, k, trans_b=True, allow_tf32=allow_tf32) * scale_log2
        if q_len == 1:
            seen = jnp.broadcast_to(valid[None, :], s.shape)
        else:
            seen = token[None, :] < (length - row_skip)[:, None]
        s = jnp.where(seen, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if q_len > 1:  # a row can see none of this block's keys (its m_new still _NEG)
            p = jnp.where(seen, p, 0.0)
        l = l * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + pltriton.dot(p.astype(v.dtype), v, allow_tf32=allow_tf32)
        return acc, m_new, l

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_steps, step, init)

    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[:, None]
    lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * _LN2, -jnp.inf)
    ok2 = jnp.broadcast_to(row_ok[:, None], (rows, head_dim))
    if merge != "kernel":
        pltriton.store(o_ref, out.astype(o_ref.dtype), mask=ok2)
        if lse_ref:
            pltriton.store(lse_ref[0], lse, mask=row_ok)
        return
    _, out_ref, o_part_ref, lse_part_ref, cnt_ref = refs
    # padding rows are masked at their own (out-of-range) indices, never clamped onto a
    # real row
    r = jnp.arange(rows)
    r2 = jnp.broadcast_to(r[:, None], (rows, head_dim))
    d2 = jnp.broadcast_to(jnp.arange(head_dim)[None, :], (rows, head_dim))
    pltriton.store(o_part_ref.at[b, h, split, r2, d2], out, mask=ok2)
    pltriton.store(lse_part_ref.at[b, h, split, r], lse, mask=row_ok)
    if not interpret:  # all of the program's partial stores come before its count
        pltriton.debug_barrier()
    counted = pltriton.atomic_add(cnt_ref, (b * kv_heads + h,), jnp.ones((), jnp.int32))

    @pl.when(counted == num_splits - 1)
    def _():  # the last split to finish: merge every split's partials
        _merge_splits(out_ref, o_part_ref, lse_part_ref, cnt_ref, b, h, kv_heads,
                      group * q_len, head_dim, num_splits)


def _merge_splits(out_ref, o_part_ref, lse_part_ref, cnt_ref, b, h, kv_heads: int,
                  n_rows: int, head_dim: int, num_splits: int):
    """out[b, h] = the log-sum-exp merge of the partials [b, h, :] (as merge_partials), as
    one [splits, rows x D] tile (other programs' stores, visible after the acquiring
    count); then the counter of (b, h) back to zero."""
    sp = 1 << (num_splits - 1).bit_length()
    width = (1 << (n_rows - 1).bit_length()) * head_dim
    s_idx = jnp.broadcast_to(jnp.arange(sp)[:, None], (sp, width))
    col = jnp.broadcast_to(jnp.arange(width)[None, :], (sp, width))
    r, d = col // head_dim, col % head_dim
    ok = (s_idx < num_splits) & (r < n_rows)
    lse = pltriton.load(lse_part_ref.at[b, h, s_idx, r], mask=ok, other=-jnp.inf)
    o = pltriton.load(o_part_ref.at[b, h, s_idx, r, d], mask=ok, other=0.0)
    mx = lse.max(axis=0)
    mx = jnp.where(mx > -jnp.inf, mx, 0.0)
    w = jnp.exp(lse - mx[None, :])  # 0 for empty splits
    den = w.sum(axis=0)
    out = (w * o).sum(axis=0) / jnp.where(den > 0, den, 1.0)
    r1, d1 = jnp.arange(width) // head_dim, jnp.arange(width) % head_dim
    pltriton.store(out_ref.at[b, h, r1, d1], out.astype(out_ref.dtype), mask=r1 < n_rows)
    cnt_ref[b * kv_heads + h] = jnp.zeros((), jnp.int32)


def decode_unsupported_reason(q, k_cache) -> str | None:
    """Why `decode_attention` cannot take q [B, S, Hq, D] over a cache [B, Hkv, T, D]
    (None if it can); the registry's "auto" then picks another impl."""
    d = q.shape[-1]
    if d & (d - 1):
        return f"head_dim={d} is not a power of two"
    if d < _MIN_ROWS and jax.default_backend() == "gpu":  # tl.dot's least K (compiled only)
        return f"head_dim={d} is below {_MIN_ROWS}"
    return None


def unsupported_reason(q, k_pages) -> str | None:
    """Why `paged_attention` cannot take q [B, Hq, D] over pages [(L,) Hkv, P, page, D]
    (None if it can)."""
    page_size = k_pages.shape[-2]
    if page_size & (page_size - 1):
        return f"page_size={page_size} is not a power of two"
    return decode_unsupported_reason(q, None)


def _sm_count() -> int:
    dev = jax.devices()[0]
    if dev.platform != "gpu":  # the interpreter: a few splits keep the split path exercised
        return 2
    return int(getattr(dev, "core_count", 0) or 132)


def _pick_splits(batch: int, kv_heads: int, n_steps_total: int) -> int:
    """Splits along the context per (sequence, kv head): enough programs to fill the GPU
    a few times over, down to one step each, so that a small batch costs one program's
    latency rather than a chain of steps (docs/performance.md, decode)."""
    want = pl.cdiv(4 * _sm_count(), batch * kv_heads)
    return max(1, min(want, n_steps_total))


def merge_partials(o_parts, lse_parts):
    """Merge split outputs by log-sum-exp: o_parts [..., S, G, D] f32, lse [..., S, G]."""
    mx = lse_parts.max(axis=-2, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse_parts - mx)  # 0 for empty splits
    den = w.sum(axis=-2)
    num = (w[..., None] * o_parts).sum(axis=-3)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def _launch(qg, k_flat, v_flat, layer, lengths, tables, *, kv_heads: int, group: int,
            q_len: int, page_size: int, n_table: int, contiguous: bool, sm_scale: float,
            block_k, num_splits, num_warps, num_stages, interpret, merge="kernel",
            counters=None):
    """The kernel over qg [B, Hkv, q_len * group, D] -> same shape, in qg's dtype.
    merge: how several splits are merged: "kernel" (by the last split, with int32 zero
    `counters` [B * Hkv], filled here when not given; the kernel leaves them zero) or
    "xla" (jnp after the kernel)."""
    batch, _, n_rows, head_dim = qg.shape
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
    rows = max(_MIN_ROWS, 1 << (n_rows - 1).bit_length())
    num_warps = 4 if num_warps is None else num_warps
    num_stages = 3 if num_stages is None else num_stages

    if merge not in ("kernel", "xla"):
        raise ValueError(f"merge={merge!r}; choose 'kernel' or 'xla'")
    merge = "none" if num_splits == 1 else "jnp" if merge == "xla" else "kernel"
    if merge == "kernel" and counters is None:
        counters = jnp.zeros((batch * kv_heads,), jnp.int32)
    if merge == "kernel" and counters.shape != (batch * kv_heads,):
        raise ValueError(f"counters must be int32 zeros [B * Hkv] = [{batch * kv_heads}]; got "
                         f"{counters.shape}")
    kernel = functools.partial(
        _decode_kernel, group=group, kv_heads=kv_heads, page_size=page_size,
        pages_per_step=pages_per_step, pages_per_split=pages_per_split, n_table=n_table,
        scale_log2=sm_scale * _LOG2E, q_len=q_len, contiguous=contiguous, merge=merge,
        num_splits=num_splits, interpret=interpret,
        allow_tf32=qg.dtype != jnp.float32)  # float32 inputs get float32 products
    in_specs = [
        pl.no_block_spec,  # layer: a scalar
        pl.no_block_spec,  # lengths: read as a scalar per program
        pl.no_block_spec,  # block tables: gathered per step
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        pl.no_block_spec,  # k: gathered by page
        pl.no_block_spec,  # v
    ]
    args = [layer, lengths.astype(jnp.int32), tables.astype(jnp.int32), qg, k_flat, v_flat]
    aliases = {}
    parts = (jax.ShapeDtypeStruct((batch, kv_heads, num_splits, n_rows, head_dim), jnp.float32),
             jax.ShapeDtypeStruct((batch, kv_heads, num_splits, n_rows), jnp.float32))
    if merge == "none":
        out_shape = jax.ShapeDtypeStruct(qg.shape, qg.dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    elif merge == "kernel":  # every split may read every split's partials: whole refs
        in_specs.append(pl.no_block_spec)
        args.append(counters.astype(jnp.int32))
        aliases = {len(args) - 1: 3}
        out_shape = (jax.ShapeDtypeStruct(qg.shape, qg.dtype), *parts,
                     jax.ShapeDtypeStruct(counters.shape, jnp.int32))
        out_specs = (pl.no_block_spec,) * 4
    else:
        out_shape = parts
        out_specs = (
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)))
    kind = "contig" if contiguous else "paged"
    out = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"{kind}_decode_p{page_size}_bk{block_k}_s{num_splits}_q{q_len}"
             f"{'_km' if merge == 'kernel' else ''}",
    )(*args)
    if merge == "kernel":
        return out[0]
    if merge == "jnp":
        out = merge_partials(*out).astype(qg.dtype)
    return out


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "num_splits", "num_warps",
                                             "num_stages", "interpret", "merge"))
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale: float,
                    layer=None, block_k: int | None = None, num_splits: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    interpret: bool | None = None, merge: str = "kernel", counters=None):
    """q [B, Hq, D]; k/v pages [Hkv, P, page, D]; block_tables [B, n]; lengths [B] -> [B, Hq, D].

    k/v pages may also be a whole layer stack [L, Hkv, P, page, D] with `layer` in [0, L)
    (an int or a traced int32 scalar, e.g. the index inside a scan over layers): the kernel
    reads that layer in place, so no per-layer slice of the pool is ever copied.
    block_k: tokens per inner step (a multiple of the page size; default the larger of
    128 and the page size);
    num_splits: programs per (sequence, kv head) along the context (default: fill the GPU).
    merge: "kernel" (default; the last split merges, counting in int32 zero `counters`
    [B * Hkv], filled here unless given) or "xla" (see `decode_attention`).
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
    group = hq // kv_heads
    out = _launch(
        q.reshape(batch, kv_heads, group, head_dim),
        k_pages.reshape(rows_total, num_pages * page_size, head_dim),
        v_pages.reshape(rows_total, num_pages * page_size, head_dim),
        layer, lengths, block_tables, kv_heads=kv_heads, group=group, q_len=1,
        page_size=page_size, n_table=block_tables.shape[1], contiguous=False,
        sm_scale=sm_scale, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, merge=merge, counters=counters)
    return out.reshape(batch, hq, head_dim)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "num_splits", "num_warps",
                                             "num_stages", "interpret", "merge"))
def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale: float,
                     block_k: int | None = None, num_splits: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     interpret: bool | None = None, merge: str = "auto", counters=None):
    """A few new queries per row over a contiguous cache (decode, speculative verify).

    q [B, S, Hq, D]: the S new tokens of row b sit at positions lengths[b] - S ..
    lengths[b] - 1, and query s sees cache keys 0 .. lengths[b] - S + s (causal).
    k/v cache [B, Hkv, T, D] (the contiguous cache's per-layer layout). -> [B, S, Hq, D].
    The same kernel as `paged_attention`, each row's blocks being its own consecutive
    tokens; the S x group queries of a kv head share every K/V read.
    merge: a context split over several programs is merged by the last split to finish
    ("kernel") or by two XLA kernels after it ("xla"); "auto" (default): "kernel" when
    `counters` are given, else "xla". The kernel merge counts finished splits in int32
    `counters` [B * Hkv] that must start at zero: filled here unless given, e.g. by the
    kernel before (`gemv_triton.decode_gemv`'s `zeros`, which saves the fill's launch);
    the kernel leaves them zero again. "auto" keeps the XLA merge where no counters come
    in, as measured in the model's decode step (docs/performance.md).
    """
    batch, q_len, hq, head_dim = q.shape
    _, kv_heads, max_len, _ = k_cache.shape
    if merge == "auto":
        merge = "xla" if counters is None else "kernel"
    group = hq // kv_heads
    if block_k is None:
        block_k = 128 if max_len >= 128 else max(16, 1 << (max_len - 1).bit_length())
    qg = (q.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
          .reshape(batch, kv_heads, q_len * group, head_dim))
    lengths = jnp.minimum(lengths.astype(jnp.int32), max_len)
    out = _launch(
        qg, k_cache.reshape(batch * kv_heads, max_len, head_dim),
        v_cache.reshape(batch * kv_heads, max_len, head_dim),
        jnp.zeros((1,), jnp.int32), lengths, jnp.zeros((batch, 1), jnp.int32),
        kv_heads=kv_heads, group=group, q_len=q_len, page_size=block_k,
        n_table=pl.cdiv(max_len, block_k), contiguous=True, sm_scale=sm_scale,
        block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, merge=merge, counters=counters)
    return (out.reshape(batch, kv_heads, q_len, group, head_dim).transpose(0, 2, 1, 3, 4)
            .reshape(batch, q_len, hq, head_dim))
