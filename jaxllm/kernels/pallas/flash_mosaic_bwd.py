"""Backward kernels of the Mosaic GPU FlashAttention (see flash_mosaic.py for the design).

  dq        grid (q tiles, Hq, B): each compute warpgroup owns block_q_dq query rows and
            their dO, LSE and delta; K/V tiles stream through the ring.
            dS = P (dO V^T - delta), dQ += dS K, P = exp2(S log2 e - LSE log2 e).
  dk, dv    grid (kv tiles, Hkv, B): each compute warpgroup owns block_kv_dkv keys; the
            Q, dO, LSE and delta tiles of every query head of the GQA group stream past
            in turn, so dk/dv are summed over the group in registers.
            dV += P^T dO, dK += dS^T Q (computed transposed: S^T = K Q^T).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.pallas import mosaic_common as mg
from jaxllm.kernels.pallas.mosaic_common import LOG2E

# Registers a thread of the compute / producer warpgroups, by compute warpgroups a CTA.
BWD_REGISTERS = {2: (240, 24), 1: (240, 40)}


def dq_kernel(q, k, v, do, lse2, delta, *, causal, scale, bs, skv, offset, interpret):
    """dQ [B, Sq_p, Hq, D]: each warpgroup owns block_q_dq query rows, K/V tiles stream."""
    b, sq_p, hq, d = q.shape
    skv_p, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bk, stages, n_wg = bs.block_q_dq, bs.block_kv_dq, bs.num_stages_bwd, bs.compute_wgs_bwd
    n_qt, n_kv = sq_p // (n_wg * bq), skv_p // bk
    stages = min(stages, n_kv)  # as in the forward: no ring deeper than the stream
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
            n_steps = jnp.minimum(mg.cdiv_nonneg(tile_base + n_wg * bq + offset, bk), n_kv)
        else:
            n_steps = jnp.int32(n_kv)

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][0], action="increase")
            q_base = tile_base + wg * bq
            if causal:
                my_steps = jnp.minimum(mg.cdiv_nonneg(q_base + bq + offset, bk), n_steps)
                n_full = jnp.minimum(mg.floordiv_nonneg(q_base + offset + 1, bk),
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
            lse = mg.load_vec(lse_smem.at[wg], row_layout, sim)  # (bq,) log2 units
            delta = mg.load_vec(delta_smem.at[wg], row_layout, sim)
            row_ids = mg.iota((bq, bk), 0, sim) + (q_base + offset)

            def step(s, dq, masked):
                slot = lax.rem(s, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                sc = mg.dot(q_tile, k_smem.at[slot], trans_b=True, sim=sim) * c  # (bq, bk)
                if masked:
                    cols = mg.iota((bq, bk), 1, sim) + s * bk
                    ok = cols < skv
                    if causal:
                        ok = ok & (cols <= row_ids)
                    sc = jnp.where(ok, sc, -jnp.inf)
                p = jnp.exp2(sc - mg.bcast_rows(lse, sc.shape))
                plgpu.barrier_wait(v_bar.at[slot])
                dp = mg.dot(do_tile, v_smem.at[slot], trans_b=True, sim=sim)
                plgpu.barrier_arrive(v_free.at[slot])
                ds = p * (dp - mg.bcast_rows(delta, dp.shape))
                dq = mg.dot(ds.astype(dtype), k_smem.at[slot], acc=dq, a_ref=False, sim=sim)
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            def skip(s, _):
                slot = lax.rem(s, jnp.int32(stages))
                for loaded, free in ((k_bar, k_free), (v_bar, v_free)):
                    plgpu.barrier_wait(loaded.at[slot])
                    plgpu.barrier_arrive(free.at[slot])
                return _

            dq = mg.zeros((bq, d), sim)
            dq = lax.fori_loop(0, n_full, functools.partial(step, masked=False), dq)
            dq = lax.fori_loop(n_full, my_steps, functools.partial(step, masked=True), dq)
            lax.fori_loop(my_steps, n_steps, skip, None)
            q_tile[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[bi, rows, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _produce_kv():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][1], action="decrease")
            kv_h = lax.div(h, jnp.int32(group))
            tile = lambda ref: lambda s: ref.at[bi, pl.ds(s * bk, bk), kv_h]
            mg.produce(n_steps, stages, [(k_bar, k_free, [(tile(k_ref), k_smem)]),
                                       (v_bar, v_free, [(tile(v_ref), v_smem)])])

    scratch = [
        mg.smem((n_wg, bq, d), dtype), mg.smem((n_wg, bq, d), dtype),
        plgpu.SMEM((n_wg, bq), jnp.float32), plgpu.SMEM((n_wg, bq), jnp.float32),
        mg.smem((stages, bk, d), dtype), mg.smem((stages, bk, d), dtype),
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
        compiler_params=mg.compiler_params(),
        interpret=mg.interpret_params(interpret),
    )(q, k, v, do, lse2, delta)


def dkdv_kernel(q, k, v, do, lse2, delta, *, causal, scale, bs, offset, interpret):
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
        lo = (jnp.minimum(mg.floordiv_nonneg(tile_base - offset, bq), n_q) if causal
              else jnp.int32(0))
        n_t = n_q - lo
        n_steps = group * n_t

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][0], action="increase")
            kv_base = tile_base + wg * bk
            keys = pl.ds(kv_base, bk)
            if causal:
                lo_w = jnp.minimum(mg.floordiv_nonneg(kv_base - offset, bq), n_q)
                full_w = mg.clip(mg.cdiv_nonneg(kv_base + bk - 1 - offset, bq), lo_w, n_q)
            else:
                lo_w = full_w = 0
            k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[bi, keys, h], k_tile, kv_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[bi, keys, h], v_tile, kv_bar.at[wg])
            plgpu.barrier_wait(kv_bar.at[wg])
            key_ids = mg.iota((bk, bq), 0, sim) + (kv_base - offset)

            def step(t, carry, first, masked):
                dk, dv = carry
                slot = lax.rem(first + t, jnp.int32(stages))
                plgpu.barrier_wait(in_bar.at[slot])
                q_t, do_t = q_ring.at[slot], do_ring.at[slot]
                st = mg.dot(k_tile, q_t, trans_b=True, sim=sim) * c  # (bk, bq) = S^T
                lse = mg.load_vec(lse_ring.at[slot], col_layout, sim)
                pt = jnp.exp2(st - mg.bcast_cols(lse, st.shape))
                if masked:
                    q_ids = mg.iota((bk, bq), 1, sim) + t * bq
                    pt = jnp.where(key_ids <= q_ids, pt, 0.0)
                dv = mg.dot(pt.astype(dtype), do_t, acc=dv, a_ref=False, sim=sim)
                dpt = mg.dot(v_tile, do_t, trans_b=True, sim=sim)
                delta = mg.load_vec(delta_ring.at[slot], col_layout, sim)
                dst = pt * (dpt - mg.bcast_cols(delta, dpt.shape))
                dk = mg.dot(dst.astype(dtype), q_t, acc=dk, a_ref=False, sim=sim)
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

            dk, dv = lax.fori_loop(0, group, head, (mg.zeros((bk, d), sim), mg.zeros((bk, d), sim)))
            k_tile[...] = (dk * scale).astype(dtype)
            v_tile[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[bi, keys, h], commit_group=False)
            plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[bi, keys, h], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _produce_q():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][1], action="decrease")

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

            mg.produce(n_steps, stages, [(in_bar, in_free, [
                (tile(q_ref), q_ring), (tile(do_ref), do_ring),
                (vec(lse_ref), lse_ring), (vec(delta_ref), delta_ring)])])

    scratch = [
        mg.smem((n_wg, bk, d), dtype), mg.smem((n_wg, bk, d), dtype),
        mg.smem((stages, bq, d), dtype), mg.smem((stages, bq, d), dtype),
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
        compiler_params=mg.compiler_params(),
        interpret=mg.interpret_params(interpret),
    )(q, k, v, do, lse2, delta)
