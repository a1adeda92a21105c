"""Building blocks of the Mosaic GPU (Hopper) Pallas kernels: shared-memory tiles in the
layout wgmma reads, wgmma in float32 (in place or into a fresh accumulator), register
layouts, and the producer loop of a warp-specialised TMA ring.

Every helper takes `sim`: under JAX's Mosaic GPU simulator (the CPU tests) register
layouts do not exist, `plgpu.load` and `pl.run_state` are not interpreted, and wgmma
takes neither register operands nor transposed refs; those helpers then fall back to
plain array code with the same arithmetic.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Shared memory a CTA may use on Hopper (227 KiB), less 2 KiB for barriers and row
# statistics: what a kernel's tiles and rings must fit in.
SMEM_BUDGET = 225 * 1024


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def cdiv_nonneg(x, m: int):
    """ceil(max(x, 0) / m) for an int32 scalar (lax.div truncates, so keep x >= 0)."""
    return lax.div(jnp.maximum(x, 0) + (m - 1), jnp.int32(m))


def floordiv_nonneg(x, m: int):
    return lax.div(jnp.maximum(x, 0), jnp.int32(m))


def slab_steps(first_row, rows, bk, offset, n_steps, n_unpadded, causal: bool):
    """(key tiles a slab of `rows` query rows from first_row streams, how many of the
    first of them need no mask) in a stream of n_steps key tiles of bk keys, of which
    the first n_unpadded hold no padded key; causal rows r see keys <= r + offset."""
    if not causal:
        return n_steps, jnp.int32(n_unpadded)
    my_steps = jnp.minimum(cdiv_nonneg(first_row + rows + offset, bk), n_steps)
    n_full = jnp.minimum(floordiv_nonneg(first_row + offset + 1, bk),
                         jnp.minimum(my_steps, n_unpadded))
    return my_steps, n_full


def mask_scores(sc, first_key, skv, last_key, causal: bool, sim: bool):
    """Scores sc (rows, keys) of keys first_key, first_key + 1, ... with -inf where the
    key is padding (>= skv) or, causal, after the row's last visible key (last_key, an
    array of sc's shape)."""
    cols = iota(sc.shape, 1, sim) + first_key
    ok = cols < skv
    if causal:
        ok = ok & (cols <= last_key)
    return jnp.where(ok, sc, -jnp.inf)


def clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def smem(shape, dtype, swizzle: int = 128):
    """Shared memory in the layout wgmma reads: tiles of 8 rows of `swizzle` bytes (8 x 64
    for 16-bit types at the default 128), swizzled as wide. A wgmma's two operands must
    share a swizzle."""
    cols = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                                plgpu.SwizzleTransform(swizzle)))


def bcast_rows(x, shape):
    """A per-row vector (layout WGMMA.reduce(1)) broadcast along the columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def layout(x, layout, sim: bool):
    """Pin a register layout (the simulator has no layouts)."""
    return x if sim else plgpu.layout_cast(x, layout)


def iota(shape, dim, sim: bool):
    if sim:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def dot(a, b, *, sim: bool, acc=None, trans_b: bool = False, a_ref: bool = True,
         during=None):
    """acc + a @ b (b^T when trans_b) in float32 with wgmma; acc None starts from zero.

    a is an SMEM ref (a_ref) or a register array, b an SMEM ref. `during` runs after
    the wgmma is issued and before it is awaited. With an acc, the product accumulates in
    place (`pl.run_state`). The simulator's wgmma takes neither register operands nor
    transposed refs, so there the operands are read and multiplied as arrays.
    """
    if sim:
        av = a[...] if a_ref else a
        dims = ((1,), (1,)) if trans_b else ((1,), (0,))
        r = lax.dot_general(av, b[...], (dims, ((), ())), preferred_element_type=jnp.float32)
        if during is not None:
            during()
        return r if acc is None else acc + r
    bb = b.transpose((1, 0)) if trans_b else b
    if acc is None:
        m, n = a.shape[0], (b.shape[0] if trans_b else b.shape[1])

        def fresh(ref):
            plgpu.wgmma(ref, a, bb)
            if during is not None:
                during()
            return ref[...]
        return pl.run_scoped(fresh, plgpu.ACC((m, n), jnp.float32))

    def body(ref):
        plgpu.wgmma(ref, a, bb)
        if during is not None:
            during()
    return pl.run_state(body)(plgpu.ACC.init(acc))


def dot_overlapped(q, k, p, v, acc, between, *, sim: bool, during=None):
    """(acc + p @ v, between(q @ k^T)): the two products issued back to back as async
    wgmmas (q, k, v SMEM refs; p, acc float32/16 register arrays), S = q @ k^T awaited
    first, so `between` runs while p @ v may still be in flight. `during` runs after
    both are issued. In the simulator the same arithmetic runs in the same order."""
    if sim:
        s = dot(q, k, trans_b=True, sim=True, during=during)
        res = between(s)
        return dot(p, v, acc=acc, a_ref=False, sim=True), res

    def scoped(s_ref, o_ref):
        o_ref[...] = acc
        plgpu.wgmma(s_ref, q, k.transpose((1, 0)))
        plgpu.wgmma(o_ref, p, v)
        if during is not None:
            during()
        res = between(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
        return plgpu.wgmma_accumulator_load(o_ref, wait_n=0), res
    return pl.run_scoped(scoped, plgpu.ACC((q.shape[0], k.shape[0]), jnp.float32),
                         plgpu.ACC(acc.shape, jnp.float32))


def dot_pv_qk(p, v, acc, q, k, *, sim: bool, during=None):
    """(acc + p @ v, q @ k^T), both awaited: p @ v issued first (p, acc register arrays;
    v, q, k SMEM refs), then q @ k^T right behind it, so the tensor pipe gets the two
    back to back. p's registers are defined before the first wgmma, so ptxas need not
    serialise the pair (it does, warning C7513, when a register operand is formed
    between them). `during` runs after both are issued."""
    if sim:
        o = dot(p, v, acc=acc, a_ref=False, sim=True)
        return o, dot(q, k, trans_b=True, sim=True, during=during)

    def scoped(s_ref, o_ref):
        o_ref[...] = acc
        plgpu.wgmma(o_ref, p, v)
        plgpu.wgmma(s_ref, q, k.transpose((1, 0)))
        if during is not None:
            during()
        o = plgpu.wgmma_accumulator_load(o_ref, wait_n=1)
        return o, plgpu.wgmma_accumulator_load(s_ref, wait_n=0)
    return pl.run_scoped(scoped, plgpu.ACC((q.shape[0], k.shape[0]), jnp.float32),
                         plgpu.ACC(acc.shape, jnp.float32))


def dot_pair_nt(a1, b1, a2, b2, then, *, sim: bool):
    """then(a1 @ b1^T, a2 @ b2^T) in float32, the two products issued back to back as
    async wgmmas (all four SMEM refs) and `then` entered once the first is done: its
    second argument is a function that waits for and returns the second product, so
    `then` can work on the first while the second runs. In the simulator the same
    arithmetic runs in the same order."""
    if sim:
        s1 = dot(a1, b1, trans_b=True, sim=True)
        return then(s1, lambda: dot(a2, b2, trans_b=True, sim=True))

    def scoped(r1, r2):
        plgpu.wgmma(r1, a1, b1.transpose((1, 0)))
        plgpu.wgmma(r2, a2, b2.transpose((1, 0)))
        s1 = plgpu.wgmma_accumulator_load(r1, wait_n=1)
        return then(s1, lambda: plgpu.wgmma_accumulator_load(r2, wait_n=0))
    return pl.run_scoped(scoped, plgpu.ACC((a1.shape[0], b1.shape[0]), jnp.float32),
                         plgpu.ACC((a2.shape[0], b2.shape[0]), jnp.float32))


def dots_into(accs, products, *, sim: bool):
    """accs, each accumulator i plus the sum of its products a @ b (products: [(i, a, b)]
    of SMEM refs), float32: every product issued as an async wgmma, in order, and all
    awaited once at the end. In the simulator the same arithmetic runs in the same order."""
    if sim:
        accs = list(accs)
        for i, a, b in products:
            accs[i] = dot(a, b, acc=accs[i], sim=True)
        return tuple(accs)

    def scoped(*refs):
        for ref, acc in zip(refs, accs):
            ref[...] = acc
        for i, a, b in products:
            plgpu.wgmma(refs[i], a, b)
        return tuple(plgpu.wgmma_accumulator_load(ref, wait_n=0) for ref in refs)
    return pl.run_scoped(scoped, *(plgpu.ACC(acc.shape, jnp.float32) for acc in accs))


def load_vec(ref, layout, sim: bool):
    """A 1-D float32 SMEM vector as a register array in `layout` (the simulator has no
    `plgpu.load`)."""
    if sim:
        return ref[...]
    try:  # jax >= 0.11 takes no index (and deprecates passing one)
        return plgpu.load(ref, layout=layout)
    except TypeError:
        return plgpu.load(ref, (), layout=layout)


def zeros(shape, sim: bool):
    return layout(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA, sim)


def produce_steps(base, n_steps, stages, groups):
    """Producer of a persistent program: the n_steps tiles of one work item go to ring
    steps base, base + 1, ... (slot = step % stages); from step `stages` on a slot is
    reused once its consumers have freed it. groups as in `produce`."""
    @pl.loop(0, n_steps)
    def _(s):
        step = base + s
        slot = lax.rem(step, jnp.int32(stages))
        for loaded, free, copies in groups:
            pl.when(step >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
            for src_fn, ring in copies:
                plgpu.copy_gmem_to_smem(src_fn(s), ring.at[slot], loaded.at[slot])


def drain(total, stages, frees):
    """After the last of `total` ring steps: see the consumers free the last slots, so that
    every thread that waits on a barrier has observed all of its phases at the end."""
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _(s):
        for free in frees:
            plgpu.barrier_wait(free.at[lax.rem(s, jnp.int32(stages))])


def produce_kv_tiles(n_tiles, stages, coords, group, bk, *streams, redo=None):
    """Producer of a query-tiled program (forward, dq): coords(i) -> (batch, head, _,
    steps) of its tile i, whose key tiles of kv head head // group stream through
    each of `streams`: (GMEM ref [B, S, Hkv, D], ring, loaded barriers, free barriers).
    Tile i's steps follow tile i - 1's on the ring.

    redo: None, or (wait, again): after the last tile, wait() and then stream once more
    the tiles i with again(i) true, in order (the consumers' second pass, see
    consume_tiles)."""
    def tile(i, base):
        bi, h, _, n_steps = coords(i)
        kv_h = lax.div(h, jnp.int32(group))
        groups = [(loaded, free, [(lambda s, ref=ref: ref.at[bi, pl.ds(s * bk, bk), kv_h],
                                   ring)])
                  for ref, ring, loaded, free in streams]
        produce_steps(base, n_steps, stages, groups)
        return base + n_steps
    total = lax.fori_loop(0, n_tiles, tile, jnp.int32(0))
    if redo is not None:
        wait, again = redo
        wait()
        total = lax.fori_loop(
            0, n_tiles, lambda i, base: lax.cond(again(i), tile, lambda i, b: b, i, base),
            total)
    drain(total, stages, [free for *_, free in streams])


def consume_tiles(n_tiles, n_buf, load, wait, body, redo=None):
    """Compute-warpgroup loop of a program that runs n_tiles tiles. load(i, buf) issues
    the copies of tile i's own operands (Q and the like) into buffer `buf`, wait(buf)
    awaits them, body(i, buf, base) runs tile i on ring steps base, base + 1, ...,
    stages its output in buffer `buf` for a TMA store and returns its number of steps.
    With two buffers the next tile's operands load during this tile, into the buffer
    that staged the last output once the TMA has read it; with one, after this tile.

    redo: None, or (done, again, body2): after the last tile (its stores complete),
    done(), then a second pass over the tiles i with again(i) true, in order, each
    loaded into buffer 0 and run by body2(i, 0, base) on the ring steps after the first
    pass's (the producer streams them again: produce_kv_tiles' `redo`)."""
    load(0, 0)

    def tile(i, base):
        buf = lax.rem(i, jnp.int32(n_buf)) if n_buf > 1 else 0
        wait(buf)
        if n_buf > 1:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            pl.when(i + 1 < n_tiles)(lambda: load(i + 1, 1 - buf))
        n_steps = body(i, buf, base)
        if n_buf == 1:
            @pl.when(i + 1 < n_tiles)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                load(i + 1, 0)
        return base + n_steps

    total = lax.fori_loop(0, n_tiles, tile, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)
    if redo is not None:
        done, again, body2 = redo
        done()

        def tile_again(i, base):
            load(i, 0)
            wait(0)
            n_steps = body2(i, 0, base)
            plgpu.wait_smem_to_gmem(0)
            return base + n_steps

        lax.fori_loop(0, n_tiles,
                      lambda i, base: lax.cond(again(i), tile_again, lambda i, b: b, i, base),
                      total)


def sm_count(sim: bool) -> int:
    """SMs of the device (132 where it does not say); 2 under the simulator, so that
    persistent programs there each run several items."""
    return 2 if sim else int(getattr(jax.devices()[0], "core_count", 0) or 132)


class TileSchedule:
    """Which (tile, head, batch) work a program of a query-tiled grid runs, in order.

    Plain: one program per tile, tile index fastest (the CTAs running together share
    K/V heads in L2); when causal the last tiles (most keys) come first. Persistent: one
    program per SM (2 programs under the simulator, so each runs several), program pid
    running tiles pid, pid + programs, ... of the same order. Causal work grows with the
    tile index, so there a static split is balanced by pairs: a head's tiles n_t - 1 - j
    and j (heaviest first) make a pair that streams as many keys whatever j; program pid
    runs pairs pid, pid + programs, ... (both tiles of each). The pairs run head by head,
    so the programs running together read few heads' K/V (it stays in L2), and a pair's
    second tile reads a prefix of its first one's. With n_t odd, the middle tiles of two
    heads make a pair, after all the others (the last one alone where there is one over).
    """

    def __init__(self, n_t: int, heads: int, batch: int, *, causal: bool,
                 persistent: bool, sim: bool, sms: int | None = None):
        self.n_t, self.heads, self.causal = n_t, heads, causal
        self.paired = causal and persistent
        self.n_items = n_t * heads * batch
        self.programs = self.n_items
        if persistent:
            if sms is None:
                sms = sm_count(sim)
            self.programs = min(self.n_pairs if self.paired else self.n_items, sms)
        self.multi = self.max_count > 1  # some program runs several tiles

    @property
    def n_pairs(self) -> int:
        return -(-self.n_items // 2)

    @property
    def max_count(self) -> int:
        """The most tiles a program runs."""
        if not self.paired:
            return -(-self.n_items // self.programs)
        rounds = -(-self.n_pairs // self.programs)  # program 0 runs the most pairs
        # ... and only it, when the last pair is one tile and falls to it
        alone = self.n_items % 2 and (self.n_pairs - 1) % self.programs == 0
        return 2 * rounds - int(bool(alone))

    def count(self, pid):
        """Tiles program pid runs."""
        if self.paired:
            n = 2 * cdiv_nonneg(self.n_pairs - pid, self.programs)
            if self.n_items % 2:  # the last pair is one tile
                n = n - (pid == (self.n_pairs - 1) % self.programs).astype(jnp.int32)
            return n
        return cdiv_nonneg(self.n_items - pid, self.programs)

    def query_tile(self, pid, i, *, rows, bk, n_kv, offset):
        """(batch, head, first row, key tiles to stream) of program pid's i-th tile of
        `rows` query rows; causal streams stop at the last key tile a row sees."""
        qt, h, bi = self.coords(pid, i)
        first_row = qt * rows
        if self.causal:
            n_steps = jnp.minimum(cdiv_nonneg(first_row + rows + offset, bk), n_kv)
        else:
            n_steps = jnp.int32(n_kv)
        return bi, h, first_row, n_steps

    def coords(self, pid, i):
        """(tile, head, batch) of program pid's i-th tile."""
        if self.paired:
            t = 2 * (pid + lax.div(i, jnp.int32(2)) * self.programs) + lax.rem(i, jnp.int32(2))
            per_head = 2 * (self.n_t // 2)  # the tiles of a head's full pairs
            n_paired = per_head * (self.n_items // self.n_t)
            e = lax.div(t, jnp.int32(max(per_head, 1)))  # (head, batch) of a full pair
            w = lax.rem(t, jnp.int32(max(per_head, 1)))
            j = lax.div(w, jnp.int32(2))
            tile = jnp.where(lax.rem(w, jnp.int32(2)) == 0, self.n_t - 1 - j, j)
            middle = t >= n_paired  # odd n_t: the middle tiles, one head after another
            e = jnp.where(middle, t - n_paired, e)
            tile = jnp.where(middle, self.n_t // 2, tile)
            return tile, lax.rem(e, jnp.int32(self.heads)), lax.div(e, jnp.int32(self.heads))
        t = pid + i * self.programs
        tile, rest = lax.rem(t, jnp.int32(self.n_t)), lax.div(t, jnp.int32(self.n_t))
        h, bi = lax.rem(rest, jnp.int32(self.heads)), lax.div(rest, jnp.int32(self.heads))
        if self.causal:
            tile = self.n_t - 1 - tile
        return tile, h, bi


def compiler_params(reduction_scratch=None):
    """approx_math; `reduction_scratch`: shared-memory bytes reserved for cross-warp
    reductions (None: Mosaic's default, 2 KiB). A kernel whose reductions stay inside a
    warp (rows of a wgmma tile) can pass 0 and give those bytes to its tiles."""
    extra = {} if reduction_scratch is None else dict(reduction_scratch_bytes=reduction_scratch)
    return plgpu.CompilerParams(approx_math=True, **extra)


def interpret_params(interpret):
    if not interpret:
        return None
    params = getattr(plgpu, "InterpretGPUParams", None)  # public from jax 0.11
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def launch(body, out_type, scratch, *, grid, grid_names, compute_wgs, name, interpret,
           reduction_scratch=None):
    """A warp-specialised kernel: `compute_wgs` compute warpgroups and one producer, the
    thread axis named "wg"; body(*inputs, *outputs, *scratch) as for plgpu.kernel.
    reduction_scratch: see compiler_params."""
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                        grid_names=grid_names, num_threads=compute_wgs + 1, thread_name="wg",
                        kernel_name=name, compiler_params=compiler_params(reduction_scratch),
                        interpret=interpret_params(interpret))
