"""Decode attention and the output projection in one kernel (Pallas, Triton lowering).

At batch 1 the attention of one new token over its cache is a few microseconds of latency
on a few dozen programs (one per kv head and context split), and the output projection
after it is a weight read of megabytes that cannot start until attention is done: two
launches, and the weight read waits for the attention's tail. Here both are one grid:

- programs [0, A): attention, one per (row, kv head, context split): the split's keys
  and values in float32 on CUDA cores (one token's queries are a handful of rows), an
  online softmax over the split's blocks, the partial output and log-sum-exp stored;
  the last split of a (row, kv head) to finish (an atomic count after a program barrier)
  merges the partials by log-sum-exp into the attention output (float32, [B, Hq * D])
  and counts the head done;
- programs [A, A + N / rb): the output projection, rb outputs each. A program loads its
  weight rows and residual first, then waits (polling the done count) until every head
  is merged, reads the attention output from L2 and finishes: out = residual + o @ Wo^T.

The weight read thus overlaps the attention instead of following it. Programs start in
grid order, so the attention programs, which never wait, are running or done before any
projection program waits on them. The counters (int32 zeros, [B * Hkv + 1]) come from the
kernel before (`gemv_triton.decode_gemv(..., zeros=)`); they are left counted up.
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
_NEG = -1e30
# tokens per attention step; outputs per projection program (at most `proj_elems` weight
# elements held per program); warps per program
TUNED = {"block_t": 128, "proj_elems": 16384, "num_warps": 8, "splits": None}


def _kernel(len_ref, q_ref, k_ref, v_ref, w_ref, res_ref, cnt_in_ref, out_ref, o_part_ref,
            lse_part_ref, attn_ref, cnt_ref, *, rows: int, kv_heads: int, group: int,
            head_dim: int, n_splits: int, block_t: int, steps_per_split: int, max_len: int,
            k: int, rb: int, scale_log2: float, interpret: bool):
    pid = pl.program_id(0)
    n_attn = rows * kv_heads * n_splits

    @pl.when(pid < n_attn)
    def _():
        _attention(pid, len_ref, q_ref, k_ref, v_ref, o_part_ref, lse_part_ref, attn_ref,
                   cnt_ref, rows=rows, kv_heads=kv_heads, group=group, head_dim=head_dim,
                   n_splits=n_splits, block_t=block_t, steps_per_split=steps_per_split,
                   max_len=max_len, scale_log2=scale_log2, interpret=interpret)

    @pl.when(pid >= n_attn)
    def _():
        _projection(pid - n_attn, w_ref, res_ref, attn_ref, out_ref, cnt_ref, rows=rows,
                    done_at=rows * kv_heads, k=k, rb=rb)


def _attention(pid, len_ref, q_ref, k_ref, v_ref, o_part_ref, lse_part_ref, attn_ref,
               cnt_ref, *, rows, kv_heads, group, head_dim, n_splits, block_t,
               steps_per_split, max_len, scale_log2, interpret):
    per_row = kv_heads * n_splits
    b = pid // per_row
    rest = pid - b * per_row
    h = rest // n_splits
    split = rest - h * n_splits
    length = jnp.minimum(len_ref[b], max_len)
    first = split * steps_per_split * block_t
    n_steps = jnp.clip(pl.cdiv(length - first, block_t), 0, steps_per_split)
    f32 = jnp.float32
    # the group's queries, each a [1, D] row in the layout of the K / V tiles' rows
    qs = [q_ref[pl.ds(b, 1), h * group + g, :].astype(f32) for g in range(group)]
    tok = jnp.arange(block_t)

    def step(i, carry):
        t = first + i * block_t + tok
        valid = t < length
        mask = jnp.broadcast_to(valid[:, None], (block_t, head_dim))
        kt = pltriton.load(k_ref.at[b, h, pl.ds(first + i * block_t, block_t), :], mask=mask,
                           other=0).astype(f32)
        vt = pltriton.load(v_ref.at[b, h, pl.ds(first + i * block_t, block_t), :], mask=mask,
                           other=0).astype(f32)
        new = []
        for qg, (acc, m, l) in zip(qs, carry):
            s = jnp.where(valid, (kt * qg).sum(axis=1) * scale_log2, _NEG)  # [block_t]
            m_new = jnp.maximum(m, s.max())
            corr = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new)
            l = l * corr + p.sum()
            acc = acc * corr + (vt * p[:, None]).sum(axis=0, keepdims=True)  # [1, D]
            new.append((acc, m_new, l))
        return tuple(new)

    init = tuple((jnp.zeros((1, head_dim), f32), jnp.full((), _NEG, f32), jnp.zeros((), f32))
                 for _ in range(group))
    parts = jax.lax.fori_loop(0, n_steps, step, init)
    for g, (acc, m, l) in enumerate(parts):
        nonempty = l > 0
        o_part_ref[b, h, split, pl.ds(g, 1), :] = acc / jnp.where(nonempty, l, 1.0)
        lse_part_ref[b, h, split, g] = jnp.where(
            nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * _LN2, -jnp.inf)
    if not interpret:  # all of the program's stores come before its count
        pltriton.debug_barrier()
    counted = pltriton.atomic_add(cnt_ref, (b * kv_heads + h,), jnp.ones((), jnp.int32))

    @pl.when(counted == n_splits - 1)
    def _():  # the last split of (b, h): merge, then count the head done
        _merge(o_part_ref, lse_part_ref, attn_ref, b, h, group=group, head_dim=head_dim,
               n_splits=n_splits)
        if not interpret:
            pltriton.debug_barrier()
        pltriton.atomic_add(cnt_ref, (jnp.int32(rows * kv_heads),), jnp.ones((), jnp.int32))


def _merge(o_part_ref, lse_part_ref, attn_ref, b, h, *, group, head_dim, n_splits):
    """attn[b, (h * group + g) * D + d] = the log-sum-exp merge over splits, as one
    [splits, group x D] tile."""
    sp = 1 << (n_splits - 1).bit_length()
    width = (1 << (group - 1).bit_length()) * head_dim
    s_idx = jnp.broadcast_to(jnp.arange(sp)[:, None], (sp, width))
    col = jnp.broadcast_to(jnp.arange(width)[None, :], (sp, width))
    g, d = col // head_dim, col % head_dim
    ok = (s_idx < n_splits) & (g < group)
    lse = pltriton.load(lse_part_ref.at[b, h, s_idx, g], mask=ok, other=-jnp.inf)
    o = pltriton.load(o_part_ref.at[b, h, s_idx, g, d], mask=ok, other=0.0)
    mx = lse.max(axis=0)
    mx = jnp.where(mx > -jnp.inf, mx, 0.0)
    w = jnp.exp(lse - mx[None, :])  # 0 for empty splits
    den = w.sum(axis=0)
    out = (w * o).sum(axis=0) / jnp.where(den > 0, den, 1.0)
    c = jnp.arange(width)
    pltriton.store(attn_ref.at[b, h * group * head_dim + c], out, mask=c < group * head_dim)


def _projection(j, w_ref, res_ref, attn_ref, out_ref, cnt_ref, *, rows, done_at, k, rb):
    f32 = jnp.float32
    w = w_ref[pl.ds(j * rb, rb), :].astype(f32)  # [rb, K], loaded before the wait
    res = [res_ref[r, pl.ds(j * rb, rb)].astype(f32) for r in range(rows)]
    zero = jnp.zeros((), jnp.int32)

    def poll(done):  # an acquiring read: the heads' stores (released by their counts)
        return pltriton.atomic_add(cnt_ref, (jnp.int32(done_at),), zero)

    jax.lax.while_loop(lambda done: done < done_at, poll, poll(zero))
    for r in range(rows):
        x = attn_ref[pl.ds(r, 1), :]  # [1, K] float32, written by the attention programs
        y = (w * x).sum(axis=1) + res[r]
        out_ref[r, pl.ds(j * rb, rb)] = y.astype(out_ref.dtype)


def unsupported_reason(q, k_cache, w) -> str | None:
    """Why the kernel cannot take these shapes (None if it can)."""
    rows, hq, d = q.shape
    n, kdim = w.shape
    if rows > 4:
        return f"{rows} rows: the fused attention + projection takes at most 4"
    if d & (d - 1) or d < 16:
        return f"head_dim={d} is not a power of two >= 16"
    if kdim != hq * d:
        return f"the projection contracts {kdim}, not Hq x D = {hq * d}"
    if kdim & (kdim - 1) or n % 16:
        return f"projection [{n}, {kdim}]: K must be a power of two and N a multiple of 16"
    return None


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_t", "splits", "rb",
                                             "num_warps", "interpret"))
def attention_o_proj(q, k_cache, v_cache, lengths, w, residual, counters, *,
                     sm_scale: float | None = None, block_t: int | None = None,
                     splits: int | None = None, rb: int | None = None,
                     num_warps: int | None = None, interpret: bool | None = None):
    """residual + attention(q, cache) @ w^T, for one new token per row.

    q [B, Hq, D] (the token at position lengths[b] - 1, already in the cache); k/v cache
    [B, Hkv, T, D]; lengths int32 [B] (keys 0 .. lengths[b] - 1 are seen); w [N, Hq * D]
    out-major; residual [B, N]; counters int32 zeros [B * Hkv + 1]. -> [B, N] in
    residual's dtype.
    """
    rows, hq, d = q.shape
    _, kv_heads, max_len, _ = k_cache.shape
    n, kdim = w.shape
    why = unsupported_reason(q, k_cache, w)
    if why:
        raise ValueError(f"attention_o_proj: {why}")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != rows or k_cache.shape[3] != d \
            or hq % kv_heads:
        raise ValueError(f"attention_o_proj: q {q.shape} does not fit the cache "
                         f"{k_cache.shape} / {v_cache.shape}")
    if residual.shape != (rows, n) or lengths.shape != (rows,):
        raise ValueError(f"attention_o_proj: residual {residual.shape} must be [{rows}, {n}] "
                         f"and lengths {lengths.shape} [{rows}]")
    if counters.shape != (rows * kv_heads + 1,):
        raise ValueError(f"attention_o_proj: counters must be int32 zeros "
                         f"[B * Hkv + 1] = [{rows * kv_heads + 1}]; got {counters.shape}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    group = hq // kv_heads
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    block_t = block_t or TUNED["block_t"]
    block_t = min(block_t, 1 << (max_len - 1).bit_length())
    n_blocks = pl.cdiv(max_len, block_t)
    if splits is None:
        splits = TUNED["splits"] or _pick_splits(rows * kv_heads, n_blocks)
    splits = max(1, min(splits, n_blocks))
    steps_per_split = pl.cdiv(n_blocks, splits)
    splits = pl.cdiv(n_blocks, steps_per_split)
    if rb is None:
        rb = max(1, min(16, TUNED["proj_elems"] // kdim))
        while n % rb:
            rb //= 2
    if n % rb:
        raise ValueError(f"attention_o_proj: rb={rb} does not divide N={n}")
    grid = rows * kv_heads * splits + n // rb
    f32 = jnp.float32
    kernel = functools.partial(
        _kernel, rows=rows, kv_heads=kv_heads, group=group, head_dim=d, n_splits=splits,
        block_t=block_t, steps_per_split=steps_per_split, max_len=max_len, k=kdim, rb=rb,
        scale_log2=sm_scale * _LOG2E, interpret=interpret)
    out_shape = (jax.ShapeDtypeStruct((rows, n), residual.dtype),
                 jax.ShapeDtypeStruct((rows, kv_heads, splits, group, d), f32),
                 jax.ShapeDtypeStruct((rows, kv_heads, splits, group), f32),
                 jax.ShapeDtypeStruct((rows, kdim), f32),
                 jax.ShapeDtypeStruct(counters.shape, jnp.int32))
    out = pl.pallas_call(
        kernel,
        grid=(grid,),
        in_specs=[pl.no_block_spec] * 7,
        out_specs=(pl.no_block_spec,) * 5,
        out_shape=out_shape,
        input_output_aliases={6: 4},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or TUNED["num_warps"],
                                                num_stages=1),
        interpret=interpret,
        name=f"decode_attn_o_s{splits}_t{block_t}_rb{rb}",
    )(lengths.astype(jnp.int32), q, k_cache, v_cache, w.astype(q.dtype), residual,
      counters.astype(jnp.int32))
    return out[0]


def _pick_splits(heads: int, n_blocks: int) -> int:
    """Context splits per (row, kv head), as the decode-attention kernel picks them: one
    block each where up to ~4 programs per SM allow, so that no program runs a chain of
    dependent blocks (splits past a row's length are empty and cheap)."""
    from jaxllm.kernels.pallas.paged_triton import _pick_splits as pick
    return pick(heads, 1, n_blocks)
