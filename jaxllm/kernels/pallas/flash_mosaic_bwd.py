"""Backward kernels of the Mosaic GPU FlashAttention (see flash_mosaic.py for the design).

  dq        work items (q tile, Hq, B): each compute warpgroup owns block_q_dq query
            rows and their dO, LSE and delta; K/V tiles stream through the ring.
            dS = P (dO V^T - delta), dQ += dS K, P = exp2(S log2 e - LSE log2 e).
  dk, dv    grid over (B, Hkv, kv tiles) (dkdv_grid): each compute warpgroup owns
            block_kv_dkv keys; the Q, dO, LSE and delta tiles of every query head of
            the GQA group stream past in turn, so dk/dv are summed over the group in
            registers. dV += P^T dO, dK += dS^T Q (computed transposed: S^T = K Q^T).
            Where one warpgroup's two accumulators do not fit its registers (D 256),
            two warpgroups share each key tile and split dK's and dV's columns
            (dkdv_split_kernel).

dQ and dK are D wide (the query-key head dim), dO, V and dV Dv wide (the value head dim;
S = Q K^T contracts over D, dP = dO V^T over Dv).

cfg is a flash_mosaic.BwdConfig; with cfg.overlap_bwd a step issues its two score
products (S and dP) together and works on the first while the second runs.
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
# Causal dK/dV grids of fewer CTAs than this many waves of one a SM launch batch-fastest
# (dkdv_grid).
KV_FAST_CAUSAL_WAVES = 16


def dkdv_grid(b: int, hkv: int, n_kt: int, causal: bool, sim: bool):
    """(grid, grid_names) of the dK/dV kernels. Mosaic GPU maps a grid's last axis to
    CUDA's fastest-varying block index. Key tiles last: the CTAs launched together are one
    (batch, head)'s key tiles, which stream the same Q, dO, LSE and delta tiles, so L2
    serves them once for all (A8 in docs/performance.md: fwd+bwd 1.06-1.13x the
    batch-fastest order in full attention, D 64 and 256 MHA causal). But a causal head's
    first key tiles see the most queries, and in that order the last CTAs are the last
    heads' tiles, heavy ones among them; batch last, they are every head's lightest. With
    few waves that tail outweighs the shared reads (the D 128 GQA headline, 7.8 waves on
    132 SMs: 0.97x), so causal grids under KV_FAST_CAUSAL_WAVES waves keep batch last."""
    if causal and b * hkv * n_kt < KV_FAST_CAUSAL_WAVES * mg.sm_count(sim):
        return (n_kt, hkv, b), ("kv_seq", "heads", "batch")
    return (b, hkv, n_kt), ("batch", "heads", "kv_seq")


def dq_kernel(q, k, v, do, lse2, delta, *, causal, scale, cfg, skv, offset, interpret):
    """dQ [B, Sq_p, Hq, D]: each warpgroup owns block_q_dq query rows, K/V tiles stream."""
    b, sq_p, hq, d = q.shape
    skv_p, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    bq, bk, stages, n_wg = cfg.block_q_dq, cfg.block_kv_dq, cfg.num_stages_bwd, cfg.compute_wgs_bwd
    n_qt, n_kv = sq_p // (n_wg * bq), skv_p // bk
    stages = min(stages, n_kv)  # as in the forward: no ring deeper than the stream
    c = scale * LOG2E
    dtype = q.dtype
    sim = interpret
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    order = mg.TileSchedule(n_qt, hq, b, causal=causal, persistent=cfg.persistent_dq,
                            sim=sim)
    # As in the forward: the next tile's Q, dO, LSE and delta load during this one.
    n_buf = 2 if order.multi and d <= 128 else 1

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem, do_smem,
               lse_smem, delta_smem, k_smem, v_smem, in_bar, k_bar, v_bar, k_free, v_free):
        pid, wg = lax.axis_index("programs"), lax.axis_index("wg")
        n_mine = order.count(pid)

        coords = functools.partial(order.query_tile, pid, rows=n_wg * bq, bk=bk, n_kv=n_kv,
                                   offset=offset)

        def attend(buf, bi, h, tile_base, n_steps, base):
            """One CTA tile's dQ: stream its n_steps K/V tiles, ring steps base, ..."""
            slot_of = lambda s: lax.rem(base + s, jnp.int32(stages))
            q_base = tile_base + wg * bq
            my_steps, n_full = mg.slab_steps(q_base, bq, bk, offset, n_steps, skv // bk, causal)
            q_tile, do_tile = q_smem.at[buf, wg], do_smem.at[buf, wg]
            lse = mg.load_vec(lse_smem.at[buf, wg], row_layout, sim)  # (bq,) log2 units
            delta = mg.load_vec(delta_smem.at[buf, wg], row_layout, sim)
            row_ids = mg.iota((bq, bk), 0, sim) + (q_base + offset)

            def probs(s, sc, masked):
                sc = sc * c  # (bq, bk), log2 units
                if masked:
                    sc = mg.mask_scores(sc, s * bk, skv, row_ids, causal, sim)
                return jnp.exp2(sc - mg.bcast_rows(lse, sc.shape))

            def step(s, dq, masked):
                slot = slot_of(s)
                plgpu.barrier_wait(k_bar.at[slot])
                if cfg.overlap_bwd:  # dO V^T runs while P is computed
                    plgpu.barrier_wait(v_bar.at[slot])

                    def then(sc, dp_fn):
                        p = probs(s, sc, masked)
                        return p * (dp_fn() - mg.bcast_rows(delta, sc.shape))
                    ds = mg.dot_pair_nt(q_tile, k_smem.at[slot], do_tile, v_smem.at[slot],
                                        then, sim=sim)
                else:
                    p = probs(s, mg.dot(q_tile, k_smem.at[slot], trans_b=True, sim=sim), masked)
                    plgpu.barrier_wait(v_bar.at[slot])
                    dp = mg.dot(do_tile, v_smem.at[slot], trans_b=True, sim=sim)
                    ds = p * (dp - mg.bcast_rows(delta, dp.shape))
                plgpu.barrier_arrive(v_free.at[slot])
                dq = mg.dot(ds.astype(dtype), k_smem.at[slot], acc=dq, a_ref=False, sim=sim)
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            def skip(s, _):
                slot = slot_of(s)
                for loaded, free in ((k_bar, k_free), (v_bar, v_free)):
                    plgpu.barrier_wait(loaded.at[slot])
                    plgpu.barrier_arrive(free.at[slot])
                return _

            dq = mg.zeros((bq, d), sim)
            dq = lax.fori_loop(0, n_full, functools.partial(step, masked=False), dq)
            dq = lax.fori_loop(n_full, my_steps, functools.partial(step, masked=True), dq)
            lax.fori_loop(my_steps, n_steps, skip, None)
            q_tile[...] = (dq * scale).astype(dtype)  # Q is spent: its buffer stages dQ
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[bi, pl.ds(q_base, bq), h])

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][0], action="increase")

            def load_rows(i, buf):
                bi, h, tile_base, _ = coords(i)
                rows = pl.ds(tile_base + wg * bq, bq)
                bar = in_bar.at[buf * n_wg + wg]
                plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, h], q_smem.at[buf, wg], bar)
                plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, h], do_smem.at[buf, wg], bar)
                plgpu.copy_gmem_to_smem(lse_ref.at[bi, h, rows], lse_smem.at[buf, wg], bar)
                plgpu.copy_gmem_to_smem(delta_ref.at[bi, h, rows], delta_smem.at[buf, wg], bar)

            def tile(i, buf, base):
                bi, h, tile_base, n_steps = coords(i)
                attend(buf, bi, h, tile_base, n_steps, base)
                return n_steps

            mg.consume_tiles(n_mine, n_buf, load_rows,
                             lambda buf: plgpu.barrier_wait(in_bar.at[buf * n_wg + wg]), tile)

        @pl.when(wg == n_wg)
        def _produce_kv():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][1], action="decrease")

            mg.produce_kv_tiles(n_mine, stages, coords, group, bk,
                                (k_ref, k_smem, k_bar, k_free), (v_ref, v_smem, v_bar, v_free))

    scratch = [
        mg.smem((n_buf, n_wg, bq, d), dtype), mg.smem((n_buf, n_wg, bq, dv), dtype),
        plgpu.SMEM((n_buf, n_wg, bq), jnp.float32), plgpu.SMEM((n_buf, n_wg, bq), jnp.float32),
        mg.smem((stages, bk, d), dtype), mg.smem((stages, bk, dv), dtype),
        plgpu.Barrier(num_arrivals=4, num_barriers=n_buf * n_wg),
        plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
    ]
    return mg.launch(kernel, jax.ShapeDtypeStruct(q.shape, dtype), scratch,
                     grid=(order.programs,), grid_names=("programs",), compute_wgs=n_wg,
                     name="flash_dq", interpret=interpret)(q, k, v, do, lse2, delta)


def dkdv_kernel(q, k, v, do, lse2, delta, *, causal, scale, cfg, offset, interpret):
    """dK [B, Skv_p, Hkv, D], dV [.., Dv]: each warpgroup owns block_kv_dkv keys; the Q,
    dO, LSE and delta tiles of every query head of the GQA group stream past them in turn."""
    b, sq_p, hq, d = q.shape
    skv_p, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    bq, bk = cfg.block_q_dkv, cfg.block_kv_dkv
    stages, n_wg = cfg.num_stages_bwd, cfg.compute_wgs_bwd
    n_kt, n_q = skv_p // (n_wg * bk), sq_p // bq
    c = scale * LOG2E
    dtype = q.dtype
    sim = interpret
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem,
               v_smem, q_ring, do_ring, lse_ring, delta_ring, kv_bar, in_bar, in_free):
        bi, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        kt = lax.axis_index("kv_seq")
        tile_base = kt * (n_wg * bk)
        # Query tiles before `lo` see none of this CTA's keys (rows r see keys <= r + offset).
        lo = (jnp.minimum(mg.floordiv_nonneg(tile_base - offset, bq), n_q) if causal
              else jnp.int32(0))
        n_t = n_q - lo

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
                lse = mg.load_vec(lse_ring.at[slot], col_layout, sim)
                delta = mg.load_vec(delta_ring.at[slot], col_layout, sim)

                def probs(st):  # S^T (bk, bq) -> P^T
                    pt = jnp.exp2(st * c - mg.bcast_cols(lse, st.shape))
                    if masked:
                        q_ids = mg.iota((bk, bq), 1, sim) + t * bq
                        pt = jnp.where(key_ids <= q_ids, pt, 0.0)
                    return pt

                if cfg.overlap_bwd and not sim:
                    # S^T and dP^T issued together; P^T is computed while dP^T runs and
                    # dS^T while dV += P^T dO runs.
                    def scoped(st_ref, dpt_ref, dv_ref, dk_ref):
                        plgpu.wgmma(st_ref, k_tile, q_t.transpose((1, 0)))
                        plgpu.wgmma(dpt_ref, v_tile, do_t.transpose((1, 0)))
                        pt = probs(plgpu.wgmma_accumulator_load(st_ref, wait_n=1))
                        dv_ref[...] = dv
                        plgpu.wgmma(dv_ref, pt.astype(dtype), do_t)
                        dpt = plgpu.wgmma_accumulator_load(dpt_ref, wait_n=1)
                        dst = (pt * (dpt - mg.bcast_cols(delta, dpt.shape))).astype(dtype)
                        dk_ref[...] = dk
                        plgpu.wgmma(dk_ref, dst, q_t)
                        return (plgpu.wgmma_accumulator_load(dk_ref, wait_n=0),
                                plgpu.wgmma_accumulator_load(dv_ref, wait_n=0))
                    shapes = [(bk, bq), (bk, bq), (bk, dv_dim), (bk, d)]
                    dk, dv = pl.run_scoped(scoped, *(plgpu.ACC(sh, jnp.float32) for sh in shapes))
                else:  # each product awaited before the next (and the simulator)
                    pt = probs(mg.dot(k_tile, q_t, trans_b=True, sim=sim))
                    dv = mg.dot(pt.astype(dtype), do_t, acc=dv, a_ref=False, sim=sim)
                    dpt = mg.dot(v_tile, do_t, trans_b=True, sim=sim)
                    dst = (pt * (dpt - mg.bcast_cols(delta, dpt.shape))).astype(dtype)
                    dk = mg.dot(dst, q_t, acc=dk, a_ref=False, sim=sim)
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

            dk, dv = lax.fori_loop(0, group, head, (mg.zeros((bk, d), sim),
                                                    mg.zeros((bk, dv_dim), sim)))
            k_tile[...] = (dk * scale).astype(dtype)
            v_tile[...] = dv.astype(dtype)
            plgpu.commit_smem()
            for tile_, ref in ((k_tile, dk_ref), (v_tile, dv_ref)):
                plgpu.copy_smem_to_gmem(tile_, ref.at[bi, keys, h], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == n_wg)
        def _produce_q():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][1], action="decrease")

            _produce_group(bi, h, group, lo, n_t, bq, stages, in_bar, in_free,
                           (q_ref, do_ref, lse_ref, delta_ref),
                           (q_ring, do_ring, lse_ring, delta_ring))

    scratch = [
        mg.smem((n_wg, bk, d), dtype), mg.smem((n_wg, bk, dv_dim), dtype),
        mg.smem((stages, bq, d), dtype), mg.smem((stages, bq, dv_dim), dtype),
        plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=n_wg),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
    ]
    out_type = [jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    grid, names = dkdv_grid(b, hkv, n_kt, causal, sim)
    return mg.launch(kernel, out_type, scratch, grid=grid, grid_names=names, compute_wgs=n_wg,
                     name="flash_dkdv", interpret=interpret)(q, k, v, do, lse2, delta)


def _produce_group(bi, h, group, lo, n_t, bq, stages, in_bar, in_free, refs, rings):
    """The dk/dv producer: the Q, dO, LSE and delta tiles of query tiles lo, ..., n_q - 1
    of each query head of KV head h's group in turn (n_t tiles a head) into the ring."""
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

    q_ref, do_ref, lse_ref, delta_ref = refs
    q_ring, do_ring, lse_ring, delta_ring = rings
    mg.produce(group * n_t, stages, [(in_bar, in_free, [
        (tile(q_ref), q_ring), (tile(do_ref), do_ring),
        (vec(lse_ref), lse_ring), (vec(delta_ref), delta_ring)])])


SWIZZLE = 64  # dkdv_split_kernel's tiles


def dkdv_split_kernel(q, k, v, do, lse2, delta, *, causal, scale, cfg, offset, interpret):
    """dK, dV in one pass where one warpgroup's two accumulators do not fit its registers
    (D 256: 128 a thread each). Two compute warpgroups share a tile of block_kv_dkv keys;
    warpgroup w owns columns [w D/2, (w+1) D/2) of dK and dV. A step's score products are
    split by query rows: w computes S^T, P^T, dP^T and dS^T for rows [w bq/2, (w+1) bq/2)
    of the streamed query tile (wgmma N = bq/2) and writes its P^T and dS^T (bf16) to
    shared memory; past one barrier of two arrivals each warpgroup multiplies both halves
    into its dV and dK columns. The FLOPs stay the op's. The halves are double-buffered: a
    buffer is written again two steps later, once the other warpgroup has passed the next
    step's barrier and so finished reading it. Every tile is swizzled by 64 bytes (the
    halves' rows are 64 bytes, and a wgmma's operands must share a swizzle)."""
    b, sq_p, hq, d = q.shape
    skv_p, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    bq, bk, stages = cfg.block_q_dkv, cfg.block_kv_dkv, cfg.num_stages_bwd
    hb, dh, dvh = bq // 2, d // 2, dv_dim // 2
    n_kt, n_q = skv_p // bk, sq_p // bq
    c = scale * LOG2E
    dtype = jnp.dtype(q.dtype)
    sim = interpret
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
               k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, p_x, ds_x, kv_bar,
               in_bar, in_free, x_bar):
        bi, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        kv_base = lax.axis_index("kv_seq") * bk
        keys = pl.ds(kv_base, bk)
        if causal:
            lo = jnp.minimum(mg.floordiv_nonneg(kv_base - offset, bq), n_q)
            full = mg.clip(mg.cdiv_nonneg(kv_base + bk - 1 - offset, bq), lo, n_q)
        else:
            lo = full = jnp.int32(0)
        n_t = n_q - lo

        def consumer(w):
            plgpu.set_max_registers(BWD_REGISTERS[2][0], action="increase")
            rows = pl.ds(w * hb, hb)
            key_ids = mg.iota((bk, hb), 0, sim) + (kv_base - offset)
            plgpu.barrier_wait(kv_bar)

            def step(t, carry, first, masked):
                dk, dv = carry
                s = first + t
                slot, par = lax.rem(s, jnp.int32(stages)), lax.rem(s, jnp.int32(2))
                plgpu.barrier_wait(in_bar.at[slot])
                q_t, do_t = q_ring.at[slot], do_ring.at[slot]
                lse = mg.load_vec(lse_ring.at[slot, rows], col_layout, sim)
                dlt = mg.load_vec(delta_ring.at[slot, rows], col_layout, sim)

                def then(st, dpt_fn):
                    pt = jnp.exp2(st * c - mg.bcast_cols(lse, st.shape))
                    if masked:
                        q_ids = mg.iota((bk, hb), 1, sim) + (t * bq + w * hb)
                        pt = jnp.where(key_ids <= q_ids, pt, 0.0)
                    dpt = dpt_fn()
                    return pt, pt * (dpt - mg.bcast_cols(dlt, dpt.shape))

                pt, dst = mg.dot_pair_nt(k_smem, q_t.at[rows], v_smem, do_t.at[rows], then, sim=sim)
                p_x.at[par, w][...] = pt.astype(dtype)
                ds_x.at[par, w][...] = dst.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(x_bar)
                plgpu.barrier_wait(x_bar)
                products = []
                for half in range(2):
                    r = pl.ds(half * hb, hb)
                    products += [(0, p_x.at[par, half], do_t.at[r, pl.ds(w * dvh, dvh)]),
                                 (1, ds_x.at[par, half], q_t.at[r, pl.ds(w * dh, dh)])]
                dv, dk = mg.dots_into((dv, dk), products, sim=sim)
                plgpu.barrier_arrive(in_free.at[slot])
                return dk, dv

            def head(g, carry):
                first = g * n_t - lo
                carry = lax.fori_loop(lo, full, functools.partial(
                    step, first=first, masked=True), carry)
                return lax.fori_loop(full, n_q, functools.partial(
                    step, first=first, masked=False), carry)

            dk, dv = lax.fori_loop(0, group, head,
                                   (mg.zeros((bk, dh), sim), mg.zeros((bk, dvh), sim)))
            # K and V are spent once both warpgroups passed the last step's barrier (their
            # score products are done); each stages its own columns in them.
            k_out, v_out = k_smem.at[:, pl.ds(w * dh, dh)], v_smem.at[:, pl.ds(w * dvh, dvh)]
            k_out[...] = (dk * scale).astype(dtype)
            v_out[...] = dv.astype(dtype)
            plgpu.commit_smem()
            for r in range(0, bk, 8):  # a column slice: a TMA copy an 8-row tile
                rows8 = pl.ds(kv_base + r, 8)
                plgpu.copy_smem_to_gmem(k_out.at[pl.ds(r, 8)],
                                        dk_ref.at[bi, rows8, h, pl.ds(w * dh, dh)],
                                        commit_group=False)
                plgpu.copy_smem_to_gmem(v_out.at[pl.ds(r, 8)],
                                        dv_ref.at[bi, rows8, h, pl.ds(w * dvh, dvh)],
                                        commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        for w in range(2):
            pl.when(wg == w)(functools.partial(consumer, w))

        @pl.when(wg == 2)
        def _produce_q():
            plgpu.set_max_registers(BWD_REGISTERS[2][1], action="decrease")
            plgpu.copy_gmem_to_smem(k_ref.at[bi, keys, h], k_smem, kv_bar)
            plgpu.copy_gmem_to_smem(v_ref.at[bi, keys, h], v_smem, kv_bar)
            _produce_group(bi, h, group, lo, n_t, bq, stages, in_bar, in_free,
                           (q_ref, do_ref, lse_ref, delta_ref),
                           (q_ring, do_ring, lse_ring, delta_ring))

    scratch = [
        *(mg.smem(shape, dtype, swizzle=SWIZZLE) for shape in (
            (bk, d), (bk, dv_dim), (stages, bq, d), (stages, bq, dv_dim))),
        plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32),
        # P^T and dS^T halves: [buffer, warpgroup, keys, rows]
        mg.smem((2, 2, bk, hb), dtype, swizzle=SWIZZLE),
        mg.smem((2, 2, bk, hb), dtype, swizzle=SWIZZLE),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
    ]
    out_type = [jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    grid, names = dkdv_grid(b, hkv, n_kt, causal, sim)
    return mg.launch(kernel, out_type, scratch, grid=grid, grid_names=names, compute_wgs=2,
                     name="flash_dkdv_split", interpret=interpret,
                     reduction_scratch=0)(q, k, v, do, lse2, delta)
