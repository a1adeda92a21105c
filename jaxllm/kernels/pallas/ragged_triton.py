"""Ragged paged attention: one step's mixed prefill and decode tokens over the paged KV
cache, as a Pallas kernel with the Triton lowering.

The step's query tokens form one flat batch q [T, Hq, D]; sequence s owns rows
q_starts[s] .. q_starts[s+1] - 1, the last q_len of its kv_lens[s] cached tokens (already
written), and new token i sees keys 0 .. kv_lens[s] - q_len + i.

Work items. A program handles one kv head and one block of up to `block_q` consecutive
new tokens of one sequence, with all G query heads of the kv head's group: the tile has
block_q x G rows (row r = token r // G, head r % G), padded to a power of two of at least
16 so both products run on tensor cores. Blocks are numbered per launch: the launch's
sequence s owns blocks block_starts[s] .. block_starts[s + 1] - 1, block_starts [S + 1]
being the running sum of its sequences' cdiv(q_len, block_q) (one small jnp op on the
device, from q_starts; the launch's other sequences own none). The grid covers the
largest number of blocks any valid step of T tokens can have (min(S, T) in the decode
launch, one block a sequence; T // block_q + min(S, T // (small_q + 1)) in the prefill
one), so it grows with T, not with the S sequence slots; block numbers past the step's
last block return at once. A program finds its sequence by a binary search over
block_starts (log2 S scalar loads); nothing depends on values at compile time.

Two launches of the same kernel share one output. One-token (and few-token) sequences
would waste most of a prefill-sized tile, so sequences with q_len <= `small_q` (decode,
speculative verify) run in a launch whose blocks hold min(q_len, small_q) tokens x G
heads in a 16-row tile (as our paged decode kernel), and longer ones (prefill chunks) in
a second launch with `block_q` = 64 / G tokens (64-row tiles). Keys per inner step:
`block_k`, 128 in the decode launch (as the paged decode kernel), 64 in the prefill
one. Each launch skips the other's sequences; the output starts as zeros (padding rows
stay zero) and the second launch writes into the first's output in place (an aliased
buffer).

Inner loop. The program walks its sequence's pages `block_k` tokens per step, only up
to the last key its last row can see (causal block skipping): page ids come from the
block table with masked loads (entries past the sequence's ceil(visible / page) pages
are never read), K/V rows are gathered with masked loads (slots past the visible keys
are never read), each row is masked at its own position, and an online softmax in
float32 with base-2 exponentials accumulates the output. A block reads each K/V page it
can see once per kv head, for all of the group's query heads at once.

Splits of the key range (flash-decoding). A step of a few blocks (one prefill chunk over
a long cached prefix, decode at small batch) would leave most of the GPU idle with one
program per block and kv head, so each launch has a static `kv_splits` and a third grid
axis: split j of a block takes the block's visible keys [j * chunk, (j + 1) * chunk),
chunk = the visible keys / kv_splits rounded up to `block_k` (computed in the kernel from
the block's own length, so short blocks leave their last splits empty: those return at
once). A split writes its normalised partial output and natural log-sum-exp (float32)
into [splits, T, Hq, D] and [splits, T, Hq] buffers; the LSE buffer starts at -inf and
the partial outputs are left unfilled (read only where an LSE was written). Both launches
share the buffers; a jnp epilogue merges the splits by LSE for the rows some split wrote
and keeps the other rows (the other launch's direct writes, padding zeros) as they are.
With kv_splits == 1 a launch writes its final rows directly (no buffers, no merge).

The default split rule, per launch, from static shapes only: with programs = the grid's
blocks (the largest plausible number of real blocks, above) x Hkv,
kv_splits = 1 if T > 256 or programs already fill four waves of the GPU's SMs, else
ceil(4 x SMs / programs) capped at 16. Off the GPU (the interpreter) it is 1. So a
decode-only step of 64 sequences over 8 kv heads (512 programs on 132 SMs) gets two splits
in the decode launch, which evens out their ragged lengths (the 1B's decode step on an
H100: 3.37 -> 3.20 ms; 4 splits 3.18), and the T = 16 / 32 buckets of a few long sequences
get several.

Costs of the design: each launch's block numbers are a small XLA op before it; a
decode-only step still launches the prefill kernel, whose programs (times its splits)
all find no block and return after the search; when that launch splits, its (empty)
partials are still filled and merged, two small XLA kernels over [splits, T, Hq(, D)].
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
_SPLIT_MAX_TOKENS = 256  # steps of more tokens fill the GPU with blocks: one split
_SPLIT_CAP = 16  # most splits per block


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _find_sequence(block_starts_ref, j, n_seqs: int):
    """The last sequence s whose first block number block_starts[s] is <= j (binary
    search; the numbers do not decrease with s)."""
    def step(_, lo_hi):
        lo, hi = lo_hi  # invariant: block_starts[lo] <= j, and the answer is < hi
        mid = (lo + hi) // 2
        ok = block_starts_ref[mid] <= j
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    lo, _ = jax.lax.fori_loop(0, max(1, n_seqs.bit_length()), step,
                              (jnp.int32(0), jnp.int32(n_seqs)))
    return lo


def _ragged_kernel(layer_ref, block_starts_ref, q_starts_ref, kv_lens_ref, tables_ref, q_ref,
                   k_ref, v_ref, *refs, group: int, kv_heads: int, block_q: int, rows: int,
                   page_size: int, block_k: int, n_seqs: int, n_table: int,
                   scale_log2: float, allow_tf32: bool,
                   kv_splits: int, n_aliased: int):
    """q [T, Hq, D] (head h * G + g is head g of kv head h's group) and k/v
    [L * Hkv, P * page, D] as whole refs; refs: `n_aliased` aliased inputs (never read
    here), then the outputs: o [T, Hq, D] (kv_splits == 1), or the partials
    o_part [splits, T, Hq, D] f32 and lse [splits, T, Hq] f32 (natural log; the caller
    fills it with -inf, which a split with no keys leaves in place)."""
    outs = refs[n_aliased:]
    j, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    s = _find_sequence(block_starts_ref, j, n_seqs)
    start = q_starts_ref[s]
    q_len = q_starts_ref[s + 1] - start
    first = (j - block_starts_ref[s]) * block_q  # the block's first token in s
    mine = j < block_starts_ref[n_seqs]  # block j exists (then s is a sequence of ours)
    kv_len = jnp.minimum(kv_lens_ref[s], n_table * page_size)
    # keys the block's last row sees (causal block skipping)
    n_keys = jnp.clip(kv_len - q_len + jnp.minimum(first + block_q, q_len), 0, kv_len)
    # this split's share of them: [lo, lo + chunk), chunk a multiple of block_k
    chunk = pl.cdiv(pl.cdiv(n_keys, kv_splits), block_k) * block_k
    lo = split * chunk

    @pl.when(mine & (lo < n_keys))
    def _():
        kv_row = layer_ref[0] * kv_heads + h
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
        hi = jnp.minimum(lo + chunk, n_keys)
        acc, m, l = jax.lax.fori_loop(lo // block_k, pl.cdiv(hi, block_k), step, init)
        seen_any = l > 0  # a row may see none of this split's keys
        out = acc / jnp.where(seen_any, l, 1.0)[:, None]
        if kv_splits == 1:
            o_ref, = outs
            pltriton.store(o_ref.at[q_idx], out.astype(o_ref.dtype), mask=ok2)
            return
        o_part_ref, lse_ref = outs
        lse = jnp.where(seen_any, (m + jnp.log2(jnp.where(seen_any, l, 1.0))) * _LN2,
                        -jnp.inf)
        pltriton.store(o_part_ref.at[(split,) + q_idx], out, mask=ok2)
        pltriton.store(lse_ref.at[split, q_row, h * group + r % group], lse, mask=row_ok)


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


def _sm_count() -> int | None:
    """Streaming multiprocessors of device 0; None off the GPU (the interpreter runs
    programs one after another, so splitting gains nothing there)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return None
    return int(getattr(dev, "core_count", 0) or 132)


def _pick_splits(max_blocks: int, kv_heads: int, tokens: int, sm_count: int | None) -> int:
    """Splits of the key range for a launch whose largest plausible number of real
    blocks is `max_blocks` (the module docstring's rule)."""
    programs = max_blocks * kv_heads
    if sm_count is None or tokens > _SPLIT_MAX_TOKENS or programs >= 4 * sm_count:
        return 1
    return max(1, min(_SPLIT_CAP, pl.cdiv(4 * sm_count, programs)))


def merge_partials(o, o_part, lse):
    """Rows of o [T, Hq, D] some split wrote: the log-sum-exp merge of o_part
    [splits, T, Hq, D] f32 by lse [splits, T, Hq] f32; the others keep o's values (an
    unwritten split's lse is -inf, its o_part undefined and never used)."""
    mx = lse.max(axis=0)
    written = mx > -jnp.inf
    w = jnp.exp(lse - jnp.where(written, mx, 0.0))  # 0 for unwritten splits
    num = jnp.where((lse > -jnp.inf)[..., None], w[..., None] * o_part, 0.0).sum(axis=0)
    den = jnp.where(written, w.sum(axis=0), 1.0)
    return jnp.where(written[..., None], (num / den[..., None]).astype(o.dtype), o)


def _launch(o, parts, q, k_flat, v_flat, layer, q_starts, kv_lens, tables, *,
            kv_heads: int, page_size: int, block_q: int, q_len_min: int, q_len_max: int,
            block_k: int, kv_splits: int, sm_scale: float, num_warps: int, num_stages: int,
            interpret: bool, n_alloc: int, max_blocks: int):
    """One launch over the sequences with q_len_min <= q_len <= q_len_max.

    kv_splits == 1: writes their rows of o [T, Hq, D] in place (the other rows keep o's
    values) -> (o, parts). Else writes their partials into parts = (o_part, lse) (None:
    new ones of `n_alloc` splits, lse filled with -inf; the other rows' and splits'
    entries are kept) -> (o, parts), merged by the caller."""
    t, hq, head_dim = q.shape
    group = hq // kv_heads
    n_seqs, n_table = tables.shape
    rows = max(_MIN_ROWS, _pow2(block_q * group))
    block_k = max(block_k, page_size)
    # block numbers: sequence s of this launch owns blocks block_starts[s] ..
    # block_starts[s + 1] - 1 (the other sequences none)
    q_lens = q_starts[1:] - q_starts[:-1]
    ours = (q_lens >= q_len_min) & (q_lens <= q_len_max)
    n_blocks = jnp.where(ours, (q_lens + block_q - 1) // block_q, 0)
    block_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                    jnp.cumsum(n_blocks, dtype=jnp.int32)])
    inputs = [layer, block_starts, q_starts, kv_lens, tables, q, k_flat, v_flat]
    if kv_splits == 1:
        aliased, out_shape = [o], jax.ShapeDtypeStruct(o.shape, o.dtype)
        aliases = {8: 0}
    else:
        if parts is None:  # o_part needs no fill: a row's split is read only where written
            aliased = [jnp.full((n_alloc, t, hq), -jnp.inf, jnp.float32)]
            aliases = {8: 1}
        else:
            n_alloc = parts[1].shape[0]
            aliased, aliases = list(parts), {8: 0, 9: 1}
        if kv_splits > n_alloc:
            raise ValueError(f"kv_splits={kv_splits} exceeds the {n_alloc} splits of the "
                             f"partials it writes into")
        out_shape = (jax.ShapeDtypeStruct((n_alloc, t, hq, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((n_alloc, t, hq), jnp.float32))
    kernel = functools.partial(
        _ragged_kernel, group=group, kv_heads=kv_heads, block_q=block_q, rows=rows,
        page_size=page_size, block_k=block_k, n_seqs=n_seqs, n_table=n_table,
        scale_log2=sm_scale * _LOG2E,
        allow_tf32=q.dtype != jnp.float32,  # float32 inputs get float32 products
        kv_splits=kv_splits, n_aliased=len(aliased))
    out = pl.pallas_call(
        kernel,
        grid=(max(1, max_blocks), kv_heads, kv_splits),
        in_specs=[pl.no_block_spec] * (len(inputs) + len(aliased)),
        out_specs=pl.no_block_spec if kv_splits == 1 else (pl.no_block_spec,) * 2,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_p{page_size}_bq{block_q}_bk{block_k}_s{kv_splits}",
    )(*inputs, *aliased)
    return (out, parts) if kv_splits == 1 else (o, tuple(out))


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_q_len", "small_q", "block_q",
                                             "block_k", "kv_splits", "num_warps",
                                             "num_stages", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_starts, *,
                           sm_scale: float, layer=None, max_q_len: int | None = None,
                           small_q: int | None = None,
                           block_q: int | None = None, block_k: int | None = None,
                           kv_splits: int | tuple[int, int] | None = None, num_warps: int = 4,
                           num_stages: int = 3, interpret: bool | None = None):
    """q [T, Hq, D]; k/v pages [Hkv, P, page, D] (or [L, Hkv, P, page, D] with `layer`, read
    in place); block_tables [S, W]; kv_lens [S]; q_starts [S + 1] -> [T, Hq, D].

    max_q_len: the caller's promise that no sequence has more new tokens (None: up to T);
    at most small_q (a decode step, a decode window) runs the decode launch alone, without
    the prefill launch, its block numbers and its partials. A longer sequence's rows are
    then left as zeros.

    small_q: sequences of at most this many new tokens run in the decode launch, in blocks
    of that many tokens (default: as many as fit 16 rows, 16 // G, at least 1);
    block_q: tokens per block of the longer sequences (default: 64 // G, at least small_q);
    block_k: keys per inner step (raised to the page size; default 128 in the decode
    launch, 64 in the prefill launch, whose tiles have more rows);
    kv_splits: programs per block along its keys, in both launches, or a pair (decode
    launch, prefill launch) (default: the module docstring's rule, per launch; 1 off the
    GPU).
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
    n_seqs = block_tables.shape[0]
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
    pair = kv_splits if isinstance(kv_splits, tuple) else (kv_splits, kv_splits)
    if len(pair) != 2 or any(n is not None and (not isinstance(n, int) or n < 1)
                             for n in pair):
        raise ValueError(f"kv_splits={kv_splits!r} must be an int >= 1, a pair of them "
                         f"(decode launch, prefill launch), or None for the default rule")
    k_flat, v_flat = (x.reshape(rows_total, num_pages * page_size, head_dim)
                      for x in (k_pages, v_pages))
    args = (k_flat, v_flat, layer, q_starts.astype(jnp.int32), kv_lens.astype(jnp.int32),
            block_tables.astype(jnp.int32))
    sm_count = _sm_count()
    # (block_q, q_len range, block_k, the largest plausible number of real blocks)
    launches = [(small_q, 1, small_q, block_k or 128, min(n_seqs, t))]  # decode, verify
    if max_q_len is not None and max_q_len < 1:
        raise ValueError(f"max_q_len={max_q_len} must be >= 1 (or None)")
    if t > small_q and (max_q_len is None or max_q_len > small_q):  # prefill chunks
        launches.append((block_q, small_q + 1, t, block_k or 64,
                         t // block_q + min(n_seqs, t // (small_q + 1))))
    splits = [given or _pick_splits(n, kv_heads, t, sm_count)
              for given, (*_, n) in zip(pair, launches)]
    o = jnp.zeros_like(q)  # rows past q_starts[S] stay zero
    parts = None  # the split launches' partials, one buffer shared by both
    n_alloc = max(splits)
    for (bq, q_min, q_max, bk, n_blocks), n_splits in zip(launches, splits):
        o, parts = _launch(
            o, parts, q, *args, kv_heads=kv_heads, page_size=page_size, block_q=bq,
            q_len_min=q_min, q_len_max=q_max, block_k=bk, kv_splits=n_splits,
            sm_scale=sm_scale, num_warps=num_warps, num_stages=num_stages,
            interpret=interpret, n_alloc=n_alloc, max_blocks=n_blocks)
    if parts is not None:
        o = merge_partials(o, *parts)
    return o
