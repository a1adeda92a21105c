"""FlashAttention for Hopper in Pallas with the Mosaic GPU lowering: forward, LSE, backward.

q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], f16 or bf16, D a multiple of 64 (64, 128, 256).
Every kernel is warp-specialised in the FlashAttention-3 manner: one producer warpgroup
issues TMA copies of the streamed tiles into a `num_stages`-deep shared-memory ring
(a "loaded" barrier per slot, signalled by the TMA unit, and a "free" barrier per slot,
signalled by the consumers), and compute warpgroups issue `wgmma` with float32
accumulators in registers. Each compute warpgroup owns a 64-row (by default) slab of
the CTA's tile; all compute warpgroups of a CTA consume the same stream.

  forward   work items (q tile, Hq, B); 2 compute warpgroups x block_q rows. Streams
            K and V tiles; S = Q K^T, online softmax in base 2 (scores scaled by
            scale * log2 e inside the exponent's multiply-add; running max m and sum l
            in float32), O += P V. By default (see default_block_sizes) causal
            attention ping-pongs the two warpgroups on a schedule barrier, so one's
            softmax overlaps the other's matmuls, and each warpgroup issues a tile's
            P V together with the next tile's Q K^T; full attention at D = 128 instead
            overlaps each warpgroup's softmax with its own next QK^T and current PV
            (FA3's intra-warpgroup pipelining). By default (fixed_max) the max m is
            the row's max over its first key tile, kept for the rest of the stream
            (no running max, no rescaling of O); a tile where that would overflow
            float32 runs again with the running max. Writes O and LSE = (m + log2 l) * ln 2.
  dq        work items (q tile, Hq, B); streams K, V; dS = P (dO V^T - delta), dQ += dS K.
  dk, dv    grid (kv tiles, Hkv, B); streams Q, dO, LSE, delta of every query head of
            the GQA group in turn (so K/V are never repeated and dk/dv are summed over
            the group in registers); dV += P^T dO, dK += dS^T Q.
  delta = rowsum(dO * O) is computed with jnp before the backward kernels.

The forward and dq kernels run either one CTA per work item or (`persistent`) one CTA
per SM looping over items, its ring and barriers carried from item to item, so the next
item's loads overlap this one's epilogue (mosaic_common.TileSchedule: which items, in
which order). The backward can issue its two independent score products together and
work on the first while the second runs (`overlap_bwd`).

Causal attention is bottom-right aligned (query i sees keys j <= i + Skv - Sq). A CTA's
stream stops at the last tile its rows can see (dk/dv: starts at the first); inside it
tiles fully below the diagonal run without a mask and only tiles crossing it (or the key
tail) pay for one. A warpgroup whose slab sees fewer tiles than its CTA's stream still
waits on and releases the extra slots, so the ring's barriers stay in phase. Lengths
that are not tile multiples are zero-padded here; padded keys are masked wherever their
scores are used (forward, dq), their dk/dv rows are dropped, and padded query rows add
nothing to dk/dv (Q = dO = 0 there). A query row that sees no key (causal, Sq > Skv)
gets o = 0 and LSE = -inf. The forward kernel is in flash_mosaic_fwd.py, the backward
kernels in flash_mosaic_bwd.py, the shared building blocks in mosaic_common.py; this
module holds the tiles (BlockSizes), the padding and the custom VJP.

On the CPU the kernels run in JAX's Mosaic GPU simulator (slow; small shapes only).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.kernels.pallas import mosaic_common as mg
from jaxllm.kernels.pallas.flash_mosaic_bwd import dkdv_kernel, dq_kernel
from jaxllm.kernels.pallas.flash_mosaic_fwd import forward
from jaxllm.kernels.pallas.flash_mosaic_fwd import tile_bytes as fwd_tile_bytes
from jaxllm.kernels.pallas.mosaic_common import LOG2E

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles (multiples of 64) and pipeline depth of the three kernels.

    block_q: query rows per compute warpgroup in the forward pass (2 warpgroups a CTA).
    block_kv: keys per streamed K/V tile in the forward pass.
    num_stages: depth of the shared-memory ring (>= 2).
    schedule_barrier: ping-pong the two forward warpgroups (FA3 inter-warpgroup overlap).
    early_k_wait: forward; wait for the next K tile while this tile's PV wgmma runs,
      instead of at the start of the next step.
    sum_before_sync: forward; add P's row sums to l and pin (acc, m, l, P) with an
      optimization barrier before the schedule barrier, so the compiler cannot sink the
      softmax tail past it.
    chain_qk: forward, ping-pong schedule (without overlap_softmax); a warpgroup issues
      tile j's P V and tile j+1's Q K^T together, so the tensor pipe gets them back to
      back, rather than issuing Q K_{j+1}^T only once P_j V_j is done. On the H200 it
      measured 2-3% faster causal at D = 128 at the board's power cap (docs/benchmarks.md).
      early_k_wait and sum_before_sync are options of the unchained step: either one
      turns chain_qk off.
    overlap_softmax: forward; FA3 intra-warpgroup overlap: step j issues Q K_j^T and then
      P_{j-1} V_{j-1} as two async wgmmas, and runs the softmax of tile j while the PV
      wgmma is still in flight (one more S-sized tile of registers).
    fixed_max: forward, chained or overlapped schedule; each query row's scores are
      shifted by the row's max over its first key tile, kept for the whole stream,
      instead of by a running max: after the first tile, no row max, no rescaling of O
      and no wait for the max before the exponentials. The row's sum of exponentials is
      then at least 1 (the first tile's max term); while it stays below 2^64 no term
      overflows float32 (a later score would have to exceed the first tile's max by
      about 64 - log2(Skv) in log2 units, some 40 nats, to pass it). A tile with a row
      past it is flagged, and once the program's other tiles are done it runs again
      with the running max (its K/V streamed again). Not with kv_multicast, nor where
      the flags (4 bytes a tile and warpgroup) do not fit in shared memory, nor with
      sm_scale <= 0; there the running max is used.
    persistent: forward; one CTA per SM, each looping over the (q tile, head, batch)
      work items pid, pid + #SMs, ... (causal: heaviest tiles first, dealt in rounds of
      alternating direction; see mosaic_common.TileSchedule): the producer streams the
      next tile's K/V into the ring while the consumers finish the last, and the next
      tile's Q loads during this one (where two Q buffers fit beside the ring: D <= 128
      with the default tiles), so a CTA's start-up and epilogue no longer leave the SM
      idle.
    kv_multicast: forward; CTAs in clusters of two, each K/V tile loaded from L2 once and
      multicast by TMA into both CTAs' rings; a ring slot is refilled once the consumers
      of both CTAs have freed it. The two CTAs run two query heads of one GQA group on
      the same query tile (so, causal, the same key tiles); with MHA, neighbouring query
      tiles of one head (where their number is even; causal, both stream the longer
      tile's keys). Half the L2 traffic, so under the H200's power cap the clock rises
      by 2-4%, but the two CTAs wait on each other: off by default, as it measured no
      faster (docs/benchmarks.md). Compiled kernels only (the simulator has no clusters).
    persistent_dq: the same for the dq kernel (its Q, dO, LSE and delta tiles).
    overlap_bwd: backward; issue S = Q K^T and dP = dO V^T (dk/dv: their transposes)
      together, so the exponentials run while dP is in flight (and, in dk/dv, dS^T is
      formed while dV += P^T dO runs).
    fused_dq: backward; no dq kernel: the dk/dv kernel also forms dQ += dS K from its
      dS and adds it into a float32 buffer with TMA reductions (5 matmuls a tile pair
      instead of 7; D <= 128). Off by default: on the H200 it measured slower than the
      two kernels at D = 128 and level at D = 64 (docs/benchmarks.md).
    block_q_dq / block_kv_dq, block_q_dkv / block_kv_dkv: the backward kernels' tiles
    (the owned side per warpgroup and the streamed side); compute_wgs_bwd warpgroups a CTA.
    """
    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    schedule_barrier: bool = True
    early_k_wait: bool = False
    sum_before_sync: bool = False
    chain_qk: bool = True
    overlap_softmax: bool = False
    fixed_max: bool = False
    persistent: bool = False
    kv_multicast: bool = False
    persistent_dq: bool = False
    overlap_bwd: bool = False
    fused_dq: bool = False
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_stages_bwd: int = 2
    compute_wgs_bwd: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name.startswith("block_") and (not isinstance(val, int) or val < 64 or val % 64):
                raise ValueError(f"{f.name}={val!r} must be a positive multiple of 64")
        if self.num_stages < 2 or self.num_stages_bwd < 2:
            raise ValueError(f"num_stages={self.num_stages} and num_stages_bwd="
                             f"{self.num_stages_bwd} must be >= 2")
        if self.compute_wgs_bwd not in (1, 2):
            raise ValueError(f"compute_wgs_bwd={self.compute_wgs_bwd} must be 1 or 2")

# ----------------------------------------------------------------------------- public API


def _tiles(sq: int, skv: int, bs: BlockSizes, backward: bool) -> tuple[BlockSizes, int, int]:
    """Clamp the key tiles to short sequences; the padded (Sq, Skv) that the forward
    kernel's tiles (or, `backward`, both backward kernels' tiles) divide."""
    kv_cap = mg.round_up(skv, 64)
    bs = dataclasses.replace(bs, block_kv=min(bs.block_kv, kv_cap),
                             block_kv_dq=min(bs.block_kv_dq, kv_cap))
    if not backward:
        return bs, mg.round_up(sq, 2 * bs.block_q), mg.round_up(skv, bs.block_kv)
    n_wg = bs.compute_wgs_bwd
    q_mult = math.lcm(n_wg * bs.block_q_dq, bs.block_q_dkv)
    kv_mult = math.lcm(bs.block_kv_dq, n_wg * bs.block_kv_dkv)
    return bs, mg.round_up(sq, q_mult), mg.round_up(skv, kv_mult)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _flash(q, k, v, causal, scale, bs, interpret):
    return _flash_fwd(q, k, v, causal, scale, bs, interpret)[0]


def _flash_fwd(q, k, v, causal, scale, bs, interpret):
    sq, skv = q.shape[1], k.shape[1]
    bs, sq_p, skv_p = _tiles(sq, skv, bs, backward=False)
    qp = mg.pad_axis(q, 1, sq_p)
    kp, vp = mg.pad_axis(k, 1, skv_p), mg.pad_axis(v, 1, skv_p)
    o, lse = forward(qp, kp, vp, causal=causal, scale=scale, bs=bs, skv=skv,
                     offset=skv - sq, interpret=interpret)
    o, lse = o[:, :sq], lse[:, :, :sq]
    return (o, lse), (q, k, v, o, lse)


def _flash_bwd(causal, scale, bs, interpret, res, cts):
    q, k, v, o, lse = res
    do, dlse = cts
    sq, skv = q.shape[1], k.shape[1]
    bs, sq_p, skv_p = _tiles(sq, skv, bs, backward=True)
    # delta = rowsum(dO * O) minus the LSE cotangent (d lse / d s = p). Rows that see no
    # key have LSE -inf; +inf makes their P exactly 0.
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    delta, lse2 = mg.pad_axis(delta, 2, sq_p), mg.pad_axis(lse2, 2, sq_p)
    qp, dop = mg.pad_axis(q, 1, sq_p), mg.pad_axis(do.astype(q.dtype), 1, sq_p)
    kp, vp = mg.pad_axis(k, 1, skv_p), mg.pad_axis(v, 1, skv_p)
    common = dict(causal=causal, scale=scale, bs=bs, offset=skv - sq, interpret=interpret)
    if bs.fused_dq:
        dk, dv, dq = dkdv_kernel(qp, kp, vp, dop, lse2, delta, **common)
        dq = (dq[:, :sq] * scale).astype(q.dtype)
    else:
        dq = dq_kernel(qp, kp, vp, dop, lse2, delta, skv=skv, **common)[:, :sq]
        dk, dv = dkdv_kernel(qp, kp, vp, dop, lse2, delta, **common)
    return dq, dk[:, :skv], dv[:, :skv]


_flash.defvjp(_flash_fwd, _flash_bwd)


def unsupported_reason(q, k, v) -> str | None:
    """None when the kernels can run these inputs, else why not (for `impl="auto"`)."""
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        return f"head_dim={d} is not supported by pallas_mosaic (choose one of {HEAD_DIMS})"
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"pallas_mosaic takes bfloat16 or float16 inputs; got {jnp.dtype(q.dtype)}"
    return None


def default_block_sizes(head_dim: int, causal: bool = True) -> BlockSizes:
    """Tiles that fit Hopper's 227 KiB of shared memory a CTA. At D = 256 the forward
    streams 64-key tiles (Q 64 KiB + a 2-stage K/V ring 128 KiB) and the backward runs
    one compute warpgroup a CTA (its owned tiles 64 KiB + the streamed ring 128 KiB).

    Schedules, measured on the H200 at D = 64 and 128 (docs/benchmarks.md):
    - forward: causal attention runs the two warpgroups in ping-pong; full attention at
      D = 128 runs the FA3 intra-warpgroup overlap without the ping-pong (7-10% faster
      with GQA, level with MHA; 11-17% slower when causal). Persistent CTAs (one a SM)
      gain 3-5% at S = 4096 and 13-15% at S = 1024.
    - forward: each row shifted by its first key tile's max (fixed_max); at the power
      cap 6-7% faster than the running max at D = 128 (1.12x cuDNN, full and causal)
      and 8-15% at D = 256 (1.08x full, 1.01x causal), 0-10% in interleaved rounds
      (D = 64 and 128).
    - backward: S and dP issued together (overlap_bwd: dq 7% and dk/dv 3% faster); a
      persistent dq kernel for full attention only (faster full, slower causal).
    """
    if head_dim >= 256:
        return BlockSizes(block_kv=64, compute_wgs_bwd=1, fixed_max=True)
    bs = BlockSizes(persistent=True, persistent_dq=not causal, overlap_bwd=True,
                    fixed_max=True)
    if not causal and head_dim == 128:
        return dataclasses.replace(bs, overlap_softmax=True, schedule_barrier=False)
    return bs


def _block_sizes(head_dim: int, kwargs: dict, causal: bool = True) -> BlockSizes:
    bs = kwargs.pop("block_sizes", None) or default_block_sizes(head_dim, causal)
    if not isinstance(bs, BlockSizes):
        raise ValueError(f"block_sizes must be a flash_mosaic.BlockSizes; got {type(bs).__name__}")
    names = {f.name for f in dataclasses.fields(BlockSizes)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown pallas_mosaic options {unknown}; valid: "
                         f"block_sizes, {sorted(names)}")
    bs = dataclasses.replace(bs, **kwargs)
    fwd_bytes = fwd_tile_bytes(bs.block_q, bs.block_kv, bs.num_stages, head_dim)
    if fwd_bytes > mg.SMEM_BUDGET:
        raise ValueError(f"the forward's tiles (Q: 2 x block_q={bs.block_q} rows; K/V ring: "
                         f"num_stages={bs.num_stages} x block_kv={bs.block_kv} keys) take "
                         f"{fwd_bytes // 1024} KiB of shared memory at head_dim={head_dim}; "
                         f"a CTA has {mg.SMEM_BUDGET // 1024} KiB")
    if bs.fused_dq and head_dim > 128:
        raise ValueError(f"fused_dq takes head_dim <= 128 (the dQ accumulator and the staged "
                         f"dS do not fit beside dK and dV); got head_dim={head_dim}")
    return bs


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
    bs = _block_sizes(q.shape[-1], dict(kwargs), bool(causal))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _flash(q, k, v, bool(causal), scale, bs, bool(interpret))


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, **kwargs):
    """q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] -> [B, Sq, Hq, D]; see kernels.flash_attention."""
    return flash_attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale, **kwargs)[0]
