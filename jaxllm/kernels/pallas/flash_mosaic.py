"""FlashAttention for Hopper in Pallas with the Mosaic GPU lowering: forward, LSE, backward.

q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], f16 or bf16, D a multiple of 64 (64, 128, 256).
Every kernel is warp-specialised in the FlashAttention-3 manner: one producer warpgroup
issues TMA copies of the streamed tiles into a `num_stages`-deep shared-memory ring
(a "loaded" barrier per slot, signalled by the TMA unit, and a "free" barrier per slot,
signalled by the consumers), and compute warpgroups issue `wgmma` with float32
accumulators in registers. Each compute warpgroup owns a 64-row (by default) slab of
the CTA's tile; all compute warpgroups of a CTA consume the same stream.

  forward   grid (q tiles, Hq, B); 2 compute warpgroups x block_q rows. Streams K and V
            tiles; S = Q K^T, online softmax in base 2 (scores pre-multiplied by
            scale * log2 e; running max m and sum l in float32), O += P V. The two
            warpgroups ping-pong on a schedule barrier so one's softmax overlaps the
            other's matmuls. Writes O and LSE = (m + log2 l) * ln 2 only.
  dq        grid (q tiles, Hq, B); streams K, V; dS = P (dO V^T - delta), dQ += dS K.
  dk, dv    grid (kv tiles, Hkv, B); streams Q, dO, LSE, delta of every query head of
            the GQA group in turn (so K/V are never repeated and dk/dv are summed over
            the group in registers); dV += P^T dO, dK += dS^T Q.
  delta = rowsum(dO * O) is computed with jnp before the backward kernels.

Causal attention is bottom-right aligned (query i sees keys j <= i + Skv - Sq). A CTA's
stream stops at the last tile its rows can see (dk/dv: starts at the first); inside it
tiles fully below the diagonal run without a mask and only tiles crossing it (or the key
tail) pay for one. A warpgroup whose slab sees fewer tiles than its CTA's stream still
waits on and releases the extra slots, so the ring's barriers stay in phase. Lengths
that are not tile multiples are zero-padded here; padded keys are masked in the
forward pass and contribute nothing in the backward (K = V = 0 there, dO = 0 on padded
rows). A query row that sees no key (causal, Sq > Skv) gets o = 0 and LSE = -inf.

On the CPU the kernels run in JAX's Mosaic GPU simulator (slow; small shapes only).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles (multiples of 64) and pipeline depth of the three kernels.

    block_q: query rows per compute warpgroup in the forward pass (2 warpgroups a CTA).
    block_kv: keys per streamed K/V tile in the forward pass.
    num_stages: depth of the shared-memory ring (>= 2).
    schedule_barrier: ping-pong the two forward warpgroups (FA3 inter-warpgroup overlap).
    block_q_dq / block_kv_dq, block_q_dkv / block_kv_dkv: the backward kernels' tiles
    (the owned side per warpgroup and the streamed side); compute_wgs_bwd warpgroups a CTA.
    """
    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    schedule_barrier: bool = True
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_stages_bwd: int = 2
    compute_wgs_bwd: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name.startswith("block") and (not isinstance(val, int) or val < 64 or val % 64):
                raise ValueError(f"{f.name}={val!r} must be a positive multiple of 64")
        if self.num_stages < 2 or self.num_stages_bwd < 2:
            raise ValueError(f"num_stages={self.num_stages} and num_stages_bwd="
                             f"{self.num_stages_bwd} must be >= 2")
        if self.compute_wgs_bwd not in (1, 2):
            raise ValueError(f"compute_wgs_bwd={self.compute_wgs_bwd} must be 1 or 2")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _cdiv_nonneg(x, m: int):
    """ceil(max(x, 0) / m) for an int32 scalar (lax.div truncates, so keep x >= 0)."""
    return lax.div(jnp.maximum(x, 0) + (m - 1), jnp.int32(m))


def _floordiv_nonneg(x, m: int):
    return lax.div(jnp.maximum(x, 0), jnp.int32(m))


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _smem(shape, dtype):
    """Shared memory in the layout wgmma reads: 8 x 64 tiles, 128-byte swizzle."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                                plgpu.SwizzleTransform(128)))


def _bcast_rows(x, shape):
    """A per-row vector (layout WGMMA.reduce(1)) broadcast along the columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def _bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _layout(x, layout, sim: bool):
    """Pin a register layout (the simulator has no layouts)."""
    return x if sim else plgpu.layout_cast(x, layout)


def _iota(shape, dim, sim: bool):
    if sim:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _dot(a, b, *, sim: bool, acc=None, trans_b: bool = False, a_ref: bool = True,
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


def _load_vec(ref, layout, sim: bool):
    """A 1-D float32 SMEM vector as a register array in `layout` (the simulator has no
    `plgpu.load`)."""
    if sim:
        return ref[...]
    try:  # jax >= 0.11 takes no index (and deprecates passing one)
        return plgpu.load(ref, layout=layout)
    except TypeError:
        return plgpu.load(ref, (), layout=layout)


def _zeros(shape, sim: bool):
    return _layout(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA, sim)


def _produce(n_steps, stages, groups):
    """Producer loop: step s of [0, n_steps) goes to ring slot s % stages once it is free.

    groups: list of (loaded barriers, free barriers, [(src_fn(step) -> GMEM ref, ring)]);
    the copies of one group share its barriers (loaded counts one arrival per copy).
    """
    def issue(step, slot, wait_free):
        for loaded, free, copies in groups:
            if wait_free:
                plgpu.barrier_wait(free.at[slot])
            for src_fn, ring in copies:
                plgpu.copy_gmem_to_smem(src_fn(step), ring.at[slot], loaded.at[slot])

    for i in range(stages):
        pl.when(i < n_steps)(functools.partial(issue, i, i, False))

    @pl.loop(0, jnp.maximum(n_steps - stages, 0))
    def _(s):
        issue(s + stages, lax.rem(s, jnp.int32(stages)), True)

    # Drain: see the consumers release the last slots, so that every thread that waits
    # on a barrier has observed all of its phases when the kernel ends.
    @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
    def _(s):
        for _, free, _ in groups:
            plgpu.barrier_wait(free.at[lax.rem(s, jnp.int32(stages))])


def _compiler_params():
    return plgpu.CompilerParams(approx_math=True)


def _interpret_params(interpret):
    if not interpret:
        return None
    params = getattr(plgpu, "InterpretGPUParams", None)  # public from jax 0.11
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


# ----------------------------------------------------------------------------- forward


def _forward(q, k, v, *, causal, scale, bs: BlockSizes, skv, offset, interpret):
    """Padded q [B, Sq_p, Hq, D], k/v [B, Skv_p, Hkv, D] -> o, lse [B, Hq, Sq_p] (natural)."""
    b, sq_p, hq, d = q.shape
    skv_p, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bk, stages = bs.block_q, bs.block_kv, bs.num_stages
    n_wg = 2
    n_qt, n_kv = sq_p // (n_wg * bq), skv_p // bk
    n_kv_full_tail = skv // bk  # key tiles without padded keys
    c = scale * LOG2E
    dtype = q.dtype

    def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem,
               q_bar, k_bar, v_bar, k_free, v_free, sched):
        bi, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        qt = lax.axis_index("q_seq")
        if causal:  # heaviest tiles first: better balance at the end of the grid
            qt = n_qt - 1 - qt
        tile_base = qt * (n_wg * bq)
        if causal:
            n_steps = jnp.minimum(_cdiv_nonneg(tile_base + n_wg * bq + offset, bk), n_kv)
        else:
            n_steps = jnp.int32(n_kv)

        def sync():
            if bs.schedule_barrier:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_base = tile_base + wg * bq
            if causal:
                my_steps = jnp.minimum(_cdiv_nonneg(q_base + bq + offset, bk), n_steps)
                n_full = jnp.minimum(_floordiv_nonneg(q_base + offset + 1, bk),
                                     jnp.minimum(my_steps, n_kv_full_tail))
            else:
                my_steps = n_steps
                n_full = jnp.int32(n_kv_full_tail)
            q_tile = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_base, bq), h], q_tile, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            rows = _iota((bq, bk), 0, interpret) + (q_base + offset)

            def step(s, carry, masked):
                acc, m, l = carry
                slot = lax.rem(s, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])

                sc = _dot(q_tile, k_smem.at[slot], trans_b=True, sim=interpret, during=sync)
                plgpu.barrier_arrive(k_free.at[slot])
                sc = sc * c  # (bq, bk), log2 units
                if masked:
                    cols = _iota((bq, bk), 1, interpret) + s * bk
                    ok = cols < skv
                    if causal:
                        ok = ok & (cols <= rows)
                    sc = jnp.where(ok, sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1))
                # Rows with every key masked so far keep m = -inf: shift by 0, not -inf.
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                alpha = jnp.exp2(m - m_use)
                p = jnp.exp2(sc - _bcast_rows(m_use, sc.shape))
                acc = acc * _bcast_rows(alpha, acc.shape)
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                if bs.schedule_barrier:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bar.at[slot])
                if bs.schedule_barrier:
                    plgpu.barrier_wait(sched)
                acc = _dot(p16, v_smem.at[slot], acc=acc, a_ref=False, sim=interpret)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            def skip(s, _):
                # A tile the other warpgroup needs: release the slot, keep the ping-pong.
                slot = lax.rem(s, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                sync()
                sync()
                return _

            row_layout = plgpu.Layout.WGMMA.reduce(1)
            carry = (_zeros((bq, d), interpret),
                     _layout(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout, interpret),
                     _layout(jnp.zeros((bq,), jnp.float32), row_layout, interpret))
            pl.when(wg == 1)(sync)
            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
            acc, m, l = lax.fori_loop(n_full, my_steps, functools.partial(step, masked=True),
                                      carry)
            lax.fori_loop(my_steps, n_steps, skip, None)
            pl.when(wg == 0)(sync)

            empty = l == 0.0
            l_safe = jnp.where(empty, 1.0, l)
            o = acc * _bcast_rows(1.0 / l_safe, acc.shape)
            lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
            q_tile[...] = o.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, o_ref.at[bi, pl.ds(q_base, bq), h],
                                    commit_group=False)
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, h, pl.ds(q_base, bq)],
                                    commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _produce_kv():
            plgpu.set_max_registers(40, action="decrease")
            kv_h = lax.div(h, jnp.int32(group))
            tile = lambda ref: lambda s: ref.at[bi, pl.ds(s * bk, bk), kv_h]
            _produce(n_steps, stages, [(k_bar, k_free, [(tile(k_ref), k_smem)]),
                                       (v_bar, v_free, [(tile(v_ref), v_smem)])])

    scratch = [
        _smem((n_wg, bq, d), dtype), _smem((stages, bk, d), dtype), _smem((stages, bk, d), dtype),
        plgpu.SMEM((n_wg, bq), jnp.float32),
        plgpu.Barrier(num_barriers=n_wg),
        plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg),
    ]
    o, lse = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct(q.shape, dtype),
                  jax.ShapeDtypeStruct((b, hq, sq_p), jnp.float32)],
        scratch_types=scratch,
        grid=(n_qt, hq, b),
        grid_names=("q_seq", "heads", "batch"),
        num_threads=n_wg + 1,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=_interpret_params(interpret),
    )(q, k, v)
    return o, lse


# ----------------------------------------------------------------------------- backward


def _dq(q, k, v, do, lse2, delta, *, causal, scale, bs: BlockSizes, skv, offset, interpret):
    """dQ [B, Sq_p, Hq, D]: each warpgroup owns block_q_dq query rows, K/V tiles stream."""
    b, sq_p, hq, d = q.shape
    skv_p, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bk, stages, n_wg = bs.block_q_dq, bs.block_kv_dq, bs.num_stages_bwd, bs.compute_wgs_bwd
    n_qt, n_kv = sq_p // (n_wg * bq), skv_p // bk
    c = scale * LOG2E
    dtype = q.dtype
    sim = interpret
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem, do_smem,
               lse_smem, delta_smem, k_smem, v_smem, in_bar, k_bar, v_bar, k_free, v_free):
        bi, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        qt = lax.axis_index("q_seq")
        if causal:
            qt = n_qt - 1 - qt
        tile_base = qt * (n_wg * bq)
        if causal:
            n_steps = jnp.minimum(_cdiv_nonneg(tile_base + n_wg * bq + offset, bk), n_kv)
        else:
            n_steps = jnp.int32(n_kv)

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(232 if n_wg == 2 else 240, action="increase")
            q_base = tile_base + wg * bq
            if causal:
                my_steps = jnp.minimum(_cdiv_nonneg(q_base + bq + offset, bk), n_steps)
                n_full = jnp.minimum(_floordiv_nonneg(q_base + offset + 1, bk),
                                     jnp.minimum(my_steps, skv // bk))
            else:
                my_steps, n_full = n_steps, jnp.int32(skv // bk)
            rows = pl.ds(q_base, bq)
            q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
            bar = in_bar.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, h], q_tile, bar)
            plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, h], do_tile, bar)
            plgpu.copy_gmem_to_smem(lse_ref.at[bi, h, rows], lse_smem.at[wg], bar)
            plgpu.copy_gmem_to_smem(delta_ref.at[bi, h, rows], delta_smem.at[wg], bar)
            plgpu.barrier_wait(bar)
            lse = _load_vec(lse_smem.at[wg], row_layout, sim)  # (bq,) log2 units
            delta = _load_vec(delta_smem.at[wg], row_layout, sim)
            row_ids = _iota((bq, bk), 0, sim) + (q_base + offset)

            def step(s, dq, masked):
                slot = lax.rem(s, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                sc = _dot(q_tile, k_smem.at[slot], trans_b=True, sim=sim) * c  # (bq, bk)
                if masked:
                    cols = _iota((bq, bk), 1, sim) + s * bk
                    ok = cols < skv
                    if causal:
                        ok = ok & (cols <= row_ids)
                    sc = jnp.where(ok, sc, -jnp.inf)
                p = jnp.exp2(sc - _bcast_rows(lse, sc.shape))
                plgpu.barrier_wait(v_bar.at[slot])
                dp = _dot(do_tile, v_smem.at[slot], trans_b=True, sim=sim)
                plgpu.barrier_arrive(v_free.at[slot])
                ds = p * (dp - _bcast_rows(delta, dp.shape))
                dq = _dot(ds.astype(dtype), k_smem.at[slot], acc=dq, a_ref=False, sim=sim)
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            def skip(s, _):
                slot = lax.rem(s, jnp.int32(stages))
                for loaded, free in ((k_bar, k_free), (v_bar, v_free)):
                    plgpu.barrier_wait(loaded.at[slot])
                    plgpu.barrier_arrive(free.at[slot])
                return _

            dq = _zeros((bq, d), sim)
            dq = lax.fori_loop(0, n_full, functools.partial(step, masked=False), dq)
            dq = lax.fori_loop(n_full, my_steps, functools.partial(step, masked=True), dq)
            lax.fori_loop(my_steps, n_steps, skip, None)
            q_tile[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[bi, rows, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _produce_kv():
            plgpu.set_max_registers(40, action="decrease")
            kv_h = lax.div(h, jnp.int32(group))
            tile = lambda ref: lambda s: ref.at[bi, pl.ds(s * bk, bk), kv_h]
            _produce(n_steps, stages, [(k_bar, k_free, [(tile(k_ref), k_smem)]),
                                       (v_bar, v_free, [(tile(v_ref), v_smem)])])

    scratch = [
        _smem((n_wg, bq, d), dtype), _smem((n_wg, bq, d), dtype),
        plgpu.SMEM((n_wg, bq), jnp.float32), plgpu.SMEM((n_wg, bq), jnp.float32),
        _smem((stages, bk, d), dtype), _smem((stages, bk, d), dtype),
        plgpu.Barrier(num_arrivals=4, num_barriers=n_wg),
        plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
    ]
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=scratch,
        grid=(n_qt, hq, b),
        grid_names=("q_seq", "heads", "batch"),
        num_threads=n_wg + 1,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=_interpret_params(interpret),
    )(q, k, v, do, lse2, delta)


def _dkdv(q, k, v, do, lse2, delta, *, causal, scale, bs: BlockSizes, offset, interpret):
    """dK, dV [B, Skv_p, Hkv, D]: each warpgroup owns block_kv_dkv keys; the Q, dO, LSE
    and delta tiles of every query head of the GQA group stream past them in turn."""
    b, sq_p, hq, d = q.shape
    skv_p, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bk, stages, n_wg = bs.block_q_dkv, bs.block_kv_dkv, bs.num_stages_bwd, bs.compute_wgs_bwd
    n_kt, n_q = skv_p // (n_wg * bk), sq_p // bq
    c = scale * LOG2E
    dtype = q.dtype
    sim = interpret
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem,
               v_smem, q_ring, do_ring, lse_ring, delta_ring, kv_bar, in_bar, in_free):
        bi, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        tile_base = lax.axis_index("kv_seq") * (n_wg * bk)
        # Query tiles before `lo` see none of this CTA's keys (rows r see keys <= r + offset).
        lo = (jnp.minimum(_floordiv_nonneg(tile_base - offset, bq), n_q) if causal
              else jnp.int32(0))
        n_t = n_q - lo
        n_steps = group * n_t

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(232 if n_wg == 2 else 240, action="increase")
            kv_base = tile_base + wg * bk
            keys = pl.ds(kv_base, bk)
            if causal:
                lo_w = jnp.minimum(_floordiv_nonneg(kv_base - offset, bq), n_q)
                full_w = _clip(_cdiv_nonneg(kv_base + bk - 1 - offset, bq), lo_w, n_q)
            else:
                lo_w = full_w = 0
            k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[bi, keys, h], k_tile, kv_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[bi, keys, h], v_tile, kv_bar.at[wg])
            plgpu.barrier_wait(kv_bar.at[wg])
            key_ids = _iota((bk, bq), 0, sim) + (kv_base - offset)

            def step(t, carry, first, masked):
                dk, dv = carry
                slot = lax.rem(first + t, jnp.int32(stages))
                plgpu.barrier_wait(in_bar.at[slot])
                q_t, do_t = q_ring.at[slot], do_ring.at[slot]
                st = _dot(k_tile, q_t, trans_b=True, sim=sim) * c  # (bk, bq) = S^T
                lse = _load_vec(lse_ring.at[slot], col_layout, sim)
                pt = jnp.exp2(st - _bcast_cols(lse, st.shape))
                if masked:
                    q_ids = _iota((bk, bq), 1, sim) + t * bq
                    pt = jnp.where(key_ids <= q_ids, pt, 0.0)
                dv = _dot(pt.astype(dtype), do_t, acc=dv, a_ref=False, sim=sim)
                dpt = _dot(v_tile, do_t, trans_b=True, sim=sim)
                delta = _load_vec(delta_ring.at[slot], col_layout, sim)
                dst = pt * (dpt - _bcast_cols(delta, dpt.shape))
                dk = _dot(dst.astype(dtype), q_t, acc=dk, a_ref=False, sim=sim)
                plgpu.barrier_arrive(in_free.at[slot])
                return dk, dv

            def skip(t, carry, first):
                slot = lax.rem(first + t, jnp.int32(stages))
                plgpu.barrier_wait(in_bar.at[slot])
                plgpu.barrier_arrive(in_free.at[slot])
                return carry

            def head(g, carry):
                first = g * n_t - lo  # stream step of query tile t is first + t
                carry = lax.fori_loop(lo, lo_w, functools.partial(skip, first=first), carry)
                carry = lax.fori_loop(lo_w, full_w, functools.partial(
                    step, first=first, masked=True), carry)
                return lax.fori_loop(full_w, n_q, functools.partial(
                    step, first=first, masked=False), carry)

            dk, dv = lax.fori_loop(0, group, head, (_zeros((bk, d), sim), _zeros((bk, d), sim)))
            k_tile[...] = (dk * scale).astype(dtype)
            v_tile[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[bi, keys, h], commit_group=False)
            plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[bi, keys, h], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _produce_q():
            plgpu.set_max_registers(40, action="decrease")

            def where(s):
                g = lax.div(s, n_t)
                return h * group + g, pl.ds((lo + s - g * n_t) * bq, bq)

            def tile(ref):
                def src(s):
                    qh, rows = where(s)
                    return ref.at[bi, rows, qh]
                return src

            def vec(ref):
                def src(s):
                    qh, rows = where(s)
                    return ref.at[bi, qh, rows]
                return src

            _produce(n_steps, stages, [(in_bar, in_free, [
                (tile(q_ref), q_ring), (tile(do_ref), do_ring),
                (vec(lse_ref), lse_ring), (vec(delta_ref), delta_ring)])])

    scratch = [
        _smem((n_wg, bk, d), dtype), _smem((n_wg, bk, d), dtype),
        _smem((stages, bq, d), dtype), _smem((stages, bq, d), dtype),
        plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=n_wg),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
    ]
    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    return plgpu.kernel(
        kernel,
        out_type=[kv_type, kv_type],
        scratch_types=scratch,
        grid=(n_kt, hkv, b),
        grid_names=("kv_seq", "heads", "batch"),
        num_threads=n_wg + 1,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=_interpret_params(interpret),
    )(q, k, v, do, lse2, delta)


# ----------------------------------------------------------------------------- public API


def _tiles(sq: int, skv: int, bs: BlockSizes) -> tuple[BlockSizes, int, int]:
    """Clamp the key tiles to short sequences; the padded lengths every kernel divides."""
    kv_cap = _round_up(skv, 64)
    bs = dataclasses.replace(bs, block_kv=min(bs.block_kv, kv_cap),
                             block_kv_dq=min(bs.block_kv_dq, kv_cap))
    n_wg = bs.compute_wgs_bwd
    q_mult = math.lcm(2 * bs.block_q, n_wg * bs.block_q_dq, bs.block_q_dkv)
    kv_mult = math.lcm(bs.block_kv, bs.block_kv_dq, n_wg * bs.block_kv_dkv)
    return bs, _round_up(sq, q_mult), _round_up(skv, kv_mult)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _flash(q, k, v, causal, scale, bs, interpret):
    return _flash_fwd(q, k, v, causal, scale, bs, interpret)[0]


def _flash_fwd(q, k, v, causal, scale, bs, interpret):
    sq, skv = q.shape[1], k.shape[1]
    bs, sq_p, skv_p = _tiles(sq, skv, bs)
    qp = _pad_axis(q, 1, sq_p)
    kp, vp = _pad_axis(k, 1, skv_p), _pad_axis(v, 1, skv_p)
    o, lse = _forward(qp, kp, vp, causal=causal, scale=scale, bs=bs, skv=skv,
                      offset=skv - sq, interpret=interpret)
    o, lse = o[:, :sq], lse[:, :, :sq]
    return (o, lse), (q, k, v, o, lse)


def _flash_bwd(causal, scale, bs, interpret, res, cts):
    q, k, v, o, lse = res
    do, dlse = cts
    sq, skv = q.shape[1], k.shape[1]
    bs, sq_p, skv_p = _tiles(sq, skv, bs)
    # delta = rowsum(dO * O) minus the LSE cotangent (d lse / d s = p). Rows that see no
    # key have LSE -inf; +inf makes their P exactly 0.
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    delta, lse2 = _pad_axis(delta, 2, sq_p), _pad_axis(lse2, 2, sq_p)
    qp, dop = _pad_axis(q, 1, sq_p), _pad_axis(do.astype(q.dtype), 1, sq_p)
    kp, vp = _pad_axis(k, 1, skv_p), _pad_axis(v, 1, skv_p)
    common = dict(causal=causal, scale=scale, bs=bs, offset=skv - sq, interpret=interpret)
    dq = _dq(qp, kp, vp, dop, lse2, delta, skv=skv, **common)
    dk, dv = _dkdv(qp, kp, vp, dop, lse2, delta, **common)
    return dq[:, :sq], dk[:, :skv], dv[:, :skv]


_flash.defvjp(_flash_fwd, _flash_bwd)


def unsupported_reason(q, k, v) -> str | None:
    """None when the kernels can run these inputs, else why not (for `impl="auto"`)."""
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        return f"head_dim={d} is not supported by pallas_mosaic (choose one of {HEAD_DIMS})"
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"pallas_mosaic takes bfloat16 or float16 inputs; got {jnp.dtype(q.dtype)}"
    return None


def _block_sizes(kwargs: dict) -> BlockSizes:
    bs = kwargs.pop("block_sizes", None) or BlockSizes()
    if not isinstance(bs, BlockSizes):
        raise ValueError(f"block_sizes must be a flash_mosaic.BlockSizes; got {type(bs).__name__}")
    names = {f.name for f in dataclasses.fields(BlockSizes)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown pallas_mosaic options {unknown}; valid: "
                         f"block_sizes, {sorted(names)}")
    return dataclasses.replace(bs, **kwargs)


def flash_attention_with_lse(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                             interpret: bool | None = None, **kwargs):
    """(o [B, Sq, Hq, D] in q.dtype, lse [B, Hq, Sq] float32, natural log); both differentiable.

    kwargs: `block_sizes=BlockSizes(...)` and/or any of its fields (e.g. block_kv=64).
    Rows that see no key (causal, Sq > Skv) give o = 0 and lse = -inf. `interpret`
    (default: on the CPU) runs the kernels in JAX's Mosaic GPU simulator.
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[2] % k.shape[2]:
        raise ValueError(f"expected q [B, Sq, Hq, D], k = v [B, Skv, Hkv, D] with Hq % Hkv == 0;"
                         f" got q{q.shape} k{k.shape} v{v.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    why = unsupported_reason(q, k, v)
    if why:
        raise ValueError(why)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    bs = _block_sizes(dict(kwargs))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _flash(q, k, v, bool(causal), scale, bs, bool(interpret))


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, **kwargs):
    """q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] -> [B, Sq, Hq, D]; see kernels.flash_attention."""
    return flash_attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale, **kwargs)[0]
