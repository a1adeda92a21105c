"""Grouped matmul (the experts of an MoE layer) in Pallas with the Mosaic GPU lowering
(Hopper): the forward and d lhs kernels; d rhs runs gmm_triton's transposed kernel.

The op is gmm_triton's: lhs [M, K] with its rows sorted by group (group g owns rows
starts[g] .. ends[g] - 1), rhs [G, K, N]; out [M, N] = lhs_g @ rhs[g] on each group's rows,
zeros past the last group. d lhs [M, K] = dout_g @ rhs[g]^T is the same kernel reading
each rhs tile [bn, bk] transposed in shared memory (wgmma takes the transposed operand;
no copy of rhs^T is made).

Work: gmm_triton's (group, row tile) work items (`gmm_triton._work_items`, a few jnp ops,
no device loop), block_m-row tiles, so a tile that straddles group boundaries is computed
once for each group in it; the rows past the last group are one more group whose items
store zeros. A unit is (item, column tile), the column tiles of an item adjacent. The grid
is persistent: min(units, SMs) programs, program p running units p, p + P, p + 2P, ...;
units of dead items (group -1, past the real count) take no steps and store nothing.

A program is three warpgroups:

  producer   walks its units' K steps (bk = 64 columns: one 128-byte swizzle row of a
             16-bit type) and TMA-copies, per step, the two halves of the lhs row tile
             ([block_m / 2, 64] each) and the rhs[g] tile ([64, bn], or [bn, 64] for d
             lhs) into slot step % stages of a shared-memory ring; a slot's "loaded"
             barrier takes the three copies, its "free" barrier both consumers. The ring's
             steps run on across units, so the next unit's tiles load during this
             unit's last products and its epilogue.
  consumer w (two): owns rows w * block_m / 2 .. of the tile: wgmma of its lhs half
             [block_m / 2, 64] by the rhs tile into a float32 accumulator [block_m / 2, bn]
             (at most 64 x 256: 128 registers a thread), one wgmma kept in flight (a slot
             is freed once the product after it is issued and the one reading it is done).
             Epilogue: the accumulator in the output dtype into the warpgroup's own staging
             tile in shared memory (no swizzle, so any row can start a copy), then TMA stores
             of only its group's rows: the count of valid rows, written in binary, gives
             at most log2(block_m / 2) + 1 stores of 2^i rows each (TMA boxes are static).
             The staging tile is rewritten once the last unit's stores have read it.

Shared memory (bf16, block_m 128, bn 256): a ring step is 16 + 32 KiB, the staging tiles
64 KiB, so 3 stages (208 KiB); with bn 128 (N = 1408 takes no 256-column tiles) 4 stages.
`num_stages=None` takes the most (up to 4) that fit.

Shapes: K and N multiples of 64; bn is the largest multiple of 64 <= block_n dividing
the output columns. M is any: lhs is padded to whole row tiles (a copy only when
M % block_m != 0) and only rows < M are stored.

Under JAX's Mosaic GPU simulator (the CPU tests) the d lhs product reads its operands as
arrays (the simulator's wgmma takes no transposed refs); everything else, the forward's
wgmma included, is the code that runs on the GPU.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.pallas import gmm_triton
from jaxllm.kernels.pallas import mosaic_common as mg

DTYPES = ("bfloat16", "float16")
BK = 64  # K step: one 128-byte swizzle row of a 16-bit type
N_WG = 2  # consumer warpgroups
MAX_ACC = 64 * 256  # float32 accumulator elements a consumer warpgroup holds (128 a thread)
MAX_STAGES = 4
# Registers a thread of the consumer / producer warpgroups, as the flash forward.
REGISTERS = (232, 40)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_m x block_n output tiles (block_m in {128, 256}: two consumer warpgroups of
    block_m / 2 rows; block_n a multiple of 64, at most 256; (block_m / 2) x block_n at
    most 64 x 256), a ring of num_stages K steps (None: the most, up to 4, that fit)."""
    block_m: int = 128
    block_n: int = 256
    num_stages: int | None = None

    def __post_init__(self):
        if self.block_m not in (128, 256):
            raise ValueError(f"BlockSizes.block_m={self.block_m!r} must be 128 or 256 (two "
                             f"warpgroups of 64 or 128 rows)")
        if not isinstance(self.block_n, int) or self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"BlockSizes.block_n={self.block_n!r} must be a multiple of 64 "
                             f"in [64, 256]")
        if self.block_m // N_WG * self.block_n > MAX_ACC:
            raise ValueError(f"BlockSizes block_m={self.block_m}, block_n={self.block_n}: a "
                             f"warpgroup's accumulator {self.block_m // N_WG}x{self.block_n} "
                             f"exceeds 64x256; use block_n <= {MAX_ACC * N_WG // self.block_m}")
        if self.num_stages is not None and (not isinstance(self.num_stages, int)
                                            or self.num_stages < 2):
            raise ValueError(f"BlockSizes.num_stages={self.num_stages!r} must be an int >= 2 "
                             f"or None")


def col_tile(n: int, most: int) -> int:
    """The largest multiple of 64 <= most dividing n (n a multiple of 64)."""
    bn = most
    while n % bn:
        bn -= 64
    return bn


def smem_bytes(bm: int, bn: int, stages: int, itemsize: int, out_itemsize: int) -> int:
    """The ring (lhs and rhs tiles) and the consumers' output staging tiles."""
    return stages * (bm * BK + BK * bn) * itemsize + bm * bn * out_itemsize


def _stages(bs: BlockSizes, bn: int, itemsize: int, out_itemsize: int) -> int:
    fits = lambda s: smem_bytes(bs.block_m, bn, s, itemsize, out_itemsize) <= mg.SMEM_BUDGET
    if bs.num_stages is None:
        stages = next((s for s in range(MAX_STAGES, 1, -1) if fits(s)), None)
        if stages is None:
            raise ValueError(f"block_m={bs.block_m} x bn={bn} tiles leave no room for a "
                             f"2-stage ring in shared memory; use a smaller block_n")
    else:
        stages = bs.num_stages
        if not fits(stages):
            raise ValueError(f"num_stages={stages} with block_m={bs.block_m} x bn={bn} tiles "
                             f"needs {smem_bytes(bs.block_m, bn, stages, itemsize, out_itemsize)}"
                             f" bytes of shared memory (at most {mg.SMEM_BUDGET}); use fewer "
                             f"stages or num_stages=None")
    return stages


def _gmm(lhs, rhs, group_sizes, out_dtype, *, trans_rhs: bool, bs: BlockSizes,
         interpret: bool):
    """lhs [M, K] x rhs [G, K, N] (trans_rhs: [G, N, K]) -> [M, N] in out_dtype."""
    m, k = lhs.shape
    g_count = rhs.shape[0]
    n = rhs.shape[1] if trans_rhs else rhs.shape[2]
    bm, bn = bs.block_m, col_tile(n, bs.block_n)
    wg_rows = bm // N_WG
    dtype, out_dtype = jnp.dtype(lhs.dtype), jnp.dtype(out_dtype)
    k_steps = k // BK
    stages = _stages(bs, bn, dtype.itemsize, out_dtype.itemsize)
    n_items = pl.cdiv(m, bm) + g_count
    n_col = n // bn
    n_units = n_items * n_col
    programs = min(n_units, mg.sm_count(interpret))
    starts, ends = gmm_triton._group_bounds(group_sizes, m)
    group, tile = gmm_triton._work_items(starts, ends, bm, n_items)
    lhs = mg.pad_axis(lhs, 0, mg.round_up(m, bm))  # whole row tiles for the TMA loads
    sim = interpret

    def kernel(group_ref, tile_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref,
               lhs_ring, rhs_ring, o_smem, loaded, free):
        pid, wg = lax.axis_index("programs"), lax.axis_index("wg")
        n_mine = mg.cdiv_nonneg(n_units - pid, programs)

        def coords(j):
            """Unit j of this program: (group, its row range lo..hi, first row of the tile,
            column tile, K steps); dead units and the rows past the last group take none."""
            u = pid + j * programs
            item, col = lax.div(u, jnp.int32(n_col)), lax.rem(u, jnp.int32(n_col))
            g = group_ref[item]
            gg = jnp.maximum(g, 0)
            live = (g >= 0) & (g < g_count)
            n_steps = jnp.where(live, jnp.int32(k_steps), 0)
            return g, starts_ref[gg], ends_ref[gg], tile_ref[item] * bm, col, n_steps

        def rhs_tile(g, s, col):
            g = jnp.minimum(g, g_count - 1)
            if trans_rhs:  # rhs[g] is [N, K]
                return rhs_ref.at[g, pl.ds(col * bn, bn), pl.ds(s * BK, BK)]
            return rhs_ref.at[g, pl.ds(s * BK, BK), pl.ds(col * bn, bn)]

        @pl.when(wg == N_WG)
        def _produce():
            plgpu.set_max_registers(REGISTERS[1], action="decrease")

            def unit(j, base):
                g, _, _, row0, col, n_steps = coords(j)

                @pl.loop(0, n_steps)
                def _(s):
                    step = base + s
                    slot = lax.rem(step, jnp.int32(stages))
                    pl.when(step >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
                    for w in range(N_WG):
                        plgpu.copy_gmem_to_smem(
                            lhs_ref.at[pl.ds(row0 + w * wg_rows, wg_rows), pl.ds(s * BK, BK)],
                            lhs_ring.at[slot, w], loaded.at[slot])
                    plgpu.copy_gmem_to_smem(rhs_tile(g, s, col), rhs_ring.at[slot],
                                            loaded.at[slot])
                return base + n_steps

            total = lax.fori_loop(0, n_mine, unit, jnp.int32(0))
            mg.drain(total, stages, [free])

        @pl.when(wg < N_WG)
        def _consume():
            plgpu.set_max_registers(REGISTERS[0], action="increase")

            def operands(base, s):
                slot = lax.rem(base + s, jnp.int32(stages))
                plgpu.barrier_wait(loaded.at[slot])
                return lhs_ring.at[slot, wg], rhs_ring.at[slot]

            def release(base, s):
                plgpu.barrier_arrive(free.at[lax.rem(base + s, jnp.int32(stages))])

            def products(base, n_steps):
                """The unit's float32 accumulator [wg_rows, bn] over its n_steps K steps."""
                if sim and trans_rhs:  # the simulator's wgmma takes no transposed refs
                    def step(s, acc):
                        a, b = operands(base, s)
                        acc = acc + lax.dot_general(a[...], b[...], (((1,), (1,)), ((), ())),
                                                    preferred_element_type=jnp.float32)
                        release(base, s)
                        return acc
                    return lax.fori_loop(0, n_steps, step,
                                         jnp.zeros((wg_rows, bn), jnp.float32))

                def scoped(acc_ref):
                    @pl.loop(0, n_steps)
                    def _(s):
                        a, b = operands(base, s)
                        plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if trans_rhs else b)
                        plgpu.wgmma_wait(1)  # the product of step s - 1 is done
                        pl.when(s > 0)(lambda: release(base, s - 1))

                    plgpu.wgmma_wait(0)
                    pl.when(n_steps > 0)(lambda: release(base, n_steps - 1))
                    return acc_ref[...]
                return pl.run_scoped(scoped, plgpu.ACC((wg_rows, bn), jnp.float32))

            def unit(j, base):
                g, lo, hi, row0, col, n_steps = coords(j)
                acc = products(base, n_steps)

                @pl.when(g >= 0)
                def _store():
                    # the last unit's stores have read the staging tile
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o_tile = o_smem.at[wg]
                    o_tile[...] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    # this warpgroup's rows of the group: first..first + count - 1
                    my0 = row0 + wg * wg_rows
                    first = jnp.maximum(lo, my0)
                    count = jnp.maximum(jnp.minimum(hi, my0 + wg_rows) - first, 0)
                    off = first - my0
                    size = wg_rows
                    while size:  # count in binary: a store of `size` rows per set bit
                        part = lax.bitwise_and(count, jnp.int32(size))

                        @pl.when(part != 0)
                        def _(off=off, size=size):
                            plgpu.copy_smem_to_gmem(
                                o_tile.at[pl.ds(off, size)],
                                out_ref.at[pl.ds(my0 + off, size), pl.ds(col * bn, bn)],
                                commit_group=False)
                        off = off + part
                        size //= 2
                    plgpu.commit_smem_to_gmem_group()
                return base + n_steps

            lax.fori_loop(0, n_mine, unit, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

    rhs_block = (bn, BK) if trans_rhs else (BK, bn)
    scratch = [
        mg.smem((stages, N_WG, wg_rows, BK), dtype),
        mg.smem((stages, *rhs_block), dtype),
        plgpu.SMEM((N_WG, wg_rows, bn), out_dtype),  # no swizzle: a copy may start at any row
        plgpu.Barrier(num_arrivals=N_WG + 1, num_barriers=stages),  # 3 copies a step
        plgpu.Barrier(num_arrivals=N_WG, num_barriers=stages),
    ]
    name = f"gmm_mosaic{'_rhs_t' if trans_rhs else ''}_{bm}x{bn}x{BK}_s{stages}"
    return mg.launch(kernel, jax.ShapeDtypeStruct((m, n), out_dtype), scratch,
                     grid=(programs,), grid_names=("programs",), compute_wgs=N_WG, name=name,
                     interpret=interpret, reduction_scratch=0)(
        group, tile, starts, ends, lhs, rhs)


# ----------------------------------------------------------------- public API


def _drhs(lhs, dout, group_sizes, rhs, bs, interpret):
    """d rhs: gmm_triton's transposed kernel at its own default tiles (no Mosaic one yet)."""
    del bs
    tbs = gmm_triton.default_block_sizes(jnp.dtype(lhs.dtype).itemsize)
    return gmm_triton._tgmm(lhs, dout, group_sizes, rhs.shape[0], rhs.dtype, bs=tbs,
                            interpret=interpret)


_grouped = gmm_triton.differentiable(_gmm, _drhs)


def unsupported_reason(lhs, rhs, group_sizes) -> str | None:
    """Why the kernels cannot take lhs [M, K], rhs [G, K, N] (None if they can)."""
    del group_sizes
    return gmm_triton.shape_reason(lhs, rhs, DTYPES, BK, "the wgmma K step of both products")


def _block_sizes(kwargs: dict) -> BlockSizes:
    return gmm_triton.block_sizes_from(kwargs, BlockSizes, BlockSizes(), "pallas_mosaic")


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None,
                   interpret: bool | None = None, **kwargs):
    """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes int [G] -> [M, N];
    see kernels.grouped_matmul. Differentiable in lhs and rhs: d lhs with this module's
    kernel, d rhs with gmm_triton's.

    kwargs: `block_sizes=BlockSizes(...)` and/or any of its fields (e.g. block_n=128).
    """
    gmm_triton.check_operands(lhs, rhs)
    why = unsupported_reason(lhs, rhs, group_sizes)
    if why:
        raise ValueError(f"pallas_mosaic grouped_matmul cannot take {why}; use "
                         f"impl='pallas_triton' or 'xla'")
    bs = _block_sizes(dict(kwargs))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return _grouped(lhs, rhs, group_sizes, out_dtype, bs, bool(interpret))
