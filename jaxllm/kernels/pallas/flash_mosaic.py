"""FlashAttention for Hopper in Pallas with the Mosaic GPU lowering: forward, LSE, backward.

q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv], f16 or bf16, (D, Dv) one of
HEAD_DIMS: 64, 128 or 256 for both, or MLA's 192 / 128 (DeepSeek-V3's 128 nope + 64 rope
query-key dims, 128 value dims; Q K^T contracts over three 64-column swizzled chunks,
P V, dO V^T, O and dV are Dv wide, dQ and dK D wide). Every kernel is
warp-specialised in the FlashAttention-3 manner: one producer warpgroup issues TMA copies
of the streamed tiles into a `num_stages`-deep shared-memory ring (a "loaded" barrier per
slot, signalled by the TMA unit, and a "free" barrier per slot, signalled by the
consumers), and compute warpgroups issue `wgmma` with float32 accumulators in registers,
each on its own slab of the CTA's tile.

  forward   work items (q tile, Hq, B), 2 compute warpgroups of block_q rows; streams K
            and V. S = Q K^T, softmax in base 2 (the scale folded into exp2's multiply-
            add), O += P V; writes O and LSE. The two schedules are in flash_mosaic_fwd.
            With fixed_max each row is shifted by its max over its first key tile for
            the whole stream (no running max, no rescaling of O); a tile where a row's
            sum outgrows float32's safe range runs again, in the same kernel, with the
            running max.
  dq        work items (q tile, Hq, B); streams K, V; dS = P (dO V^T - delta), dQ += dS K.
  dk, dv    grid (B, Hkv, kv tiles), a head's kv tiles launched together, a causal CTA
            running tiles j and n - 1 - j (dkdv_grid); streams Q, dO, LSE, delta of
            every query head of the GQA group in turn (K/V never repeated, dk/dv summed
            over the group in registers); dV += P^T dO, dK += dS^T Q. At D 256
            (SPLIT_DKDV) two compute warpgroups share each key tile and own half of dK's
            and dV's columns, the halves of P^T and dS^T exchanged through shared memory:
            one warpgroup's two accumulators would take 256 registers a thread.
  delta = rowsum(dO * O) is computed with jnp before the backward kernels.

The forward and dq kernels run one CTA per work item or (persistent) one CTA per SM
looping over items, ring and barriers carried over, so the next item's loads overlap
this one's epilogue (mosaic_common.TileSchedule).

Causal attention is bottom-right aligned (query i sees keys j <= i + Skv - Sq). A stream
stops at the last key tile its rows see (dk/dv: starts at the first); only tiles that
cross the diagonal or the key tail are masked. A warpgroup whose slab sees fewer tiles
than its CTA still waits on and releases their slots, keeping the ring's barriers in
phase. Lengths are zero-padded to the tiles here; padded keys are masked, padded query
rows add nothing to dk/dv. A query row that sees no key gets o = 0 and LSE = -inf.
Which configuration runs for each mask and head dim: default_fwd_config and
default_bwd_config (the measurements behind them: docs/performance.md).

On the CPU the kernels run in JAX's Mosaic GPU simulator (slow; small shapes only).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.kernels.pallas import mosaic_common as mg
from jaxllm.kernels.pallas.flash_mosaic_bwd import dkdv_kernel, dkdv_split_kernel, dq_kernel
from jaxllm.kernels.pallas.flash_mosaic_fwd import forward
from jaxllm.kernels.pallas.flash_mosaic_fwd import tile_bytes as fwd_tile_bytes
from jaxllm.kernels.pallas.mosaic_common import LOG2E

HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))  # (D, Dv) pairs
# (D, Dv) pairs whose dK and dV are split over two warpgroups by columns: one warpgroup's
# two float32 accumulators would take 256 registers a thread (the one-warpgroup kernel,
# spilling, ran forward+backward 0.46x / 0.48x cuDNN against the split's 0.955x / 0.889x,
# causal / full; H100, run A6)
SPLIT_DKDV = ((256, 256),)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SCHEDULES = ("pingpong", "overlapped")


def _check_tiles(cfg, stages: tuple[str, ...]):
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        if f.name.startswith("block_") and (not isinstance(val, int) or val < 64 or val % 64):
            raise ValueError(f"{f.name}={val!r} must be a positive multiple of 64")
    for name in stages:
        if getattr(cfg, name) < 2:
            raise ValueError(f"{name}={getattr(cfg, name)} must be >= 2")


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """The forward kernel. Tiles are multiples of 64.

    block_q: query rows per compute warpgroup (2 warpgroups a CTA).
    block_kv: keys per streamed K/V tile; num_stages: depth of the K/V ring (>= 2).
    schedule: "pingpong" or "overlapped" (see flash_mosaic_fwd).
    fixed_max: shift each row by its first key tile's max (else a running max).
    persistent: one CTA per SM looping over the work items (else one CTA per item).
    """
    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    schedule: str = "pingpong"
    fixed_max: bool = True
    persistent: bool = True

    def __post_init__(self):
        _check_tiles(self, ("num_stages",))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; choose one of {SCHEDULES}")


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """The backward's dq and dk/dv kernels. Tiles are multiples of 64.

    block_q_dq / block_kv_dq: dq's owned query rows per warpgroup / streamed keys.
    block_q_dkv / block_kv_dkv: dk/dv's streamed query rows / owned keys per warpgroup.
    num_stages_bwd: depth of both rings (>= 2); compute_wgs_bwd: compute warpgroups a
    CTA (1 or 2). overlap_bwd: issue the two score products of a step together.
    persistent_dq: one dq CTA per SM looping over the work items.
    At the head dims of SPLIT_DKDV, dk/dv run on two compute warpgroups that share each key
    tile and split the gradients' columns (flash_mosaic_bwd.dkdv_split_kernel), and
    compute_wgs_bwd is dq's alone.
    """
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_stages_bwd: int = 2
    compute_wgs_bwd: int = 2
    overlap_bwd: bool = True
    persistent_dq: bool = False

    def __post_init__(self):
        _check_tiles(self, ("num_stages_bwd",))
        if self.compute_wgs_bwd not in (1, 2):
            raise ValueError(f"compute_wgs_bwd={self.compute_wgs_bwd} must be 1 or 2")


def default_fwd_config(head_dim: int, causal: bool = True,
                       v_head_dim: int | None = None) -> FwdConfig:
    """The measured fastest forward for a head dim and mask: the ping-pong schedule,
    except full attention at D = 128 (overlapped); at D = 256, 64-key tiles so that Q
    and the ring fit in shared memory, and one CTA per item in full attention (causal:
    persistent, its pairs balanced; A9: 1.06-1.11x one CTA an item).

    D 192 / Dv 128 (MLA; not yet measured): the schedules of D 128 (the O accumulator is
    as wide), with 64-key tiles 3 deep: Q (48 KiB), O's own staging tiles (32 KiB) and a
    ring of 128-key tiles (160 KiB) would not fit in shared memory, 64-key tiles take
    40 KiB a stage."""
    if v_head_dim not in (None, head_dim):
        return FwdConfig(block_kv=64, num_stages=3,
                         schedule="pingpong" if causal else "overlapped")
    if head_dim >= 256:
        return FwdConfig(block_kv=64, persistent=causal)
    if not causal and head_dim == 128:
        return FwdConfig(schedule="overlapped")
    return FwdConfig()


def default_bwd_config(head_dim: int, causal: bool = True,
                       v_head_dim: int | None = None) -> BwdConfig:
    """The measured fastest backward: a persistent dq for full attention; at D = 256 one
    compute warpgroup a CTA (its tiles and ring fill shared memory), products in turn,
    and dK / dV split over two warpgroups by columns (SPLIT_DKDV; one warpgroup's
    accumulators spill).

    D 192 / Dv 128 (MLA): D 128's tiles, which take 160 KiB there (dq: Q, dO and a 2-deep
    K/V ring of 64 rows each; dk/dv alike); dq keeps one Q buffer
    (kernels.pallas.flash_mosaic_bwd: two only at D <= 128). Its dK and dV accumulators
    take 160 of a compute thread's 240 registers, so the products run in turn: causal
    forward+backward 1.95 against 2.17 ms with them overlapped (benchmarks/mla.py)."""
    if v_head_dim is not None and v_head_dim != head_dim:
        return BwdConfig(persistent_dq=not causal, overlap_bwd=False)
    if head_dim >= 256:
        return BwdConfig(compute_wgs_bwd=1, overlap_bwd=False)
    return BwdConfig(persistent_dq=not causal)


def _fwd_tiles(sq: int, skv: int, cfg: FwdConfig) -> tuple[FwdConfig, int, int]:
    """Key tiles clamped to short sequences; the padded (Sq, Skv) the tiles divide."""
    cfg = dataclasses.replace(cfg, block_kv=min(cfg.block_kv, mg.round_up(skv, 64)))
    return cfg, mg.round_up(sq, 2 * cfg.block_q), mg.round_up(skv, cfg.block_kv)


def _bwd_tiles(sq: int, skv: int, cfg: BwdConfig,
               split: bool) -> tuple[BwdConfig, int, int]:
    cfg = dataclasses.replace(cfg, block_kv_dq=min(cfg.block_kv_dq, mg.round_up(skv, 64)))
    n_wg = cfg.compute_wgs_bwd
    q_mult = math.lcm(n_wg * cfg.block_q_dq, cfg.block_q_dkv)
    dkdv_wgs = 1 if split else n_wg  # warpgroups owning key tiles of their own
    kv_mult = math.lcm(cfg.block_kv_dq, dkdv_wgs * cfg.block_kv_dkv)
    return cfg, mg.round_up(sq, q_mult), mg.round_up(skv, kv_mult)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _flash(q, k, v, causal, scale, fwd_cfg, bwd_cfg, interpret):
    return _flash_fwd(q, k, v, causal, scale, fwd_cfg, bwd_cfg, interpret)[0]


def _flash_fwd(q, k, v, causal, scale, fwd_cfg, bwd_cfg, interpret):
    sq, skv = q.shape[1], k.shape[1]
    cfg, sq_p, skv_p = _fwd_tiles(sq, skv, fwd_cfg)
    qp = mg.pad_axis(q, 1, sq_p)
    kp, vp = mg.pad_axis(k, 1, skv_p), mg.pad_axis(v, 1, skv_p)
    o, lse = forward(qp, kp, vp, causal=causal, scale=scale, cfg=cfg, skv=skv,
                     offset=skv - sq, interpret=interpret)
    o, lse = o[:, :sq], lse[:, :, :sq]
    return (o, lse), (q, k, v, o, lse)


def _flash_bwd(causal, scale, fwd_cfg, bwd_cfg, interpret, res, cts):
    q, k, v, o, lse = res
    do, dlse = cts
    sq, skv = q.shape[1], k.shape[1]
    split = (q.shape[-1], v.shape[-1]) in SPLIT_DKDV
    cfg, sq_p, skv_p = _bwd_tiles(sq, skv, bwd_cfg, split)
    # delta = rowsum(dO * O) minus the LSE cotangent (d lse / d s = p). Rows that see no
    # key have LSE -inf; +inf makes their P exactly 0.
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    delta, lse2 = mg.pad_axis(delta, 2, sq_p), mg.pad_axis(lse2, 2, sq_p)
    qp, dop = mg.pad_axis(q, 1, sq_p), mg.pad_axis(do.astype(q.dtype), 1, sq_p)
    kp, vp = mg.pad_axis(k, 1, skv_p), mg.pad_axis(v, 1, skv_p)
    common = dict(causal=causal, scale=scale, cfg=cfg, offset=skv - sq, interpret=interpret)
    dq = dq_kernel(qp, kp, vp, dop, lse2, delta, skv=skv, **common)[:, :sq]
    if split:
        dk, dv = dkdv_split_kernel(qp, kp, vp, dop, lse2, delta, **common)
    else:
        dk, dv = dkdv_kernel(qp, kp, vp, dop, lse2, delta, **common)
    return dq, dk[:, :skv], dv[:, :skv]


_flash.defvjp(_flash_fwd, _flash_bwd)


def unsupported_reason(q, k, v) -> str | None:
    """None when the kernels can run these inputs, else why not (for `impl="auto"`)."""
    d, dv = q.shape[-1], v.shape[-1]
    if (d, dv) not in HEAD_DIMS:
        return (f"head_dim={d} with v_head_dim={dv} is not supported by pallas_mosaic; it "
                f"takes (head_dim, v_head_dim) in {HEAD_DIMS} (or use impl='pallas_triton')")
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"pallas_mosaic takes bfloat16 or float16 inputs; got {jnp.dtype(q.dtype)}"
    return None


_FWD_FIELDS = {f.name for f in dataclasses.fields(FwdConfig)}
_BWD_FIELDS = {f.name for f in dataclasses.fields(BwdConfig)}


def _configs(head_dim: int, v_head_dim: int, causal: bool,
             opts: dict) -> tuple[FwdConfig, BwdConfig]:
    """The configs the options ask for: `fwd=` / `bwd=` (default: the tuned ones for these
    head dims and mask), then any of their fields by name on top."""
    fwd = opts.pop("fwd", None) or default_fwd_config(head_dim, causal, v_head_dim)
    bwd = opts.pop("bwd", None) or default_bwd_config(head_dim, causal, v_head_dim)
    if not isinstance(fwd, FwdConfig) or not isinstance(bwd, BwdConfig):
        raise ValueError(f"fwd must be a flash_mosaic.FwdConfig and bwd a BwdConfig; got "
                         f"{type(fwd).__name__}, {type(bwd).__name__}")
    unknown = sorted(set(opts) - _FWD_FIELDS - _BWD_FIELDS)
    if unknown:
        raise ValueError(f"unknown pallas_mosaic options {unknown}; valid: fwd, bwd, "
                         f"{sorted(_FWD_FIELDS | _BWD_FIELDS)}")
    fwd = dataclasses.replace(fwd, **{n: v for n, v in opts.items() if n in _FWD_FIELDS})
    bwd = dataclasses.replace(bwd, **{n: v for n, v in opts.items() if n in _BWD_FIELDS})
    fwd_bytes = fwd_tile_bytes(fwd.block_q, fwd.block_kv, fwd.num_stages, head_dim,
                               dv=v_head_dim)
    if fwd_bytes > mg.SMEM_BUDGET:
        dims = f"head_dim={head_dim}" + ("" if v_head_dim == head_dim
                                         else f", v_head_dim={v_head_dim}")
        raise ValueError(f"the forward's tiles (Q: 2 x block_q={fwd.block_q} rows; K/V ring: "
                         f"num_stages={fwd.num_stages} x block_kv={fwd.block_kv} keys) take "
                         f"{fwd_bytes // 1024} KiB of shared memory at {dims}; "
                         f"a CTA has {mg.SMEM_BUDGET // 1024} KiB: lower block_kv or "
                         f"num_stages")
    return fwd, bwd


def flash_attention_with_lse(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                             interpret: bool | None = None, **kwargs):
    """(o [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq] float32, natural log); both
    differentiable. q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv].

    kwargs: `fwd=FwdConfig(...)`, `bwd=BwdConfig(...)` and/or any of their fields by
    name (e.g. block_kv=64), over the defaults for the head dim and mask.
    Rows that see no key (causal, Sq > Skv) give o = 0 and lse = -inf. `interpret`
    (default: on the CPU) runs the kernels in JAX's Mosaic GPU simulator.
    """
    if (q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]
            or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]):
        raise ValueError(f"expected q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv] "
                         f"with Hq % Hkv == 0; got q{q.shape} k{k.shape} v{v.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    why = unsupported_reason(q, k, v)
    if why:
        raise ValueError(why)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    fwd, bwd = _configs(q.shape[-1], v.shape[-1], bool(causal), dict(kwargs))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _flash(q, k, v, bool(causal), scale, fwd, bwd, bool(interpret))


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, **kwargs):
    """q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [.., Dv] -> [B, Sq, Hq, Dv]; see
    kernels.flash_attention."""
    return flash_attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale, **kwargs)[0]
