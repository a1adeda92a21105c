"""MLA decode over a paged latent cache: a Pallas kernel with the Triton lowering.

Multi-head latent attention decodes in its absorbed form: every query head attends over
one latent row per token, shared by all heads (MQA with a single kv head). The key is the
whole row [Dk] = [v_dim latent | rope part], the value its first v_dim columns.

One program per (sequence, block of query heads, split of the context). The program
holds its block_h query heads as the M dimension of the tensor-core products, so the
whole block shares every latent read: that is what makes decode with many heads
compute-bound rather than memory-bound. It walks its share of the sequence's pages
block_k tokens per step: the step's page ids come from the block table, and the latent
rows are gathered with masked loads (tokens past the length are never read) as two
tiles, the v_dim columns and the rope columns (padded to a power of two, as Triton's
blocks must be):

    s   = q[:, :v_dim] @ kv[:, :v_dim]^T + q[:, v_dim:] @ kv[:, v_dim:]^T   # [block_h, block_k]
    acc = acc * corr + exp2(s - m) @ kv[:, :v_dim]                         # [block_h, v_dim]

with an online softmax in float32 (base-2 exponentials); the value product reuses the
latent tile the score product read, so each latent page is read once per head block.

When B x head blocks programs would leave SMs idle, the context is split over several
programs (flash-decoding): each split writes its normalised partial output and
log-sum-exp, merged by log-sum-exp after the kernel (`paged_triton.merge_partials`; a
merge by the last split inside the kernel, as the paged kernel does, measured no faster
here).

`lengths[b] == 0` gives a zero row; lengths past the block table's capacity read only the
table's pages (as the reference does).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels.pallas.paged_triton import merge_partials

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_NEG = -1e30  # finite "minus infinity" for masked scores and empty running maxima
_MIN = 16  # tl.dot wants at least 16 rows and a contraction of at least 16


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def flat_layers(kv_pages, layer):
    """(kv_pages as [L * P, page, Dk] rows end to end, L): a layer stack [L, P, page, Dk]
    goes with `layer`, one layer's pages [P, page, Dk] without it."""
    if kv_pages.ndim == 4:
        if layer is None:
            raise ValueError(f"kv pages of shape {kv_pages.shape} are a layer stack; pass layer=")
        n_layers = kv_pages.shape[0]
        return kv_pages.reshape(n_layers * kv_pages.shape[1], *kv_pages.shape[2:]), n_layers
    if layer is not None:
        raise ValueError(f"layer={layer!r} needs kv pages [L, P, page, Dk]; got "
                         f"{kv_pages.shape}")
    return kv_pages, 1


def _mla_kernel(layer_ref, lengths_ref, tables_ref, q_ref, kv_ref, *out_refs, hq: int,
                block_h: int, head_dim: int, v_dim: int, rope_cols: int, page_size: int,
                pool_pages: int, pages_per_step: int, pages_per_split: int,
                n_table: int, scale_log2: float, allow_tf32: bool):
    """q_ref [B, Hq, Dk]; kv_ref [L * P * page, Dk] (a layer stack's rows end to end);
    out_refs: o [B, Hq, v_dim] (one split) or the partials o [B, splits, Hq, v_dim] f32
    and lse [B, splits, Hq], merged after the kernel."""
    b, hb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_k = pages_per_step * page_size
    head = hb * block_h + jnp.arange(block_h)  # [block_h]
    head_ok = head < hq

    length = jnp.minimum(lengths_ref[b], n_table * page_size)
    first_page = split * pages_per_split
    n_pages = jnp.minimum(pl.cdiv(length, page_size) - first_page, pages_per_split)
    n_steps = pl.cdiv(jnp.maximum(n_pages, 0), pages_per_step)

    def cols(start, width, n):  # [n, width] column indices start .., and those inside Dk
        c = jnp.broadcast_to(start + jnp.arange(width)[None, :], (n, width))
        return c, c < head_dim

    h2 = jnp.broadcast_to(head[:, None], (block_h, v_dim))
    cv, _ = cols(0, v_dim, block_h)
    q_v = pltriton.load(q_ref.at[b, h2, cv], mask=h2 < hq, other=0)  # [block_h, v_dim]
    if rope_cols:
        hr = jnp.broadcast_to(head[:, None], (block_h, rope_cols))
        cr, cr_ok = cols(v_dim, rope_cols, block_h)
        q_r = pltriton.load(q_ref.at[b, hr, cr], mask=(hr < hq) & cr_ok, other=0)
    tok = jnp.arange(block_k)
    row_base = layer_ref[0] * pool_pages * page_size

    def step(i, carry):
        acc, m, l = carry
        page_pos = first_page + i * pages_per_step + tok // page_size  # [block_k]
        valid = page_pos * page_size + tok % page_size < length
        page = pltriton.load(tables_ref.at[b, page_pos], mask=valid, other=0)
        row = row_base + page * page_size + tok % page_size  # [block_k]
        rv = jnp.broadcast_to(row[:, None], (block_k, v_dim))
        kv_cv, _ = cols(0, v_dim, block_k)
        kv_v = pltriton.load(kv_ref.at[rv, kv_cv], other=0,
                             mask=jnp.broadcast_to(valid[:, None], (block_k, v_dim)))
        s = pltriton.dot(q_v, kv_v, trans_b=True, allow_tf32=allow_tf32)
        if rope_cols:
            rr = jnp.broadcast_to(row[:, None], (block_k, rope_cols))
            kv_cr, kv_cr_ok = cols(v_dim, rope_cols, block_k)
            kv_r = pltriton.load(kv_ref.at[rr, kv_cr], other=0,
                                 mask=jnp.broadcast_to(valid[:, None], kv_cr.shape) & kv_cr_ok)
            s += pltriton.dot(q_r, kv_r, trans_b=True, allow_tf32=allow_tf32)
        s = jnp.where(jnp.broadcast_to(valid[None, :], s.shape), s * scale_log2, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])  # every step has a valid token: m_new is finite
        l = l * corr + p.sum(axis=1)
        acc = acc * corr[:, None] + pltriton.dot(p.astype(kv_v.dtype), kv_v,
                                                 allow_tf32=allow_tf32)
        return acc, m_new, l

    init = (jnp.zeros((block_h, v_dim), jnp.float32), jnp.full((block_h,), _NEG, jnp.float32),
            jnp.zeros((block_h,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_steps, step, init)

    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[:, None]
    ok2 = h2 < hq
    if len(out_refs) == 1:
        (o_ref,) = out_refs
        pltriton.store(o_ref.at[b, h2, cv], out.astype(o_ref.dtype), mask=ok2)
        return
    o_ref, lse_ref = out_refs
    lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * _LN2, -jnp.inf)
    pltriton.store(o_ref.at[b, split, h2, cv], out, mask=ok2)
    pltriton.store(lse_ref.at[b, split, head], lse, mask=head_ok)


def unsupported_reason(q, kv_pages, v_dim: int) -> str | None:
    """Why `mla_decode` cannot take q [B, Hq, Dk] over latent pages [(L,) P, page, Dk]
    with values the first v_dim columns (None if it can); "auto" then picks another impl."""
    page_size = kv_pages.shape[-2]
    if page_size & (page_size - 1):
        return f"page_size={page_size} is not a power of two"
    if v_dim & (v_dim - 1):
        return f"v_dim={v_dim} is not a power of two"
    if v_dim < _MIN and jax.default_backend() == "gpu":  # tl.dot's least K (compiled only)
        return f"v_dim={v_dim} is below {_MIN}"
    return None


def _sm_count() -> int:
    dev = jax.devices()[0]
    if dev.platform != "gpu":  # the interpreter: one split unless asked for more
        return 2
    return int(getattr(dev, "core_count", 0) or 132)


def _pick_splits(programs: int, n_steps_total: int, sms: int) -> int:
    """Splits along the context: as many as keep the grid of `programs` (B x head
    blocks) x splits within about two programs an SM (whole waves), at least one and at
    most one a step."""
    return max(1, min((2 * sms) // programs, n_steps_total))


def _default_block_h(hq: int) -> int:
    return min(max(_MIN, _pow2(hq)), 32)


def _default_block_k(page_size: int) -> int:
    return max(page_size, 64)


def _pages_per_step(block_k: int, page_size: int, n_table: int) -> int:
    return min(block_k // page_size, _pow2(n_table))


def default_splits(batch: int, hq: int, n_table: int, page_size: int, sms: int) -> int:
    """The context splits `mla_decode` takes with its default block sizes for `batch`
    rows of `hq` heads over tables of `n_table` pages, on a GPU of `sms` SMs (before its
    rounding to whole steps a split); the planner counts the split merge from it."""
    steps = pl.cdiv(n_table, _pages_per_step(_default_block_k(page_size), page_size, n_table))
    return _pick_splits(batch * pl.cdiv(hq, _default_block_h(hq)), steps, sms)


@functools.partial(jax.jit, static_argnames=("v_dim", "sm_scale", "block_h", "block_k",
                                             "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def mla_decode(q, kv_pages, block_tables, lengths, *, v_dim: int, sm_scale: float, layer=None,
               block_h: int | None = None, block_k: int | None = None,
               num_splits: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, interpret: bool | None = None):
    """q [B, Hq, Dk]; kv_pages [P, page, Dk] (or a layer stack [L, P, page, Dk] with
    `layer`, read in place); block_tables int32 [B, W]; lengths int32 [B] -> [B, Hq, v_dim]
    in q's dtype: softmax(q kv^T * sm_scale) @ kv[..., :v_dim].

    block_h: query heads a program (a power of two >= 16; default: Hq up to 32);
    block_k: tokens a step (a power-of-two multiple of the page size; default the larger
    of 64 and the page size); num_splits: programs per (sequence, head block) along the
    context (default: whole waves of about two programs an SM); num_warps (default 4, 8
    from 64 heads a program) and num_stages (default 4) go to Triton. The defaults are
    the best of a sweep on an H200 (docs/experiments.md).
    """
    kv_pages, n_layers = flat_layers(kv_pages, layer)
    batch, hq, head_dim = q.shape
    rows_total, page_size, _ = kv_pages.shape
    n_table = block_tables.shape[1]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    why = unsupported_reason(q, kv_pages, v_dim)
    if why:
        raise ValueError(f"the pallas_triton MLA kernel cannot take these inputs: {why}")
    if not 0 < v_dim <= head_dim:
        raise ValueError(f"v_dim={v_dim} must be in (0, Dk={head_dim}]")
    rope_cols = 0 if v_dim == head_dim else max(_MIN, _pow2(head_dim - v_dim))

    block_h = _default_block_h(hq) if block_h is None else block_h
    if block_h < _MIN or block_h & (block_h - 1):
        raise ValueError(f"block_h={block_h} must be a power of two >= {_MIN}")
    block_k = _default_block_k(page_size) if block_k is None else block_k
    if block_k % page_size or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power-of-two multiple of "
                         f"page_size={page_size}")
    pages_per_step = _pages_per_step(block_k, page_size, n_table)
    n_steps_total = pl.cdiv(n_table, pages_per_step)
    head_blocks = pl.cdiv(hq, block_h)
    if num_splits is None:
        num_splits = _pick_splits(batch * head_blocks, n_steps_total, _sm_count())
    num_splits = max(1, min(num_splits, n_steps_total))
    pages_per_split = pl.cdiv(n_steps_total, num_splits) * pages_per_step
    num_splits = pl.cdiv(n_table, pages_per_split)
    num_warps = (8 if block_h >= 64 else 4) if num_warps is None else num_warps
    num_stages = 4 if num_stages is None else num_stages

    kernel = functools.partial(
        _mla_kernel, hq=hq, block_h=block_h, head_dim=head_dim, v_dim=v_dim,
        rope_cols=rope_cols, page_size=page_size, pool_pages=rows_total // n_layers,
        pages_per_step=pages_per_step, pages_per_split=pages_per_split, n_table=n_table,
        scale_log2=sm_scale * _LOG2E,
        allow_tf32=q.dtype != jnp.float32)  # float32 inputs get float32 products
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((batch, hq, v_dim), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((batch, num_splits, hq, v_dim), jnp.float32),
                     jax.ShapeDtypeStruct((batch, num_splits, hq), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(batch, head_blocks, num_splits),
        in_specs=[pl.no_block_spec] * 5,  # scalars, tables and the pages: gathered
        out_specs=jax.tree.map(lambda _: pl.no_block_spec, out_shape),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"mla_decode_p{page_size}_h{block_h}_bk{block_k}_s{num_splits}",
    )(layer, lengths.astype(jnp.int32), block_tables.astype(jnp.int32), q,
      kv_pages.reshape(rows_total * page_size, head_dim))
    if num_splits == 1:
        return out
    return merge_partials(*out).astype(q.dtype)  # partials [B, S, Hq, v_dim], [B, S, Hq]
