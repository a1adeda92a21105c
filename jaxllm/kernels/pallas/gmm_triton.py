"""Grouped matmul (the experts of an MoE layer) in Pallas with the Triton lowering:
forward and backward.

lhs [M, K] has its rows sorted by group: group g owns rows starts[g] .. ends[g] - 1
(ends = the running sum of group_sizes, capped at M); rhs [G, K, N]. Three products:

  forward   out [M, N] = lhs_g @ rhs[g] on each group's rows, zeros past the last group;
  d lhs     [M, K] = dout_g @ rhs[g]^T: the same kernel, reading each rhs tile transposed
            (no copy of rhs^T is made);
  d rhs     [G, K, N], d rhs[g] = lhs_g^T @ dout_g: the "transposed" grouped matmul.

Forward and d lhs: tiles of bm rows x `block_n` columns, bm the rows per group on average
as a power of two between 16 and `block_m` (`_row_tile`). A row tile may straddle
group boundaries, so the work items are (group, row tile) pairs: group g visits the row
tiles from starts[g] // bm to (ends[g] - 1) // bm, and a program computes its
tile with rhs[g] and stores only the rows of g (masked loads and stores). The rows past
the last group form one more "group" whose items store zeros. The items come from
group_sizes in a few small jnp ops on the device, none of them a loop (`_work_items`);
their number is at most M / bm + G (each of the G inner group boundaries splits at most
one tile), which is the static grid. Items past the real count return at once. A
straddled tile is computed once for each group in it, so the tiles cost about M + G x bm
rows of products: with a few rows per group (a decode step's tokens x top_k over many
experts) 16-row tiles, not `block_m`-row ones, keep that near M. Items are numbered in group
order and each item's column tiles are adjacent program ids, so the programs that run
together read the same rows of lhs and the same rhs[g] (they meet in L2).

d rhs: one program per (group, K tile, N tile), `t_block_k` x `t_block_n`; it walks its
group's rows `t_block_m` at a time (masked at the group's end) and sums lhs_g^T dout_g in
float32. An empty group walks no rows and stores zeros. Programs of one group are adjacent
(they share its rows in L2), the groups in order of decreasing size (with skewed routing
the largest group's programs are the longest; started last, they would end the grid alone).

Products accumulate in float32 (float32 inputs with full-precision products: no TF32);
the backward runs in the inputs' dtype (the output cotangent is cast to it). The
contracted dims of forward and d lhs (K and N) must be multiples of 16, the least
Triton's dot takes; the step along them is the largest power of two <= `block_k` that
divides them. Rows, and the output columns, need not be tile multiples (masked).
Offsets are int32: every array must hold fewer than 2**31 elements.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MIN_BLOCK = 16  # the smallest tile Triton's dot accepts
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles and launch settings (tile sizes powers of two >= 16).

    block_m x block_n output tiles, steps of block_k: the forward and d lhs kernel.
    t_block_k x t_block_n output tiles, steps of t_block_m rows: the d rhs kernel.
    """
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    t_block_m: int = 32
    t_block_k: int = 128
    t_block_n: int = 128
    t_num_warps: int = 4
    t_num_stages: int = 3

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"BlockSizes.{f.name}={val!r} must be a positive int")
            if "block" in f.name and (val < MIN_BLOCK or val & (val - 1)):
                raise ValueError(f"BlockSizes.{f.name}={val} must be a power of two >= "
                                 f"{MIN_BLOCK}")


def default_block_sizes(itemsize: int) -> BlockSizes:
    """The tiles measured fastest on the H200 (benchmarks/grouped_matmul.py --tiles, then the
    one-GPU MoE train step) for 2-byte inputs;
    4-byte (float32) inputs take half the K step so that the staged tiles fit shared
    memory."""
    return BlockSizes() if itemsize <= 2 else BlockSizes(block_k=32)


def _step(dim: int, most: int) -> int:
    """The largest power of two <= `most` dividing `dim` (dim a multiple of 16)."""
    step = most
    while dim % step:
        step //= 2
    return step


def _mm(a, b, dims):
    # float32 inputs get full-precision (IEEE) products; Triton may otherwise use TF32.
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (dims, ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _grid2(rows, cols):
    """Index arrays [len(rows), len(cols)] of a 2-D tile (gathers on the CPU interpreter,
    pointer arithmetic in Triton; unlike pl.ds they are never clamped to the array)."""
    shape = (rows.shape[0], cols.shape[0])
    return jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape)


# ----------------------------------------------------------------- work items (forward)


def _group_bounds(group_sizes, m: int):
    """(starts, ends) int32 [G + 1] of the groups' rows, the last entry the rows past
    the last group."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def _work_items(starts, ends, bm: int, n_items: int):
    """(group, row tile) of each of `n_items` work items, group -1 past the real ones.

    An item's group is found by comparing it with every group's last item ([items, G + 1],
    one fused kernel), not by searchsorted's default binary search: that is a device loop,
    which XLA's GPU runtime steps from the host, a few launches an iteration and a break
    in the program's command buffers, for every grouped matmul of every MoE layer."""
    first = starts // bm
    count = jnp.where(ends > starts, (ends - 1) // bm - first + 1, 0)
    last_item = jnp.cumsum(count)  # one past each group's last item
    i = jnp.arange(n_items, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(last_item, i, side="right", method="compare_all"),
                        starts.shape[0] - 1)
    tile = first[group] + i - (last_item[group] - count[group])
    group = jnp.where(i < last_item[-1], group, -1).astype(jnp.int32)
    return group, tile.astype(jnp.int32)


# ----------------------------------------------------------------- forward and d lhs


def _gmm_kernel(group_ref, tile_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *,
                bm: int, bn: int, bk: int, n_col_tiles: int, n_groups: int, k: int, n: int,
                trans_rhs: bool):
    """Item pid // n_col_tiles, column tile pid % n_col_tiles: out rows of the item's
    group in its row tile = lhs rows @ rhs[g] ([K, N], or [N, K] read transposed)."""
    pid = pl.program_id(0)
    item, col_tile = lax.div(pid, n_col_tiles), lax.rem(pid, n_col_tiles)
    g = group_ref[item]
    lo, hi = starts_ref[jnp.maximum(g, 0)], ends_ref[jnp.maximum(g, 0)]
    rows = tile_ref[item] * bm + jnp.arange(bm)
    cols = col_tile * bn + jnp.arange(bn)
    row_ok = (rows >= lo) & (rows < hi)
    col_ok = cols < n
    lhs_ok = jnp.broadcast_to(row_ok[:, None], (bm, bk))
    rhs_ok = (jnp.broadcast_to(col_ok[:, None], (bn, bk)) if trans_rhs
              else jnp.broadcast_to(col_ok[None, :], (bk, bn)))

    def step(i, acc):
        kk = i * bk + jnp.arange(bk)
        a = pltriton.load(lhs_ref.at[_grid2(rows, kk)], mask=lhs_ok, other=0)
        if trans_rhs:  # rhs[g] is [N, K]: the tile [bn, bk], contracted on its dim 1
            b = pltriton.load(rhs_ref.at[(g, *_grid2(cols, kk))], mask=rhs_ok, other=0)
            return acc + _mm(a, b, ((1,), (1,)))
        b = pltriton.load(rhs_ref.at[(g, *_grid2(kk, cols))], mask=rhs_ok, other=0)
        return acc + _mm(a, b, ((1,), (0,)))

    @pl.when(g >= 0)
    def _():  # the rows past the last group (g == n_groups) take no steps: zeros
        steps = jnp.minimum(n_groups - g, 1) * (k // bk)  # 0 <= g <= n_groups
        acc = lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
        pltriton.store(out_ref.at[_grid2(rows, cols)], acc.astype(out_ref.dtype),
                       mask=row_ok[:, None] & col_ok[None, :])


def _row_tile(m: int, groups: int, most: int) -> int:
    """Rows of a forward / d lhs tile: the rows per group on average (m / groups) as a power
    of two, at least 16 and at most `most` (BlockSizes.block_m)."""
    return min(most, max(MIN_BLOCK, pl.next_power_of_2(pl.cdiv(m, groups))))


def tiles(m: int, groups: int, n: int, bs: BlockSizes | None = None,
          itemsize: int = 2) -> tuple[int, int]:
    """(rows, columns) of the forward and d lhs tiles for lhs [m, K] x rhs [groups, K, n]
    (bs: the default tiles of `itemsize`-byte inputs unless given)."""
    bs = bs or default_block_sizes(itemsize)
    return (_row_tile(m, groups, bs.block_m),
            min(bs.block_n, max(MIN_BLOCK, pl.next_power_of_2(n))))


def _gmm(lhs, rhs, group_sizes, out_dtype, *, trans_rhs: bool, bs: BlockSizes,
         interpret: bool):
    """lhs [M, K] x rhs [G, K, N] (trans_rhs: [G, N, K]) -> [M, N] in out_dtype."""
    m, k = lhs.shape
    g_count = rhs.shape[0]
    n = rhs.shape[1] if trans_rhs else rhs.shape[2]
    bm, bn = tiles(m, g_count, n, bs)
    bk = _step(k, bs.block_k)
    n_items = pl.cdiv(m, bm) + g_count
    n_col_tiles = pl.cdiv(n, bn)
    starts, ends = _group_bounds(group_sizes, m)
    group, tile = _work_items(starts, ends, bm, n_items)
    kernel = functools.partial(_gmm_kernel, bm=bm, bn=bn, bk=bk, n_col_tiles=n_col_tiles,
                               n_groups=g_count, k=k, n=n, trans_rhs=trans_rhs)
    return pl.pallas_call(
        kernel,
        grid=(n_items * n_col_tiles,),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps,
                                                num_stages=bs.num_stages),
        interpret=interpret,
        name=f"gmm{'_rhs_t' if trans_rhs else ''}_{bm}x{bn}x{bk}",
    )(group, tile, starts, ends, lhs, rhs)


# ----------------------------------------------------------------- d rhs (transposed)


def _tgmm_kernel(order_ref, starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, bm: int,
                 bk: int, bn: int, n_k_tiles: int, n_n_tiles: int, k: int, n: int):
    """Group order[pid // (K tiles x N tiles)]: out[g, K tile, N tile] = lhs_g^T @ dout_g."""
    pid = pl.program_id(0)
    per_group = n_k_tiles * n_n_tiles
    g, t = order_ref[lax.div(pid, per_group)], lax.rem(pid, per_group)
    kk = lax.div(t, n_n_tiles) * bk + jnp.arange(bk)
    nn = lax.rem(t, n_n_tiles) * bn + jnp.arange(bn)
    lo, hi = starts_ref[g], ends_ref[g]
    k_ok, n_ok = kk < k, nn < n
    r = jnp.arange(bm)

    def step(i, acc):
        rows = lo + i * bm + r
        ok = rows < hi
        a = pltriton.load(lhs_ref.at[_grid2(rows, kk)], mask=ok[:, None] & k_ok[None, :],
                          other=0)
        b = pltriton.load(dout_ref.at[_grid2(rows, nn)], mask=ok[:, None] & n_ok[None, :],
                          other=0)
        return acc + _mm(a, b, ((0,), (0,)))  # [bk, bn]

    steps = lax.div(jnp.maximum(hi - lo, 0) + (bm - 1), bm)
    acc = lax.fori_loop(0, steps, step, jnp.zeros((bk, bn), jnp.float32))
    idx = _grid2(kk, nn)
    pltriton.store(out_ref.at[(g, *idx)], acc.astype(out_ref.dtype),
                   mask=k_ok[:, None] & n_ok[None, :])


def _tgmm(lhs, dout, group_sizes, num_groups: int, out_dtype, *, bs: BlockSizes,
          interpret: bool):
    """lhs [M, K], dout [M, N] -> [G, K, N]: lhs_g^T @ dout_g per group (zeros if empty)."""
    m, k = lhs.shape
    n = dout.shape[1]
    bm = min(bs.t_block_m, max(MIN_BLOCK, pl.next_power_of_2(m)))
    bk = min(bs.t_block_k, max(MIN_BLOCK, pl.next_power_of_2(k)))
    bn = min(bs.t_block_n, max(MIN_BLOCK, pl.next_power_of_2(n)))
    n_k_tiles, n_n_tiles = pl.cdiv(k, bk), pl.cdiv(n, bn)
    starts, ends = _group_bounds(group_sizes, m)
    # largest groups first: their long row walks start early instead of ending the grid
    order = jnp.argsort(-(ends - starts)[:-1]).astype(jnp.int32)
    kernel = functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn, n_k_tiles=n_k_tiles,
                               n_n_tiles=n_n_tiles, k=k, n=n)
    return pl.pallas_call(
        kernel,
        grid=(num_groups * n_k_tiles * n_n_tiles,),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=bs.t_num_warps,
                                                num_stages=bs.t_num_stages),
        interpret=interpret,
        name=f"tgmm_{bm}x{bk}x{bn}",
    )(order, starts, ends, lhs, dout)


# ----------------------------------------------------------------- public API


def differentiable(gmm: Callable, drhs: Callable) -> Callable:
    """The differentiable grouped matmul (lhs, rhs, group_sizes, out_dtype, bs, interpret)
    of a kernel module: `gmm(lhs, rhs, group_sizes, out_dtype, trans_rhs=, bs=, interpret=)`
    runs the forward and, reading rhs transposed, d lhs; `drhs(lhs, dout, group_sizes, rhs,
    bs, interpret)` d rhs. The products of the backward run in the inputs' dtype."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
    def grouped(lhs, rhs, group_sizes, out_dtype, bs, interpret):
        return gmm(lhs, rhs, group_sizes, out_dtype, trans_rhs=False, bs=bs,
                   interpret=interpret)

    def fwd(lhs, rhs, group_sizes, out_dtype, bs, interpret):
        return grouped(lhs, rhs, group_sizes, out_dtype, bs, interpret), (lhs, rhs, group_sizes)

    def bwd(out_dtype, bs, interpret, res, dout):
        lhs, rhs, group_sizes = res
        dout = dout.astype(lhs.dtype)
        dlhs = gmm(dout, rhs, group_sizes, lhs.dtype, trans_rhs=True, bs=bs,
                   interpret=interpret)
        return dlhs, drhs(lhs, dout, group_sizes, rhs, bs, interpret), None

    grouped.defvjp(fwd, bwd)
    return grouped


_grouped = differentiable(_gmm, lambda lhs, dout, group_sizes, rhs, bs, interpret: _tgmm(
    lhs, dout, group_sizes, rhs.shape[0], rhs.dtype, bs=bs, interpret=interpret))


def unsupported_reason(lhs, rhs, group_sizes) -> str | None:
    """Why the kernels cannot take lhs [M, K], rhs [G, K, N] (None if they can)."""
    del group_sizes
    return shape_reason(lhs, rhs, DTYPES, MIN_BLOCK, "the contracted dims")


def check_operands(lhs, rhs) -> None:
    """lhs [M, K] and rhs [G, K, N] of one dtype, else a ValueError saying what came."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul wants lhs [M, K] and rhs [G, K, N]; got "
                         f"lhs{lhs.shape} rhs{rhs.shape}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs and rhs dtypes differ: {lhs.dtype}, {rhs.dtype}")


def shape_reason(lhs, rhs, dtypes, multiple: int, why: str) -> str | None:
    """Why a grouped-matmul kernel of `dtypes`, whose K and N must be multiples of
    `multiple` (for `why`), cannot take lhs [M, K], rhs [G, K, N] (None if it can)."""
    dtype = jnp.dtype(lhs.dtype).name
    if dtype not in dtypes:
        return f"{dtype} inputs (it takes {' or '.join(dtypes)})"
    k, n = rhs.shape[1], rhs.shape[2]
    if k % multiple or n % multiple:
        return f"K={k} and N={n} must be multiples of {multiple} ({why})"
    if max(lhs.size, lhs.shape[0] * n, rhs.size) >= 2**31:
        return f"lhs{lhs.shape} x rhs{rhs.shape}: arrays of 2**31 elements or more (int32 offsets)"
    return None


def block_sizes_from(kwargs: dict, cls, default, impl: str):
    """`kwargs`' `block_sizes=cls(...)` (else `default`) with any of its fields replaced
    by the other kwargs; a wrong type or an unknown name is a ValueError naming `impl`."""
    bs = kwargs.pop("block_sizes", None) or default
    if not isinstance(bs, cls):
        raise ValueError(f"block_sizes must be a {cls.__module__.rsplit('.', 1)[-1]}."
                         f"{cls.__name__}; got {type(bs).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown {impl} options {unknown}; valid: block_sizes, "
                         f"{sorted(names)}")
    return dataclasses.replace(bs, **kwargs)


def _block_sizes(itemsize: int, kwargs: dict) -> BlockSizes:
    return block_sizes_from(kwargs, BlockSizes, default_block_sizes(itemsize), "pallas_triton")


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None,
                   interpret: bool | None = None, **kwargs):
    """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes int [G] -> [M, N];
    see kernels.grouped_matmul. Differentiable in lhs and rhs.

    kwargs: `block_sizes=BlockSizes(...)` and/or any of its fields (e.g. block_m=64).
    """
    check_operands(lhs, rhs)
    why = unsupported_reason(lhs, rhs, group_sizes)
    if why:
        raise ValueError(f"pallas_triton grouped_matmul cannot take {why}; use impl='xla'")
    bs = _block_sizes(jnp.dtype(lhs.dtype).itemsize, dict(kwargs))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return _grouped(lhs, rhs, group_sizes, out_dtype, bs, bool(interpret))
