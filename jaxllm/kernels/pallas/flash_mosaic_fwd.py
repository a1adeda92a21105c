"""Forward kernel of the Mosaic GPU FlashAttention (see flash_mosaic.py for the design):
O and LSE, work items (q tile, Hq, B), K/V tiles streamed through a TMA ring.

Two schedules of the two compute warpgroups (cfg.schedule, a flash_mosaic.FwdConfig):
  pingpong    the warpgroups take turns on a schedule barrier, so one's softmax runs
              while the other's matmuls do; step j issues P_j V_j and Q K_{j+1}^T
              together, so each warpgroup's two products reach the tensor pipe back to
              back (FlashAttention-3's inter-warpgroup overlap).
  overlapped  no barrier between them; step j issues Q K_j^T and P_{j-1} V_{j-1} and
              runs the softmax of tile j while P V is in flight (FA3's intra-warpgroup
              overlap, one more score tile of registers).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.pallas import mosaic_common as mg
from jaxllm.kernels.pallas.mosaic_common import LN2, LOG2E

# Registers a thread of the forward's compute / producer warpgroups (2 x 128 compute
# threads and 128 producer threads must fit the SM's 64K registers).
FWD_REGISTERS = (232, 40)
N_WG = 2  # compute warpgroups a CTA
# fixed_max: a row's sum of exponentials against its first key tile's max is at least 1
# (that max's own term); above this bound a later score was so much larger that terms
# might overflow float32, and the tile runs again with a running max.
FIXED_MAX_SUM_LIMIT = 2.0 ** 64
FLAG_SCRATCH = 64  # shared-memory bytes of the warpgroup-wide reduction to a tile's flag


def tile_bytes(block_q: int, block_kv: int, stages: int, d: int, itemsize: int = 2,
               q_buffers: int = 1, dv: int | None = None) -> int:
    """Shared memory of the forward's Q tiles (q_buffers of them), its K/V ring and, when
    the value head dim dv differs from the query-key dim d, the O tiles that stage the
    output (else the spent Q tile stages it)."""
    dv = d if dv is None else dv
    o_tiles = 0 if dv == d else N_WG * block_q * dv
    return (q_buffers * N_WG * block_q * d + stages * block_kv * (d + dv) + o_tiles) * itemsize


def forward(q, k, v, *, causal, scale, cfg, skv, offset, interpret):
    """Padded q [B, Sq_p, Hq, D], k [B, Skv_p, Hkv, D], v [B, Skv_p, Hkv, Dv] -> o [B, Sq_p,
    Hq, Dv], lse [B, Hq, Sq_p] (natural). Q K^T contracts over D, P V and O are Dv wide."""
    b, sq_p, hq, d = q.shape
    skv_p, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    # O is staged for its TMA store in the spent Q tile, or in tiles of its own when Dv != D
    own_o = dv != d
    group = hq // hkv
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    pingpong = cfg.schedule == "pingpong"
    n_wg = N_WG
    n_qt, n_kv = sq_p // (n_wg * bq), skv_p // bk
    # A ring deeper than the stream would slice tiles past the keys while tracing the
    # producer's (never taken) prologue copies.
    stages = min(stages, n_kv)
    n_kv_full_tail = skv // bk  # key tiles without padded keys
    c = scale * LOG2E
    dtype = jnp.dtype(q.dtype)
    order = mg.TileSchedule(n_qt, hq, b, causal=causal, persistent=cfg.persistent,
                            sim=interpret)
    # A program that runs several tiles double-buffers Q (the next tile's Q loads during
    # this one) where shared memory allows: not at D = 256, nor beside a ring of
    # 192-key tiles at D = 128.
    fits_two = tile_bytes(bq, bk, stages, d, dtype.itemsize, q_buffers=2, dv=dv) <= mg.SMEM_BUDGET
    n_qbuf = 2 if order.multi and fits_two else 1
    # fixed_max needs scale > 0 (its paths mask the raw scores and scale them inside
    # exp2: masked -inf times c <= 0 is not -inf) and room beside the tiles for a flag per
    # tile and warpgroup, its barrier, the reduction scratch and 1 KiB to spare.
    max_tiles = order.max_count
    flag_bytes = mg.round_up(n_wg * max_tiles * 4, 128) + 128 + mg.round_up(FLAG_SCRATCH, 128)
    fixed_max = (cfg.fixed_max and c > 0 and
                 tile_bytes(bq, bk, stages, d, dtype.itemsize, q_buffers=n_qbuf, dv=dv)
                 + flag_bytes + 1024 <= mg.SMEM_BUDGET)

    def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem,
               q_bar, k_bar, v_bar, k_free, v_free, sched, *extra_scratch):
        pid, wg = lax.axis_index("programs"), lax.axis_index("wg")
        n_mine = order.count(pid)
        extra_scratch = list(extra_scratch)
        o_smem = extra_scratch.pop() if own_o else None
        if fixed_max:
            flags, flags_bar = extra_scratch

            def flagged(i):  # a row of tile i overflowed in either warpgroup's slab
                return sum(flags[i, w] for w in range(n_wg)) > 0

        coords = functools.partial(order.query_tile, pid, rows=n_wg * bq, bk=bk, n_kv=n_kv,
                                   offset=offset)

        def sync():  # one ping-pong rendezvous (none in the overlapped schedule)
            if pingpong:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        def attend(q_tile, bi, h, tile_base, n_steps, base, fixed=False):
            """One CTA tile: stream its n_steps key tiles, ring steps base, base + 1, ...
            fixed: shift each row by its first key tile's max (fixed_max); returns
            whether a row of this warpgroup's slab overflowed the bound, else None."""
            slot_of = lambda s: lax.rem(base + s, jnp.int32(stages))
            q_base = tile_base + wg * bq
            my_steps, n_full = mg.slab_steps(q_base, bq, bk, offset, n_steps, n_kv_full_tail,
                                             causal)
            rows = mg.iota((bq, bk), 0, interpret) + (q_base + offset)

            def softmax(s, sc, m, masked, keep_max=False):
                """Raw scores of key tile s -> (P in float32, new max m, rescale alpha).

                m is in log2 units (scores times c). With c > 0 the row max is taken on
                the raw scores and scaled once per row, so each score is scaled and
                shifted by one fused multiply-add inside exp2. keep_max: m is the row's
                fixed shift (finite), alpha None."""
                if keep_max:
                    if masked:
                        sc = mg.mask_scores(sc, s * bk, skv, rows, causal, interpret)
                    return jnp.exp2(sc * c - mg.bcast_rows(m, sc.shape)), m, None
                fused = c > 0
                if not fused:
                    sc = sc * c  # (bq, bk), log2 units
                if masked:
                    sc = mg.mask_scores(sc, s * bk, skv, rows, causal, interpret)
                m_new = jnp.maximum(m, sc.max(axis=1) * c if fused else sc.max(axis=1))
                # Rows with every key masked so far keep m = -inf: shift by 0, not -inf.
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                alpha = jnp.exp2(m - m_use)
                if fused:
                    p = jnp.exp2(sc * c - mg.bcast_rows(m_use, sc.shape))
                else:
                    p = jnp.exp2(sc - mg.bcast_rows(m_use, sc.shape))
                return p, m_new, alpha

            def scores0():
                """Q K_0^T, one rendezvous while it runs; K_0's slot released."""
                slot = slot_of(0)
                plgpu.barrier_wait(k_bar.at[slot])
                sc = mg.dot(q_tile, k_smem.at[slot], trans_b=True, sim=interpret, during=sync)
                plgpu.barrier_arrive(k_free.at[slot])
                return sc

            # overlapped: tile 0 runs Q K^T and its softmax alone, step j (>= 1) issues
            # Q K_j^T and P_{j-1} V_{j-1} together and runs softmax j under P V, the last
            # P V runs alone.
            def first(carry):
                acc, m, l = carry
                sc = scores0()
                p, m, alpha = softmax(0, sc, m, masked=True)
                l = l * alpha + p.sum(axis=1)
                return acc, m, l, p.astype(dtype)

            # a row that sees no key keeps a shift of 0 (its l stays 0, so its LSE is -inf)
            def finite(m):
                return jnp.where(m == -jnp.inf, 0.0, m)

            def step_overlapped(s, carry, masked):
                acc, m, l, p_prev = carry
                slot, prev = slot_of(s), slot_of(s - 1)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[prev])

                def between(sc):  # S_j is ready; PV_{j-1} may still run
                    plgpu.barrier_arrive(k_free.at[slot])
                    p, m_new, alpha = softmax(s, sc, m, masked, keep_max=fixed)
                    l_new = (l if fixed else l * alpha) + p.sum(axis=1)
                    return p.astype(dtype), m_new, l_new, alpha

                acc, (p16, m, l, alpha) = mg.dot_overlapped(
                    q_tile, k_smem.at[slot], p_prev, v_smem.at[prev], acc, between,
                    sim=interpret)
                plgpu.barrier_arrive(v_free.at[prev])
                if not fixed:
                    acc = acc * mg.bcast_rows(alpha, acc.shape)
                return acc, m, l, p16

            def last(carry):
                acc, m, l, p_prev = carry
                prev = slot_of(my_steps - 1)
                plgpu.barrier_wait(v_bar.at[prev])
                acc = mg.dot(p_prev, v_smem.at[prev], acc=acc, a_ref=False, sim=interpret)
                plgpu.barrier_arrive(v_free.at[prev])
                return acc, m, l

            def overlapped(carry):
                carry = first(carry)
                if fixed:  # tile 0's max is every later tile's shift
                    carry = (carry[0], finite(carry[1]), *carry[2:])
                lo = jnp.maximum(n_full, 1)
                carry = lax.fori_loop(1, lo, functools.partial(step_overlapped, masked=False),
                                      carry)
                carry = lax.fori_loop(lo, my_steps,
                                      functools.partial(step_overlapped, masked=True), carry)
                return last(carry)

            # pingpong: step j runs the softmax of tile j, hands the turn over, then issues
            # P_j V_j and Q K_{j+1}^T together (P V first: P's registers are then formed
            # before either wgmma, so ptxas need not serialise them). Two rendezvous a tile.
            def chain_softmax(s, carry, masked):
                acc, m, l, sc = carry
                p, m_new, alpha = softmax(s, sc, m, masked, keep_max=fixed)
                if fixed:
                    return acc, m, l + p.sum(axis=1), p.astype(dtype)
                acc = acc * mg.bcast_rows(alpha, acc.shape)
                return acc, m_new, l * alpha + p.sum(axis=1), p.astype(dtype)

            def arrive_wait_v(slot):  # the softmax is done: hand over, then wait for V
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bar.at[slot])

            def chain_step(s, carry, masked):
                acc, m, l, p16 = chain_softmax(s, carry, masked)
                slot, nxt = slot_of(s), slot_of(s + 1)
                arrive_wait_v(slot)
                plgpu.barrier_wait(k_bar.at[nxt])
                plgpu.barrier_wait(sched)
                acc, sc = mg.dot_pv_qk(p16, v_smem.at[slot], acc, q_tile, k_smem.at[nxt],
                                       sim=interpret, during=sync)
                plgpu.barrier_arrive(v_free.at[slot])
                plgpu.barrier_arrive(k_free.at[nxt])
                return acc, m, l, sc

            def chain_last(carry):
                # the last tile: P V alone; masked, which is exact for any tile
                s = my_steps - 1
                acc, m, l, p16 = chain_softmax(s, carry, masked=True)
                slot = slot_of(s)
                arrive_wait_v(slot)
                plgpu.barrier_wait(sched)
                acc = mg.dot(p16, v_smem.at[slot], acc=acc, a_ref=False, sim=interpret)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, l

            def chained(carry):
                acc, m, l = carry
                sc0 = scores0()
                if fixed:  # tile 0's max is every tile's shift
                    sc_m = mg.mask_scores(sc0, 0, skv, rows, causal, interpret)
                    m = finite(sc_m.max(axis=1) * c)
                carry = (acc, m, l, sc0)
                lo = jnp.minimum(n_full, my_steps - 1)
                carry = lax.fori_loop(0, lo, functools.partial(chain_step, masked=False), carry)
                carry = lax.fori_loop(lo, my_steps - 1,
                                      functools.partial(chain_step, masked=True), carry)
                return chain_last(carry)

            def skip(s, _):
                # A tile the other warpgroup needs: release the slot, keep the ping-pong.
                slot = slot_of(s)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                sync()
                sync()
                return _

            row_layout = plgpu.Layout.WGMMA.reduce(1)
            carry = (mg.zeros((bq, dv), interpret),
                     mg.layout(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout, interpret),
                     mg.layout(jnp.zeros((bq,), jnp.float32), row_layout, interpret))
            pl.when(wg == 1)(sync)
            pipeline = chained if pingpong else overlapped
            if causal:  # a slab that sees no key (Sq > Skv) skips the pipeline
                acc, m, l = lax.cond(my_steps > 0, pipeline, lambda c: c, carry)
            else:
                acc, m, l = pipeline(carry)
            lax.fori_loop(my_steps, n_steps, skip, None)
            pl.when(wg == 0)(sync)

            empty = l == 0.0
            l_safe = jnp.where(empty, 1.0, l)
            o = acc * mg.bcast_rows(1.0 / l_safe, acc.shape)
            lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l_safe)) * LN2)
            # Q is spent: its buffer stages O (Dv = D). The stores of the last tile have
            # read O's own tiles before this one started (consume_tiles waits for them).
            o_tile = o_smem.at[wg] if own_o else q_tile
            o_tile[...] = o.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_tile, o_ref.at[bi, pl.ds(q_base, bq), h],
                                    commit_group=False)
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, h, pl.ds(q_base, bq)],
                                    commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            if fixed:  # whether a row of the slab outgrew its shift (the tile then runs again)
                return jnp.max(jnp.where(l > FIXED_MAX_SUM_LIMIT, 1.0, 0.0)) > 0.0
            return None

        @pl.when(wg < n_wg)
        def _compute():
            plgpu.set_max_registers(FWD_REGISTERS[0], action="increase")

            def load_q(i, buf):
                bi, h, tile_base, _ = coords(i)
                plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(tile_base + wg * bq, bq), h],
                                        q_smem.at[buf, wg], q_bar.at[buf * n_wg + wg])

            def tile(i, buf, base, fixed=fixed_max):
                bi, h, tile_base, n_steps = coords(i)
                bad = attend(q_smem.at[buf, wg], bi, h, tile_base, n_steps, base, fixed)
                if fixed:
                    flags[i, wg] = bad.astype(jnp.int32)
                return n_steps

            def flags_done():  # both compute warpgroups' flags are stored
                plgpu.barrier_arrive(flags_bar)
                plgpu.barrier_wait(flags_bar)

            redo = None
            if fixed_max:  # run the flagged tiles again with a running max
                redo = (flags_done, flagged, functools.partial(tile, fixed=False))
            mg.consume_tiles(n_mine, n_qbuf, load_q,
                             lambda buf: plgpu.barrier_wait(q_bar.at[buf * n_wg + wg]), tile,
                             redo=redo)

        @pl.when(wg == n_wg)
        def _produce_kv():
            plgpu.set_max_registers(FWD_REGISTERS[1], action="decrease")

            mg.produce_kv_tiles(n_mine, stages, coords, group, bk,
                                (k_ref, k_smem, k_bar, k_free), (v_ref, v_smem, v_bar, v_free),
                                redo=(lambda: plgpu.barrier_wait(flags_bar), flagged)
                                if fixed_max else None)

    scratch = [
        mg.smem((n_qbuf, n_wg, bq, d), dtype),
        mg.smem((stages, bk, d), dtype), mg.smem((stages, bk, dv), dtype),
        plgpu.SMEM((n_wg, bq), jnp.float32),
        plgpu.Barrier(num_barriers=n_qbuf * n_wg),
        plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_wg),
    ]
    if fixed_max:  # a flag per tile and warpgroup; the compute warpgroups' last tile done
        scratch += [plgpu.SMEM((max_tiles, n_wg), jnp.int32), plgpu.Barrier(num_arrivals=n_wg)]
    if own_o:
        scratch.append(mg.smem((n_wg, bq, dv), dtype))
    out_type = [jax.ShapeDtypeStruct((b, sq_p, hq, dv), dtype),
                jax.ShapeDtypeStruct((b, hq, sq_p), jnp.float32)]
    return mg.launch(kernel, out_type, scratch, grid=(order.programs,), grid_names=("programs",),
                     compute_wgs=n_wg, name="flash_fwd", interpret=interpret,
                     reduction_scratch=FLAG_SCRATCH if fixed_max else 0)(q, k, v)
