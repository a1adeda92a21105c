"""Ragged paged attention: one step's mixed prefill and decode tokens over the paged KV
cache, as a Pallas kernel with the Triton lowering.

The step's query tokens form one flat batch q [T, Hq, D]; sequence s owns rows
q_starts[s] .. q_starts[s+1] - 1, the last q_len of its kv_lens[s] cached tokens (already
written), and new token i sees keys 0 .. kv_lens[s] - q_len + i.

Work items. A program handles one kv head and one block of up to `block_q` consecutive
new tokens of one sequence, with all G query heads of the kv head's group: the tile has
block_q x G rows (row r = token r // G, head r % G), padded to a power of two of at least
16 so both products run on tensor cores. Blocks are numbered without a table: the blocks
of sequence s start at number q_starts[s] // block_q + s, which grows with s and leaves
room for the cdiv(q_len, block_q) blocks of s before the next sequence's start, so
T // block_q + S programs cover every block of any valid step (the remainder find no
block and return at once). A program finds its sequence by a binary search over
q_starts (log2 S scalar loads), so nothing is precomputed on the host and nothing
depends on values at compile time.

Two launches of the same kernel share one output. One-token (and few-token) sequences
would waste most of a prefill-sized tile, so sequences with q_len <= `small_q` (decode,
speculative verify) run in a launch whose blocks hold min(q_len, small_q) tokens x G
heads in a 16-row tile (as our paged decode kernel), and longer ones (prefill chunks) in
a second launch with `block_q` = 64 / G tokens (64-row tiles). Keys per inner step:
`block_k`, 128 in the decode launch (as the paged decode kernel), 64 in the prefill one. Each launch skips the
other's sequences; the output starts as zeros (padding rows stay zero) and the second
launch writes into the first's output in place (an aliased buffer).

Inner loop. The program walks its sequence's pages `block_k` tokens per step, only up
to the last key its last row can see (causal block skipping): page ids come from the
block table with masked loads (entries past the sequence's ceil(visible / page) pages
are never read), K/V rows are gathered with masked loads (slots past the visible keys
are never read), each row is masked at its own position, and an online softmax in
float32 with base-2 exponentials accumulates the output. A block reads each K/V page it
can see once per kv head, for all of the group's query heads at once.

Costs of the design: a decode-only step still launches the prefill kernel, whose
programs all find no sequence of theirs and return after the search; and there is no
split of long contexts across programs (flash-decoding): the decode launch has Hkv
programs per sequence, which fills the GPU at serving batch sizes but not for a few long
sequences alone.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_LOG2E = math.log2(math.e)
_NEG = -1e30  # finite "minus infinity" for masked scores and empty running maxima
_MIN_ROWS = 16  # tl.dot wants at least 16 rows


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _find_sequence(q_starts_ref, j, block_q: int, n_seqs: int):
    """The last sequence s whose first block number q_starts[s] // block_q + s is <= j
    (binary search; the numbers grow strictly with s)."""
    def step(_, lo_hi):
        lo, hi = lo_hi  # invariant: first(lo) <= j, and the answer is < hi
        mid = (lo + hi) // 2
        ok = q_starts_ref[mid] // block_q + mid <= j
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    lo, _ = jax.lax.fori_loop(0, max(1, n_seqs.bit_length()), step,
                              (jnp.int32(0), jnp.int32(n_seqs)))
    return lo


def _ragged_kernel(layer_ref, q_starts_ref, kv_lens_ref, tables_ref, q_ref, k_ref, v_ref,
                   o_in_ref, o_ref, *, group: int, kv_heads: int, block_q: int, rows: int,
                   page_size: int, block_k: int, n_seqs: int, n_table: int,
                   q_len_min: int, q_len_max: int, scale_log2: float, allow_tf32: bool):
    """q/o [T, Hq, D] (head h * G + g is head g of kv head h's group) and k/v
    [L * Hkv, P * page, D] as whole refs; o_in is o's aliased input (never read here)."""
    del o_in_ref
    j, h = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[-1]
    s = _find_sequence(q_starts_ref, j, block_q, n_seqs)
    start = q_starts_ref[s]
    q_len = q_starts_ref[s + 1] - start
    first = (j - (start // block_q + s)) * block_q  # the block's first token in s
    mine = (q_len >= q_len_min) & (q_len <= q_len_max) & (first < q_len)

    @pl.when(mine)
    def _():
        kv_row = layer_ref[0] * kv_heads + h
        kv_len = jnp.minimum(kv_lens_ref[s], n_table * page_size)
        r = jnp.arange(rows)
        tok = first + r // group  # [rows] token of s
        row_ok = (r < block_q * group) & (tok < q_len)
        pos = kv_len - q_len + tok  # the row's own position: it sees keys 0 .. pos
        q_row = start + tok  # padding rows keep their own indices, masked (never
        # clamped onto a real row, which a masked store could then write twice)
        d = jnp.arange(head_dim)[None, :]
        q_idx = (jnp.broadcast_to(q_row[:, None], (rows, head_dim)),
                 jnp.broadcast_to((h * group + r % group)[:, None], (rows, head_dim)),
                 jnp.broadcast_to(d, (rows, head_dim)))
        ok2 = jnp.broadcast_to(row_ok[:, None], (rows, head_dim))
        q = pltriton.load(q_ref.at[q_idx], mask=ok2, other=0)

        # keys the block's last row sees (causal block skipping)
        n_keys = jnp.clip(kv_len - q_len + jnp.minimum(first + block_q, q_len), 0, kv_len)
        kt = jnp.arange(block_k)
        cols = jnp.broadcast_to(d, (block_k, head_dim))

        def step(i, carry):
            acc, m, l = carry
            key = i * block_k + kt  # [block_k] token positions in s
            valid = key < n_keys
            page = pltriton.load(tables_ref.at[s, key // page_size], mask=valid, other=0)
            slot = jnp.broadcast_to((page * page_size + key % page_size)[:, None],
                                    (block_k, head_dim))
            kv_mask = jnp.broadcast_to(valid[:, None], (block_k, head_dim))
            k = pltriton.load(k_ref.at[kv_row, slot, cols], mask=kv_mask, other=0)
            v = pltriton.load(v_ref.at[kv_row, slot, cols], mask=kv_mask, other=0)
            sc = pltriton.dot(q, k, trans_b=True, allow_tf32=allow_tf32) * scale_log2
            seen = (key[None, :] <= pos[:, None]) & valid[None, :] & row_ok[:, None]
            sc = jnp.where(seen, sc, _NEG)
            m_new = jnp.maximum(m, sc.max(axis=1))
            corr = jnp.exp2(m - m_new)
            p = jnp.where(seen, jnp.exp2(sc - m_new[:, None]), 0.0)  # a row may see none
            l = l * corr + p.sum(axis=1)
            acc = acc * corr[:, None] + pltriton.dot(p.astype(v.dtype), v,
                                                     allow_tf32=allow_tf32)
            return acc, m_new, l

        init = (jnp.zeros((rows, head_dim), jnp.float32),
                jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
        acc, _, l = jax.lax.fori_loop(0, pl.cdiv(n_keys, block_k), step, init)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        pltriton.store(o_ref.at[q_idx], out.astype(o_ref.dtype), mask=ok2)


def unsupported_reason(q, k_pages) -> str | None:
    """Why the kernel cannot take q [T, Hq, D] over pages [(L,) Hkv, P, page, D] (None if
    it can); the registry's "auto" then picks another impl."""
    d, page_size = q.shape[-1], k_pages.shape[-2]
    if d & (d - 1):
        return f"head_dim={d} is not a power of two"
    if d < _MIN_ROWS and jax.default_backend() == "gpu":  # tl.dot's least K (compiled only)
        return f"head_dim={d} is below {_MIN_ROWS}"
    if page_size & (page_size - 1):
        return f"page_size={page_size} is not a power of two"
    return None


def _launch(o, q, k_flat, v_flat, layer, q_starts, kv_lens, tables, *, kv_heads: int,
            page_size: int, block_q: int, q_len_min: int, q_len_max: int, block_k: int,
            sm_scale: float, num_warps: int, num_stages: int, interpret: bool):
    """One launch over the sequences with q_len_min <= q_len <= q_len_max, writing their
    rows of o [T, Hq, D] in place (the other rows keep o's values)."""
    t, hq, head_dim = q.shape
    group = hq // kv_heads
    n_seqs, n_table = tables.shape
    rows = max(_MIN_ROWS, _pow2(block_q * group))
    block_k = max(block_k, page_size)
    kernel = functools.partial(
        _ragged_kernel, group=group, kv_heads=kv_heads, block_q=block_q, rows=rows,
        page_size=page_size, block_k=block_k, n_seqs=n_seqs, n_table=n_table,
        q_len_min=q_len_min, q_len_max=q_len_max, scale_log2=sm_scale * _LOG2E,
        allow_tf32=q.dtype != jnp.float32)  # float32 inputs get float32 products
    return pl.pallas_call(
        kernel,
        grid=(t // block_q + n_seqs, kv_heads),
        in_specs=[pl.no_block_spec] * 8,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(o.shape, o.dtype),
        input_output_aliases={7: 0},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_p{page_size}_bq{block_q}_bk{block_k}",
    )(layer, q_starts, kv_lens, tables, q, k_flat, v_flat, o)


@functools.partial(jax.jit, static_argnames=("sm_scale", "small_q", "block_q", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_starts, *,
                           sm_scale: float, layer=None, small_q: int | None = None,
                           block_q: int | None = None, block_k: int | None = None,
                           num_warps: int = 4, num_stages: int = 3,
                           interpret: bool | None = None):
    """q [T, Hq, D]; k/v pages [Hkv, P, page, D] (or [L, Hkv, P, page, D] with `layer`, read
    in place); block_tables [S, W]; kv_lens [S]; q_starts [S + 1] -> [T, Hq, D].

    small_q: sequences of at most this many new tokens run in the decode launch, in blocks
    of that many tokens (default: as many as fit 16 rows, 16 // G, at least 1);
    block_q: tokens per block of the longer sequences (default: 64 // G, at least small_q);
    block_k: keys per inner step (raised to the page size; default 128 in the decode
    launch, 64 in the prefill launch, whose tiles have more rows).
    """
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError(f"k/v pages of shape {k_pages.shape} are a layer stack; pass layer=")
    elif layer is not None:
        raise ValueError(f"layer={layer!r} needs k/v pages [L, Hkv, P, page, D]; got "
                         f"{k_pages.shape}")
    kv_heads, num_pages, page_size, head_dim = k_pages.shape[-4:]
    rows_total = math.prod(k_pages.shape[:-3])  # L * Hkv
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    t, hq, _ = q.shape
    group = hq // kv_heads
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    small_q = max(1, _MIN_ROWS // group) if small_q is None else small_q
    block_q = max(small_q, 64 // group) if block_q is None else block_q
    if min(small_q, block_q) < 1:
        raise ValueError(f"small_q={small_q} and block_q={block_q} must be >= 1")
    least_k = 1 if interpret else _MIN_ROWS  # tl.dot's least N and K when compiled
    if block_k is not None and (block_k < least_k or block_k & (block_k - 1)):
        raise ValueError(f"block_k={block_k} must be a power of two >= {least_k}")
    k_flat, v_flat = (x.reshape(rows_total, num_pages * page_size, head_dim)
                      for x in (k_pages, v_pages))
    args = (k_flat, v_flat, layer, q_starts.astype(jnp.int32), kv_lens.astype(jnp.int32),
            block_tables.astype(jnp.int32))
    launch = functools.partial(_launch, kv_heads=kv_heads, page_size=page_size,
                               sm_scale=sm_scale, num_warps=num_warps,
                               num_stages=num_stages, interpret=interpret)
    o = jnp.zeros_like(q)  # rows past q_starts[S] stay zero
    # decode and verify rows: blocks of min(q_len, small_q) tokens, 16-row tiles
    o = launch(o, q, *args, block_q=small_q, q_len_min=1, q_len_max=small_q,
               block_k=block_k or 128)
    if t > small_q:  # prefill chunks: blocks of block_q tokens
        o = launch(o, q, *args, block_q=block_q, q_len_min=small_q + 1, q_len_max=t,
                   block_k=block_k or 64)
    return o
