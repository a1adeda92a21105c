"""FlashAttention (FA2) in Pallas with the Triton lowering: forward, LSE and backward.

q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv] (Dv may differ from D: MLA's
192-dim queries and keys with 128-dim values). Each program owns one tile of queries (forward,
dq) or of keys (dk/dv) and streams the other side through on-chip memory:

  forward   grid (Sq/bq, B, Hq): S = Q K^T tile by tile with an online softmax (running
            max m and sum l in float32, the accumulator rescaled by exp(m_old - m_new));
            writes O and LSE = m + log(l) only. S and P never reach HBM.
  dk, dv    grid (Skv/bk, B, Hkv): loops over every query head of the GQA group and every
            query tile, recomputing P = exp(S - LSE); dV += P^T dO, dK += dS^T Q with
            dS = P * (dO V^T - delta), delta = rowsum(dO * O). The group's sum stays in
            registers, so K/V are never repeated and dk/dv need no reduction afterwards.
  dq        grid (Sq/bq, B, Hq): loops over key tiles, dQ += dS K.

Exponentials are base 2 (scores are pre-multiplied by log2(e)). Causal attention is
bottom-right aligned (query i sees keys j <= i + Skv - Sq): tiles above the diagonal are
skipped, tiles below it run without a mask, and only tiles crossing the diagonal (or the
key tail) pay for one. Sequence lengths need not be block multiples: inputs are padded
to whole tiles here and the padded keys are masked inside the kernel. A query row that
sees no key at all (causal with Sq > Skv) gets output 0 and LSE -inf.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_BLOCK = 16  # the smallest tile Triton's dot accepts


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the three kernels (powers of two, >= 16)."""
    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_q_dkv: int = 32
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 32
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name.startswith("block") and (val < MIN_BLOCK or val & (val - 1)):
                raise ValueError(f"{f.name}={val} must be a power of two >= {MIN_BLOCK}")
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{f.name}={val!r} must be a positive int")


# The fastest tiles measured on the H200 (docs/performance.md), keyed by the bytes of one
# tile row in 2-byte units: the padded head dim for bf16/f16, twice it for f32, whose
# tiles must shrink to fit shared memory. Other devices use the same table.
_TUNED = {
    64: BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=3,
                   block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
                   num_warps_bwd=4, num_stages_bwd=2),
    128: BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=3,
                    block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
                    num_warps_bwd=4, num_stages_bwd=2),
    256: BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=2,
                    block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32,
                    num_warps_bwd=4, num_stages_bwd=2),
    512: BlockSizes(block_q=32, block_k=32, num_warps=4, num_stages=2,  # f32, head dim 256
                    block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16,
                    num_warps_bwd=4, num_stages_bwd=1),
}


def default_block_sizes(head_dim: int, itemsize: int = 2) -> BlockSizes:
    """The tuned tile sizes for a (padded, power-of-two) head dim and input item size."""
    row = head_dim * max(itemsize, 2) // 2
    return _TUNED[min(_TUNED, key=lambda d: (d < row, abs(d - row)))]


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _cdiv_nonneg(x, m: int):
    """ceil(max(x, 0) / m) for an int32 scalar x (lax.div truncates, so keep x >= 0)."""
    return lax.div(jnp.maximum(x, 0) + (m - 1), m)


def _floordiv_nonneg(x, m: int):
    return lax.div(jnp.maximum(x, 0), m)


def _mm(a, b, dims):
    # float32 inputs get full-precision (IEEE) products; Triton may otherwise use TF32.
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (dims, ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """a [m, k] @ b[n, k]^T in float32."""
    return _mm(a, b, ((1,), (1,)))


def _dot_tn(a, b):
    """a[k, m]^T @ b [k, n] in float32."""
    return _mm(a, b, ((0,), (0,)))


def _dot(a, b):
    return _mm(a, b, ((1,), (0,)))


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, causal, bq, bk, skv, offset,
                n_q, n_kv):
    i = pl.program_id(0)
    if causal:  # heaviest query tiles first: better load balance at the end of the grid
        i = n_q - 1 - i
    q = q_ref[...]  # (bq, D)
    qk_scale = scale * LOG2E
    rows = i * bq + jnp.arange(bq)

    def step(j, carry, masked):
        acc, m, l = carry
        k = k_ref[pl.ds(j * bk, bk), :]  # (bk, D)
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _dot_nt(q, k) * qk_scale  # (bq, bk), log2 units
        if masked:
            cols = j * bk + jnp.arange(bk)
            ok = cols[None, :] < skv
            if causal:
                ok = ok & (cols[None, :] <= rows[:, None] + offset)
            s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        # A row with every key masked so far keeps m = -inf; shift by 0 to avoid inf - inf.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    if causal:
        # Key tiles [0, n_full) are fully visible to every row of this query tile;
        # [n_full, hi) cross the diagonal or the key tail; tiles from hi on are invisible.
        hi = jnp.minimum(_cdiv_nonneg((i + 1) * bq + offset, bk), n_kv)
        n_full = jnp.minimum(_floordiv_nonneg(i * bq + offset + 1, bk), min(skv // bk, n_kv))
        n_full = jnp.minimum(n_full, hi)
    else:
        hi, n_full = n_kv, skv // bk
    carry = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),
             jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, hi, functools.partial(step, masked=True), carry)
    empty = l == 0.0
    o = acc * (1.0 / jnp.where(empty, 1.0, l))[:, None]
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)


def _forward(q, k, v, *, causal, scale, bs: BlockSizes, interpret):
    b, sq, hq, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    bq = min(bs.block_q, max(MIN_BLOCK, _next_pow2(sq)))
    bk = min(bs.block_k, max(MIN_BLOCK, _next_pow2(skv)))
    sq_p, skv_p = _round_up(sq, bq), _round_up(skv, bk)
    qp = _pad_axis(q, 1, sq_p)
    kp, vp = _pad_axis(k, 1, skv_p), _pad_axis(v, 1, skv_p)
    nq, n_kv = sq_p // bq, skv_p // bk
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, bq=bq, bk=bk,
                               skv=skv, offset=skv - sq, n_q=nq, n_kv=n_kv)
    # the kernel walks causal query tiles in reverse; the output specs must agree
    q_map = (lambda i, bi, h: (bi, nq - 1 - i, h, 0)) if causal else (
        lambda i, bi, h: (bi, i, h, 0))
    q_spec, o_spec = (pl.BlockSpec((None, bq, None, n), q_map) for n in (d, dv))
    k_spec, v_spec = (pl.BlockSpec((None, skv_p, None, n),
                                   lambda i, bi, h: (bi, 0, lax.div(h, g), 0)) for n in (d, dv))
    lse_map = (lambda i, bi, h: (bi, h, nq - 1 - i)) if causal else (lambda i, bi, h: (bi, h, i))
    o, lse = pl.pallas_call(
        kernel,
        grid=(nq, b, hq),
        in_specs=[q_spec, k_spec, v_spec],
        out_specs=[o_spec, pl.BlockSpec((None, None, bq), lse_map)],
        out_shape=[jax.ShapeDtypeStruct((b, sq_p, hq, dv), q.dtype),
                   jax.ShapeDtypeStruct((b, hq, sq_p), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps,
                                                num_stages=bs.num_stages),
        interpret=interpret,
        name="flash_fwd",
    )(qp, kp, vp)
    return o[:, :sq], lse[:, :, :sq]


# ----------------------------------------------------------------------------- backward


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 scale, causal, bq, bk, offset, n_q, group):
    j = pl.program_id(0)
    k = k_ref[...]  # (bk, D)
    v = v_ref[...]
    cols = j * bk + jnp.arange(bk)
    qk_scale = scale * LOG2E

    def step(t, carry, gi, masked):
        dk, dv = carry
        rows = pl.ds(t * bq, bq)
        q = q_ref[rows, gi, :]  # (bq, D)
        do = do_ref[rows, gi, :]
        lse = lse_ref[gi, rows]  # (bq,) log2 units; +inf for rows that see no key
        delta = delta_ref[gi, rows]
        s = _dot_nt(q, k) * qk_scale  # (bq, bk)
        if masked:
            r = t * bq + jnp.arange(bq)
            s = jnp.where(cols[None, :] <= r[:, None] + offset, s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])
        dv = dv + _dot_tn(p.astype(do.dtype), do)
        ds = p * (_dot_nt(do, v) - delta[:, None])
        dk = dk + _dot_tn(ds.astype(q.dtype), q)
        return dk, dv

    if causal:
        # Rows r see this key tile iff r >= cols - offset: tiles before `lo` see none of it,
        # tiles from `first_full` on see all of it.
        lo = jnp.minimum(_floordiv_nonneg(j * bk - offset, bq), n_q)
        first_full = _clip(_cdiv_nonneg((j + 1) * bk - 1 - offset, bq), lo, n_q)
    else:
        lo, first_full = 0, 0

    def head(gi, carry):
        carry = lax.fori_loop(lo, first_full, functools.partial(step, gi=gi, masked=True), carry)
        return lax.fori_loop(first_full, n_q, functools.partial(step, gi=gi, masked=False), carry)

    dk, dv = lax.fori_loop(0, group, head, (jnp.zeros(k.shape, jnp.float32),
                                            jnp.zeros(v.shape, jnp.float32)))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, causal, bq,
               bk, offset, n_q, n_kv):
    i = pl.program_id(0)
    if causal:
        i = n_q - 1 - i
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    rows = i * bq + jnp.arange(bq)
    qk_scale = scale * LOG2E

    def step(j, dq, masked):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _dot_nt(q, k) * qk_scale
        if masked:
            cols = j * bk + jnp.arange(bk)
            s = jnp.where(cols[None, :] <= rows[:, None] + offset, s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (_dot_nt(do, v) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    if causal:
        hi = jnp.minimum(_cdiv_nonneg((i + 1) * bq + offset, bk), n_kv)
        n_full = jnp.minimum(_floordiv_nonneg(i * bq + offset + 1, bk), hi)
    else:
        hi, n_full = n_kv, n_kv
    dq = jnp.zeros(q.shape, jnp.float32)
    dq = lax.fori_loop(0, n_full, functools.partial(step, masked=False), dq)
    dq = lax.fori_loop(n_full, hi, functools.partial(step, masked=True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _backward(q, k, v, o, lse, do, dlse, *, causal, scale, bs: BlockSizes, interpret):
    b, sq, hq, d = q.shape
    skv, hkv, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    cap_q, cap_k = max(MIN_BLOCK, _next_pow2(sq)), max(MIN_BLOCK, _next_pow2(skv))
    bq1, bk1 = min(bs.block_q_dkv, cap_q), min(bs.block_k_dkv, cap_k)
    bq2, bk2 = min(bs.block_q_dq, cap_q), min(bs.block_k_dq, cap_k)
    sq_p, skv_p = _round_up(sq, max(bq1, bq2)), _round_up(skv, max(bk1, bk2))

    # delta = rowsum(dO * O) (minus the LSE cotangent: d lse / d s = p). Rows that see no
    # key have LSE -inf; +inf makes their P exactly 0. Padded rows have dO = 0 and padded
    # keys have K = V = 0, so neither adds to a gradient we keep: no tail masks needed.
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
    delta = delta - dlse
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
    delta, lse2 = _pad_axis(delta, 2, sq_p), _pad_axis(lse2, 2, sq_p)
    qp, dop = _pad_axis(q, 1, sq_p), _pad_axis(do.astype(q.dtype), 1, sq_p)
    kp, vp = _pad_axis(k, 1, skv_p), _pad_axis(v, 1, skv_p)
    params = pltriton.CompilerParams(num_warps=bs.num_warps_bwd, num_stages=bs.num_stages_bwd)
    offset = skv - sq

    # dk, dv: one program per (key tile, batch, kv head); the GQA group is looped inside.
    n_q1 = sq_p // bq1
    grp_q, grp_do = (pl.BlockSpec((None, sq_p, g, n), lambda j, bi, h: (bi, 0, h, 0))
                     for n in (d, d_v))
    grp_row = pl.BlockSpec((None, g, sq_p), lambda j, bi, h: (bi, h, 0))
    k_tile, v_tile = (pl.BlockSpec((None, bk1, None, n), lambda j, bi, h: (bi, j, h, 0))
                      for n in (d, d_v))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, scale=scale, causal=causal, bq=bq1, bk=bk1,
                          offset=offset, n_q=n_q1, group=g),
        grid=(skv_p // bk1, b, hkv),
        in_specs=[grp_q, k_tile, v_tile, grp_do, grp_row, grp_row],
        out_specs=[k_tile, v_tile],
        out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype),
                   jax.ShapeDtypeStruct(vp.shape, v.dtype)],
        compiler_params=params,
        interpret=interpret,
        name="flash_bwd_dkdv",
    )(qp, kp, vp, dop, lse2, delta)

    # dq: one program per (query tile, batch, q head).
    nq2 = sq_p // bq2
    tile_of = (lambda i: nq2 - 1 - i) if causal else (lambda i: i)
    q_tile, do_tile = (pl.BlockSpec((None, bq2, None, n),
                                    lambda i, bi, h: (bi, tile_of(i), h, 0)) for n in (d, d_v))
    row_tile = pl.BlockSpec((None, None, bq2), lambda i, bi, h: (bi, h, tile_of(i)))
    k_full, v_full = (pl.BlockSpec((None, skv_p, None, n),
                                   lambda i, bi, h: (bi, 0, lax.div(h, g), 0)) for n in (d, d_v))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, causal=causal, bq=bq2, bk=bk2,
                          offset=offset, n_q=nq2, n_kv=skv_p // bk2),
        grid=(nq2, b, hq),
        in_specs=[q_tile, k_full, v_full, do_tile, row_tile, row_tile],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="flash_bwd_dq",
    )(qp, kp, vp, dop, lse2, delta)
    return dq[:, :sq], dk[:, :skv], dv[:, :skv]


# ----------------------------------------------------------------------------- public API


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _flash(q, k, v, causal, scale, bs, interpret):
    return _forward(q, k, v, causal=causal, scale=scale, bs=bs, interpret=interpret)


def _flash_fwd(q, k, v, causal, scale, bs, interpret):
    o, lse = _forward(q, k, v, causal=causal, scale=scale, bs=bs, interpret=interpret)
    return (o, lse), (q, k, v, o, lse)


def _flash_bwd(causal, scale, bs, interpret, res, cts):
    q, k, v, o, lse = res
    do, dlse = cts
    return _backward(q, k, v, o, lse, do, dlse, causal=causal, scale=scale, bs=bs,
                     interpret=interpret)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _block_sizes(head_dim: int, itemsize: int, kwargs: dict) -> BlockSizes:
    bs = kwargs.pop("block_sizes", None) or default_block_sizes(head_dim, itemsize)
    if not isinstance(bs, BlockSizes):
        raise ValueError(f"block_sizes must be a flash_triton.BlockSizes; got {type(bs).__name__}")
    names = {f.name for f in dataclasses.fields(BlockSizes)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown pallas_triton options {unknown}; valid: "
                         f"block_sizes, {sorted(names)}")
    return dataclasses.replace(bs, **kwargs)


def unsupported_reason(q, k, v) -> str | None:
    """None when the kernels can run these inputs, else why not (for `impl="auto"`)."""
    for name, d in (("head_dim", q.shape[-1]), ("v_head_dim", v.shape[-1])):
        if d > 256:
            return f"{name}={d} is not supported by pallas_triton (at most 256)"
    return None


def flash_attention_with_lse(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                             interpret: bool | None = None, **kwargs):
    """(o [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq] float32, natural log); both differentiable.

    kwargs: `block_sizes=BlockSizes(...)` and/or any of its fields (e.g. block_q=64).
    Rows that see no key (causal, Sq > Skv) give o = 0 and lse = -inf.
    """
    why = unsupported_reason(q, k, v)
    if why:
        raise ValueError(why)
    d, dv = q.shape[-1], v.shape[-1]
    if (q.ndim != 4 or k.shape[:3] != v.shape[:3] or k.shape[3] != d
            or q.shape[2] % k.shape[2]):
        raise ValueError(f"expected q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv] "
                         f"with Hq % Hkv == 0; got q{q.shape} k{k.shape} v{v.shape}")
    scale = d**-0.5 if sm_scale is None else float(sm_scale)
    d_p, dv_p = (max(MIN_BLOCK, _next_pow2(n)) for n in (d, dv))
    bs = _block_sizes(max(d_p, dv_p), q.dtype.itemsize, dict(kwargs))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    # zero-padded head dims change neither scores nor the kept outputs
    q, k, v = _pad_axis(q, 3, d_p), _pad_axis(k, 3, d_p), _pad_axis(v, 3, dv_p)
    o, lse = _flash(q, k, v, bool(causal), scale, bs, bool(interpret))
    return o[..., :dv], lse


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, **kwargs):
    """q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [.., Dv] -> [B, Sq, Hq, Dv]; see
    kernels.flash_attention."""
    return flash_attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale, **kwargs)[0]
