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


def _mm(a, b, shape):
    """a @ b into a fresh float32 accumulator; a is registers or SMEM, b is SMEM."""
    def body(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _mm_acc(acc, a, b, sim: bool):
    """acc + a @ b for a float32 accumulator value, accumulated in place by wgmma.

    The simulator cannot run `pl.run_state`; there the product goes to a fresh
    accumulator and is added (the same arithmetic, one more register tile).
    """
    if sim:
        return acc + _mm(a, b, acc.shape)

    def body(ref):
        plgpu.wgmma(ref, a, b)
    return pl.run_state(body)(plgpu.ACC.init(acc))


def _load_vec(ref, layout, sim: bool):
    """A 1-D float32 SMEM vector as a register array in `layout` (the simulator has no
    `plgpu.load`)."""
    if sim:
        return ref[...]
    return plgpu.load(ref, (), layout=layout)


def _t(ref):
    return plgpu.transpose_ref(ref, (1, 0))


def _zeros(shape, sim: bool):
    return _layout(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA, sim)


def _produce(n_steps, stages, copies):
    """Producer loop: step s of [0, n_steps) goes to slot s % stages once it is free.

    copies: list of (src_fn(step) -> GMEM ref, smem ring [stages, ...], loaded barriers,
    free barriers).
    """
    def issue(step, slot, wait_free):
        for src_fn, ring, loaded, free in copies:
            if wait_free:
                plgpu.barrier_wait(free.at[slot])
            plgpu.copy_gmem_to_smem(src_fn(step), ring.at[slot], loaded.at[slot])

    for i in range(stages):
        pl.when(i < n_steps)(functools.partial(issue, i, i, False))

    @pl.loop(0, jnp.maximum(n_steps - stages, 0))
    def _(s):
        issue(s + stages, lax.rem(s, jnp.int32(stages)), True)


def _compiler_params():
    return plgpu.CompilerParams(approx_math=True)


def _interpret_params(interpret):
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params
    return interpret_params.InterpretGPUParams()


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

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, _t(k_smem.at[slot]))
                    sync()
                    return acc_ref[...]
                sc = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
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
                acc = _mm_acc(acc, p16, v_smem.at[slot], interpret)
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
            _produce(n_steps, stages, [(tile(k_ref), k_smem, k_bar, k_free),
                                       (tile(v_ref), v_smem, v_bar, v_free)])

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
