"""Backward kernels of the Mosaic GPU FlashAttention (see flash_mosaic.py for the design).

  dq        work items (q tile, Hq, B): each compute warpgroup owns block_q_dq query
            rows and their dO, LSE and delta; K/V tiles stream through the ring.
            dS = P (dO V^T - delta), dQ += dS K, P = exp2(S log2 e - LSE log2 e).
  dk, dv    grid over (B, Hkv, kv tiles; causal: pairs of them, dkdv_grid): each
            compute warpgroup owns block_kv_dkv keys; the Q, dO, LSE and delta tiles of
            every query head of the GQA group stream past in turn, so dk/dv are summed
            over the group in registers. dV += P^T dO, dK += dS^T Q (computed
            transposed: S^T = K Q^T). Where one warpgroup's two accumulators do not fit
            its registers (D 256), two warpgroups share each key tile and split dK's and
            dV's columns (dkdv_split_kernel).

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


def dkdv_grid(b: int, hkv: int, n_kt: int, causal: bool):
    """(grid, grid_names) of the dK/dV kernels. Mosaic GPU maps a grid's last axis to
    CUDA's fastest-varying block index. Key tiles last: the CTAs launched together are
    one (batch, head)'s key tiles, which stream the same Q, dO, LSE and delta tiles, so L2
    serves them once for all (A8 in docs/performance.md: fwd+bwd 1.06-1.13x the
    batch-fastest order in full attention). A causal head's first key tiles see the most
    queries, so causal CTA j of a head runs key tiles j and then n_kt - 1 - j (the middle
    one alone when n_kt is odd, over_kv_tiles): every CTA streams as many query tiles and
    no heavy tile is left for the grid's end (A9: fwd+bwd 1.02-1.08x one tile a CTA at D 64
    GQA and D 256, even at D 64 MHA and the D 128 headline)."""
    n = -(-n_kt // 2) if causal else n_kt
    return (b, hkv, n), ("batch", "heads", "kv_seq")


def over_kv_tiles(n_kt: int, causal: bool, body):
    """body(kt, base) over this dK/dV CTA's key tiles in turn (dkdv_grid), base the ring
    step where tile kt's stream starts and its return the next tile's; the last base."""
    j = lax.axis_index("kv_seq")
    if not causal:
        return body(j, jnp.int32(0))
    return lax.fori_loop(0, jnp.where(2 * j + 1 == n_kt, 1, 2), lambda m, base: body(
        jnp.where(m == 0, j, n_kt - 1 - j), base), jnp.int32(0))


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

    grid, names = dkdv_grid(b, hkv, n_kt, causal)

    def queries(tile_base):
        """(lo, n_t): query tiles before lo see none of the keys from tile_base on (rows r
        see keys <= r + offset); n_t = n_q - lo stream past them."""
        lo = (jnp.minimum(mg.floordiv_nonneg(tile_base - offset, bq), n_q) if causal
              else jnp.int32(0))
        return lo, n_q - lo

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem,
               v_smem, q_ring, do_ring, lse_ring, delta_ring, kv_bar, in_bar, in_free):
        bi, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][0], action="increase")
            k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]

            def kv_tile(kt, base):  # key tile kt; its stream starts at ring step base
                tile_base = kt * (n_wg * bk)
                lo, n_t = queries(tile_base)
                kv_base = tile_base + wg * bk
                keys = pl.ds(kv_base, bk)
                if causal:
                    lo_w = jnp.minimum(mg.floordiv_nonneg(kv_base - offset, bq), n_q)
                    full_w = mg.clip(mg.cdiv_nonneg(kv_base + bk - 1 - offset, bq), lo_w, n_q)
                else:
                    lo_w = full_w = 0
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
                        dk, dv = pl.run_scoped(scoped, *(plgpu.ACC(sh, jnp.float32)
                                                         for sh in shapes))
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
                    first = base + g * n_t - lo  # stream step of query tile t is first + t
                    carry = lax.fori_loop(lo, lo_w, functools.partial(skip, first=first), carry)
                    carry = lax.fori_loop(lo_w, full_w, functools.partial(
                        step, first=first, masked=True), carry)
                    return lax.fori_loop(full_w, n_q, functools.partial(
                        step, first=first, masked=False), carry)

                dk, dv = lax.fori_loop(0, group, head, (mg.zeros((bk, d), sim),
                                                        mg.zeros((bk, dv_dim), sim)))
                # the K and V tiles stage dK and dV for their stores; the next key tile's
                # loads wait for the stores to have read them
                k_tile[...] = (dk * scale).astype(dtype)
                v_tile[...] = dv.astype(dtype)
                plgpu.commit_smem()
                for tile_, ref in ((k_tile, dk_ref), (v_tile, dv_ref)):
                    plgpu.copy_smem_to_gmem(tile_, ref.at[bi, keys, h], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(0)
                return base + group * n_t

            over_kv_tiles(n_kt, causal, kv_tile)

        @pl.when(wg == n_wg)
        def _produce_q():
            plgpu.set_max_registers(BWD_REGISTERS[n_wg][1], action="decrease")
            _produce_q_tiles(bi, h, group, n_kt, causal, lambda kt: queries(kt * n_wg * bk),
                             bq, stages, in_bar, in_free, (q_ref, do_ref, lse_ref, delta_ref),
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
    return mg.launch(kernel, out_type, scratch, grid=grid, grid_names=names, compute_wgs=n_wg,
                     name="flash_dkdv", interpret=interpret)(q, k, v, do, lse2, delta)


def _produce_q_tiles(bi, h, group, n_kt, causal, queries, bq, stages, in_bar, in_free,
                     refs, rings):
    """The dk/dv producer: for each of the CTA's key tiles in turn (queries(kt) -> its
    (lo, n_t)), the Q, dO, LSE and delta tiles of query tiles lo, ..., lo + n_t - 1 of
    each query head of KV head h's group in turn into the ring, the key tiles' streams
    one after another on it."""
    q_ref, do_ref, lse_ref, delta_ref = refs
    q_ring, do_ring, lse_ring, delta_ring = rings

    def kv_tile(kt, base):
        lo, n_t = queries(kt)

        def src(ref, vec):
            def at(s):
                g = lax.div(s, n_t)
                qh, rows = h * group + g, pl.ds((lo + s - g * n_t) * bq, bq)
                return ref.at[bi, qh, rows] if vec else ref.at[bi, rows, qh]
            return at

        mg.produce_steps(base, group * n_t, stages, [(in_bar, in_free, [
            (src(q_ref, False), q_ring), (src(do_ref, False), do_ring),
            (src(lse_ref, True), lse_ring), (src(delta_ref, True), delta_ring)])])
        return base + group * n_t

    mg.drain(over_kv_tiles(n_kt, causal, kv_tile), stages, [in_free])


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

    grid, names = dkdv_grid(b, hkv, n_kt, causal)

    def queries(kv_base):
        """(lo, full, n_t): query tiles before lo see none of the keys from kv_base on,
        those from full see all of the tile's; n_t = n_q - lo stream past them."""
        if causal:
            lo = jnp.minimum(mg.floordiv_nonneg(kv_base - offset, bq), n_q)
            full = mg.clip(mg.cdiv_nonneg(kv_base + bk - 1 - offset, bq), lo, n_q)
        else:
            lo = full = jnp.int32(0)
        return lo, full, n_q - lo

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
               k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, p_x, ds_x, kv_bar,
               in_bar, in_free, x_bar):
        bi, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")

        def consumer(w):
            plgpu.set_max_registers(BWD_REGISTERS[2][0], action="increase")
            rows = pl.ds(w * hb, hb)

            def kv_tile(kt, base):  # key tile kt; its stream starts at ring step base
                kv_base = kt * bk
                keys = pl.ds(kv_base, bk)
                lo, full, n_t = queries(kv_base)
                if w == 0:
                    plgpu.copy_gmem_to_smem(k_ref.at[bi, keys, h], k_smem, kv_bar)
                    plgpu.copy_gmem_to_smem(v_ref.at[bi, keys, h], v_smem, kv_bar)
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

                    pt, dst = mg.dot_pair_nt(k_smem, q_t.at[rows], v_smem, do_t.at[rows], then,
                                             sim=sim)
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
                    first = base + g * n_t - lo
                    carry = lax.fori_loop(lo, full, functools.partial(
                        step, first=first, masked=True), carry)
                    return lax.fori_loop(full, n_q, functools.partial(
                        step, first=first, masked=False), carry)

                dk, dv = lax.fori_loop(0, group, head,
                                       (mg.zeros((bk, dh), sim), mg.zeros((bk, dvh), sim)))
                # K and V are spent once both warpgroups passed the last step's barrier
                # (their score products are done); each stages its own columns in them.
                k_out = k_smem.at[:, pl.ds(w * dh, dh)]
                v_out = v_smem.at[:, pl.ds(w * dvh, dvh)]
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
                if causal:  # a pair: both warpgroups' stores read K and V before the next loads
                    plgpu.barrier_arrive(x_bar)
                    plgpu.barrier_wait(x_bar)
                return base + group * n_t

            over_kv_tiles(n_kt, causal, kv_tile)

        for w in range(2):
            pl.when(wg == w)(functools.partial(consumer, w))

        @pl.when(wg == 2)
        def _produce_q():
            plgpu.set_max_registers(BWD_REGISTERS[2][1], action="decrease")
            _produce_q_tiles(bi, h, group, n_kt, causal, lambda kt: queries(kt * bk)[::2],
                             bq, stages, in_bar, in_free, (q_ref, do_ref, lse_ref, delta_ref),
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
    return mg.launch(kernel, out_type, scratch, grid=grid, grid_names=names, compute_wgs=2,
                     name="flash_dkdv_split", interpret=interpret,
                     reduction_scratch=0)(q, k, v, do, lse2, delta)
