"""Decode matmuls with their neighbours folded in: Pallas kernels, Triton lowering.

At batch 1 a decoder layer is four weight reads (q/k/v, output, gate/up, down) with a
dozen small elementwise steps between them: norms, RoPE, KV-cache writes, SwiGLU,
residual adds, each a kernel launch of its own under XLA. These kernels do the weight
read and fold the steps around it into the same program:

- prologue: RMSNorm of the input rows. rmsnorm(x) * scale @ W = (x * scale @ W) / rms(x),
  so each program multiplies the input tiles by the norm scale as it streams them, sums
  their squares on the way, and divides by the rms at the end (the input rows are a few
  kilobytes, read from L2 by every program);
- epilogue, one of
  - "none": plain product, plus an optional residual added in float32;
  - "glu": gate and up halves of one weight, out = silu(gate) * up (SwiGLU);
  - "qkv": the joined q/k/v projection: RoPE on the q and k heads, q returned, and the
    new k and v written straight into the layer's KV cache at each row's position.

Weights are out-major, [N, K] (each output's weights contiguous), so a program streams
whole rows of its weight block with wide loads, and no split over K is needed to fill the
GPU: one program per few outputs (gate/up pairs, rotary pairs; `GemvTuning`). With a
handful of input rows (batch x new tokens) the products run on CUDA cores in float32,
each program summing its partial products over K once at the end; with more, on tensor
cores (the rows padded to the 16 they want inside the program). Rows past the real ones
are never stored.

On CUDA cores every tile is two-dimensional and stays in the register layout of its load
(an input row [1, K step], a weight block [outputs, K step]): a product written as a 3-D
broadcast [rows, outputs, K step] makes Triton move each weight tile through shared memory
to a second layout, which is slower (docs/experiments.md).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MAX_ROWS = 16  # decode has 1..16 rows (batch x new tokens)
BLOCK_ROWS = 16  # outputs per program (per half for "glu" and "qkv") must divide by this
EPILOGUES = ("none", "glu", "qkv")


@dataclasses.dataclass(frozen=True)
class GemvTuning:
    """Launch settings of `decode_gemv`.

    Up to `fma_rows` rows the products run on CUDA cores: a program holds, per row,
    [fma_block_rows, K step] float32 partial products per weight block (at most
    `fma_elems` in all), sums over K once at the end, and loads `prefetch` steps ahead of
    its products. More rows use tensor cores (tl.dot, 16 padded rows, 16 outputs a
    program, K steps of `block_k`). num_warps, fma_block_rows, fma_elems and prefetch are
    one int, or a tuple of one per epilogue in the order of EPILOGUES.
    """
    block_k: int = 512
    num_warps: int | tuple[int, ...] = (8, 4, 4)
    num_stages: int = 3
    fma_rows: int = 4
    fma_block_rows: int | tuple[int, ...] = 2
    fma_elems: int | tuple[int, ...] = 8192
    prefetch: int | tuple[int, ...] = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, tuple) else (value,)
            low = 0 if f.name in ("fma_rows", "prefetch") else 1
            if isinstance(value, tuple) and len(value) != len(EPILOGUES):
                raise ValueError(f"GemvTuning.{f.name}={value}: give one int or one per "
                                 f"epilogue {EPILOGUES}")
            if not all(isinstance(v, int) and v >= low for v in values):
                raise ValueError(f"GemvTuning.{f.name}={value!r} must be ints >= {low}")

    def of(self, name: str, epilogue: str) -> int:
        """Setting `name` for `epilogue`."""
        value = getattr(self, name)
        return value[EPILOGUES.index(epilogue)] if isinstance(value, tuple) else value


DEFAULT = GemvTuning()


def _kernel(*refs, fma: bool, zeros: bool, **kw):
    pid = pl.program_id(0)
    if zeros:  # the last output: counters for the attention kernel after this one
        _store_zeros(refs[-1], pid)
        refs = refs[:-1]
    return (_main_fma if fma else _main)(*refs, pid=pid, **kw)


def _main(*refs, pid, m: int, k: int, block_k: int, eps: float | None, epilogue: str,
          has_residual: bool, half: int, q_len: int, q_heads: int, kv_heads: int,
          rows_pad: int, rb: int, **_):
    """Tensor-core products: the rows padded to `rows_pad` (16) inside the program."""
    x_ref, w_ref, g_ref, res_ref, outs = _refs(refs, eps, has_residual, epilogue)
    if epilogue == "qkv":
        pos_ref, freq_ref, q_ref, kc_ref, vc_ref = outs
    else:
        (o_ref,) = outs
    mp = rows_pad
    rows = jnp.arange(mp)
    row_ok = rows < m
    src_rows = jnp.minimum(rows, m - 1)  # padding rows repeat the last real one
    exact = x_ref.dtype == jnp.float32  # float32 inputs get float32 products

    def load_x(k0):
        r = jnp.broadcast_to(src_rows[:, None], (mp, block_k))
        c = jnp.broadcast_to(k0 + jnp.arange(block_k)[None, :], (mp, block_k))
        return pltriton.load(x_ref.at[r, c])

    k_steps = k // block_k
    starts, pair = _weight_starts(pid, epilogue, half, rb)
    if pair is not None:
        p, c = pair

    def step(i, carry):  # Triton pipelines the loads that feed tl.dot itself (num_stages)
        accs, ss = carry
        k0 = i * block_k
        x = load_x(k0)
        if eps is not None:  # RMSNorm: products of x * scale; 1 / rms(x) applied at the end
            x32 = x.astype(jnp.float32)
            ss = ss + (x32 * x32).sum(axis=1)
            x = x32 * g_ref[0, pl.ds(k0, block_k)].astype(jnp.float32)[None, :]
        ws = (w_ref[pl.ds(s, rb), pl.ds(k0, block_k)] for s in starts)
        return tuple(acc + pltriton.dot(x.astype(x_ref.dtype), w, trans_b=True,
                                        allow_tf32=not exact)
                     for acc, w in zip(accs, ws)), ss

    init = (tuple(jnp.zeros((mp, rb), jnp.float32) for _ in starts),
            jnp.zeros((mp,), jnp.float32))
    accs, ss = jax.lax.fori_loop(0, k_steps, step, init)
    if eps is not None:
        inv_rms = jax.lax.rsqrt(ss / k + eps)
        accs = tuple(acc * inv_rms[:, None] for acc in accs)
    # stores index the real row numbers, masked (clamped ones would alias the last row)
    r2 = jnp.broadcast_to(rows[:, None], (mp, rb))
    ok2 = jnp.broadcast_to(row_ok[:, None], (mp, rb))
    j = jnp.arange(rb)

    if epilogue == "none":
        y = accs[0]
        cols = jnp.broadcast_to((pid * rb + j)[None, :], (mp, rb))
        if has_residual:
            src = jnp.broadcast_to(src_rows[:, None], (mp, rb))
            y = y + pltriton.load(res_ref.at[src, cols]).astype(jnp.float32)
        pltriton.store(o_ref.at[r2, cols], y.astype(o_ref.dtype), mask=ok2)
    elif epilogue == "glu":
        y = _swiglu(*accs)
        cols = jnp.broadcast_to((c * rb + j)[None, :], (mp, rb))
        pltriton.store(o_ref.at[r2, cols], y.astype(o_ref.dtype), mask=ok2)
    else:  # "qkv": head p; rotary pairs (c*rb + j, half + c*rb + j) of its head_dim
        pos = pltriton.load(pos_ref.at[src_rows])  # [rows]
        angle = pos.astype(jnp.float32)[:, None] * freq_ref[pl.ds(c * rb, rb)][None, :]
        a, b, is_q, hq, is_k, is_v, hkv = _qkv_head(*accs, angle, p, q_heads, kv_heads)
        d_a = jnp.broadcast_to((c * rb + j)[None, :], (mp, rb))
        d_b = d_a + half
        qh = jnp.full((mp, rb), hq, jnp.int32)  # q [M, Hq, D]
        pltriton.store(q_ref.at[r2, qh, d_a], a.astype(q_ref.dtype), mask=ok2 & is_q)
        pltriton.store(q_ref.at[r2, qh, d_b], b.astype(q_ref.dtype), mask=ok2 & is_q)
        # the cache [B, Hkv, T, D] of k (heads q_heads..) or v (the last kv_heads)
        bi = r2 // q_len
        hh = jnp.full((mp, rb), hkv, jnp.int32)
        tt = jnp.broadcast_to(pos[:, None], (mp, rb))
        for ref, sel in ((kc_ref, is_k), (vc_ref, is_v)):
            pltriton.store(ref.at[bi, hh, tt, d_a], a.astype(ref.dtype), mask=ok2 & sel)
            pltriton.store(ref.at[bi, hh, tt, d_b], b.astype(ref.dtype), mask=ok2 & sel)


def _refs(refs, eps, has_residual, epilogue):
    """(x, w, norm scale or None, residual or None, the epilogue's refs)."""
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    g_ref = refs.pop(0) if eps is not None else None
    res_ref = refs.pop(0) if has_residual else None
    if epilogue == "qkv":
        pos_ref, freq_ref, _, _, q_ref, kc_ref, vc_ref = refs
        return x_ref, w_ref, g_ref, res_ref, (pos_ref, freq_ref, q_ref, kc_ref, vc_ref)
    return x_ref, w_ref, g_ref, res_ref, tuple(refs)


def _store_zeros(z_ref, pid):
    """Program 0 fills the int32 counters output with zeros (see decode_gemv's `zeros`)."""
    n = z_ref.shape[0]
    i = jnp.arange(1 << (n - 1).bit_length())

    @pl.when(pid == 0)
    def _():
        pltriton.store(z_ref.at[i], jnp.zeros(i.shape, jnp.int32), mask=i < n)


def _weight_starts(pid, epilogue: str, half: int, rb: int):
    """First weight row of each block this program reads (one, or one per half of a pair),
    and for pairs the (pair group / head, block within the half)."""
    if epilogue == "none":
        return (pid * rb,), None
    per_pair = half // rb
    p, c = pid // per_pair, pid % per_pair
    first = p * 2 * half + c * rb
    return (first, first + half), (p, c)


def _swiglu(gate, up):
    return gate / (1.0 + jnp.exp(-gate)) * up  # silu(gate) * up


def _qkv_head(a, b, angle, p, q_heads: int, kv_heads: int):
    """Rows (a, b) of head p of the joined q/k/v weight at rotary angles `angle`: RoPE on
    the q and k heads (v is stored as it is), and where they go: (a, b, is_q, q head,
    is_k, is_v, kv head)."""
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    rotate = p < q_heads + kv_heads
    a, b = jnp.where(rotate, a * cos - b * sin, a), jnp.where(rotate, b * cos + a * sin, b)
    is_k = (p >= q_heads) & (p < q_heads + kv_heads)
    hkv = jnp.clip(jnp.where(is_k, p - q_heads, p - q_heads - kv_heads), 0, kv_heads - 1)
    return (a, b, p < q_heads, jnp.minimum(p, q_heads - 1), is_k, p >= q_heads + kv_heads,
            hkv)


def _main_fma(*refs, pid, m: int, k: int, block_k: int, eps: float | None, epilogue: str,
              has_residual: bool, half: int, q_len: int, q_heads: int, kv_heads: int,
              rb: int, prefetch: int, **_):
    """CUDA-core products for a few rows (m static): every tile is 2-D, [1 or rb, block_k]
    in the layout of its load (so no layout conversion through shared memory), each row r
    accumulating x[r] * w over K in float32 and summing over K once at the end."""
    x_ref, w_ref, g_ref, res_ref, outs = _refs(refs, eps, has_residual, epilogue)
    k_steps = k // block_k
    starts, pair = _weight_starts(pid, epilogue, half, rb)
    f32 = jnp.float32

    def load(i):
        k0 = i * block_k
        xs = tuple(x_ref[pl.ds(r, 1), pl.ds(k0, block_k)] for r in range(m))
        g = g_ref[pl.ds(0, 1), pl.ds(k0, block_k)] if eps is not None else None
        ws = tuple(w_ref[pl.ds(s, rb), pl.ds(k0, block_k)] for s in starts)
        return xs, g, ws

    def fma(carry, tiles):
        accs, sqs = carry  # per row: per weight block [rb, block_k]; [1, block_k] squares
        xs, g, ws = tiles
        new_accs, new_sqs = [], []
        for r in range(m):
            x = xs[r].astype(f32)
            if eps is not None:  # RMSNorm: x * scale here, 1 / rms(x) at the end
                new_sqs.append(sqs[r] + x * x)
                x = x * g.astype(f32)
            new_accs.append(tuple(a + x * w.astype(f32) for a, w in zip(accs[r], ws)))
        return tuple(new_accs), tuple(new_sqs)

    carry = (tuple(tuple(jnp.zeros((rb, block_k), f32) for _ in starts) for _ in range(m)),
             tuple(jnp.zeros((1, block_k), f32) for _ in range(m)) if eps is not None else ())
    ahead = min(prefetch, k_steps)  # steps loaded before their products
    if ahead == 0:
        carry = jax.lax.fori_loop(0, k_steps, lambda i, c: fma(c, load(i)), carry)
    else:
        def step(i, c):
            carry, queue = c
            return fma(carry, queue[0]), queue[1:] + (load(i + ahead),)

        carry, queue = jax.lax.fori_loop(0, k_steps - ahead, step,
                                         (carry, tuple(load(i) for i in range(ahead))))
        for tiles in queue:  # the last steps: nothing left to load
            carry = fma(carry, tiles)
    accs, sqs = carry
    j = jnp.arange(rb)
    for r in range(m):
        vals = [a.sum(axis=1) for a in accs[r]]  # [rb] each
        if eps is not None:
            inv_rms = jax.lax.rsqrt(sqs[r].sum() / k + eps)
            vals = [v * inv_rms for v in vals]
        if epilogue == "none":
            (o_ref,) = outs
            y = vals[0]
            if has_residual:
                y = y + res_ref[r, pl.ds(pid * rb, rb)].astype(f32)
            o_ref[r, pl.ds(pid * rb, rb)] = y.astype(o_ref.dtype)
            continue
        p, c = pair
        if epilogue == "glu":
            (o_ref,) = outs
            o_ref[r, pl.ds(c * rb, rb)] = _swiglu(*vals).astype(o_ref.dtype)
            continue
        # "qkv": head p; rotary pairs (c*rb + j, half + c*rb + j) of its head_dim
        pos_ref, freq_ref, q_ref, kc_ref, vc_ref = outs
        pos = pos_ref[r]
        angle = pos.astype(f32) * freq_ref[pl.ds(c * rb, rb)]
        a, b, is_q, hq, is_k, is_v, hkv = _qkv_head(*vals, angle, p, q_heads, kv_heads)
        d_a, d_b = c * rb + j, half + c * rb + j
        is_q = jnp.broadcast_to(is_q, (rb,))
        pltriton.store(q_ref.at[r, hq, d_a], a.astype(q_ref.dtype), mask=is_q)
        pltriton.store(q_ref.at[r, hq, d_b], b.astype(q_ref.dtype), mask=is_q)
        for ref, sel in ((kc_ref, is_k), (vc_ref, is_v)):
            sel = jnp.broadcast_to(sel, (rb,))
            pltriton.store(ref.at[r // q_len, hkv, pos, d_a], a.astype(ref.dtype), mask=sel)
            pltriton.store(ref.at[r // q_len, hkv, pos, d_b], b.astype(ref.dtype), mask=sel)


def _block_k(k: int, most: int = 512) -> int | None:
    """The largest power of two <= `most` dividing K, at least 16."""
    bk = 1 << (max(most, 1).bit_length() - 1)
    while bk >= 16 and k % bk:
        bk //= 2
    return bk if bk >= 16 else None


def unsupported_reason(x, w, epilogue: str = "none") -> str | None:
    """Why the kernel cannot take x [M, K] and out-major w (None if it can)."""
    m, k = x.shape
    if m > MAX_ROWS:
        return f"{m} rows: the decode kernels take at most {MAX_ROWS}"
    if w.shape[-1] != k:
        return f"weight {w.shape} does not contract K={k} on its last axis"
    if _block_k(k) is None:
        return f"K={k} is not a multiple of 16"
    outputs = w.shape[-2]  # N, R (glu) or D (qkv)
    per_block = outputs // 2 if epilogue == "qkv" else outputs
    if per_block % BLOCK_ROWS:
        return (f"{'head_dim / 2' if epilogue == 'qkv' else 'the output size'} = {per_block} "
                f"is not a multiple of {BLOCK_ROWS}")
    return None


@functools.partial(jax.jit, static_argnames=("epilogue", "eps", "q_len", "q_heads", "zeros",
                                             "tuning", "interpret"))
def decode_gemv(x, w, *, norm_scale=None, eps: float | None = None, residual=None,
                epilogue: str = "none", positions=None, inv_freq=None, q_len: int = 1,
                q_heads: int = 0, k_cache=None, v_cache=None, zeros: int = 0,
                tuning: GemvTuning = DEFAULT, interpret: bool | None = None):
    """out = epilogue(prologue(x) @ w^T) for x [M, K] with M <= 16, in x's dtype.

    prologue: with `norm_scale` [K] (and `eps`), x becomes rmsnorm(x) * norm_scale (as
    `model.layers.RMSNorm`; float32 here, where RMSNorm rounds its output to x's dtype).
    epilogue:
      "none": w [N, K] -> [M, N], plus `residual` [M, N] if given;
      "glu":  w [2, R, K] (gate, up) -> silu(x w[0]^T) * (x w[1]^T), [M, R];
      "qkv":  w [Hq + 2 Hkv, D, K] -> (q [M, Hq, D], k_cache, v_cache): rotary embedding
              (half-split) at `positions` [M] with `inv_freq` [D/2] on the q and k heads;
              row m = b * q_len + s is token s of cache row b, whose k and v are written
              into k_cache / v_cache [B, Hkv, T, D] at position positions[m] (in place
              inside a jitted step whose caches are not used again, as in a decode loop);
              with `zeros` = n > 0 also an int32 [n] of zeros (written by one program:
              the split counters of the decode-attention kernel that follows, without a
              fill kernel of their own).
    tuning: the launch settings (`GemvTuning`); interpret: default on the CPU.
    """
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r}; choose one of {EPILOGUES}")
    if not isinstance(tuning, GemvTuning):
        raise ValueError(f"tuning must be a gemv_triton.GemvTuning; got {type(tuning).__name__}")
    why = unsupported_reason(x, w, epilogue)
    if why:
        raise ValueError(f"decode_gemv: {why}")
    if (norm_scale is None) != (eps is None):
        raise ValueError("decode_gemv: the norm prologue needs both norm_scale and eps")
    if zeros and epilogue != "qkv":
        raise ValueError(f"decode_gemv: zeros go with epilogue 'qkv', not {epilogue!r}")
    if residual is not None and epilogue != "none":
        raise ValueError(f"decode_gemv: a residual goes with epilogue 'none', not {epilogue!r}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    m, k = x.shape
    fma = m <= tuning.fma_rows
    rb = tuning.of("fma_block_rows", epilogue) if fma else BLOCK_ROWS
    n_acc = 1 if epilogue == "none" else 2
    most = tuning.of("fma_elems", epilogue) // (m * rb * n_acc) if fma else tuning.block_k
    block_k = _block_k(k, max(16, most))
    num_warps = tuning.of("num_warps", epilogue)
    half, kv_heads = 0, 0
    if epilogue == "none":
        n_out = w.shape[0]
        grid = n_out // rb
        out_shape = jax.ShapeDtypeStruct((m, n_out), x.dtype)
    elif epilogue == "glu":
        if w.ndim != 3 or w.shape[0] != 2:
            raise ValueError(f"decode_gemv: a glu weight is [2, R, K], got {w.shape}")
        half = w.shape[1]
        grid = half // rb
        out_shape = jax.ShapeDtypeStruct((m, half), x.dtype)
    else:
        heads, head_dim = w.shape[0], w.shape[1]
        kv_heads = (heads - q_heads) // 2
        if q_heads <= 0 or kv_heads <= 0 or q_heads + 2 * kv_heads != heads:
            raise ValueError(f"decode_gemv: a qkv weight of {heads} heads does not split into "
                             f"q_heads={q_heads} and two equal k and v parts")
        if k_cache is None or v_cache is None or positions is None or inv_freq is None:
            raise ValueError("decode_gemv: epilogue 'qkv' needs positions, inv_freq, k_cache "
                             "and v_cache")
        if k_cache.shape[1] != kv_heads or k_cache.shape[3] != head_dim or m % q_len or \
                k_cache.shape[0] != m // q_len:
            raise ValueError(f"decode_gemv: cache {k_cache.shape} does not match {m} rows of "
                             f"{q_len} tokens, {kv_heads} kv heads of {head_dim}")
        half = head_dim // 2
        grid = heads * (half // rb)
        out_shape = (jax.ShapeDtypeStruct((m, q_heads, head_dim), x.dtype),
                     jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                     jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
        if zeros:
            out_shape += (jax.ShapeDtypeStruct((zeros,), jnp.int32),)

    args = [x, w.reshape(-1, k).astype(x.dtype)]
    if eps is not None:
        args.append(norm_scale.reshape(1, k))
    if residual is not None:
        args.append(residual)
    aliases = {}
    if epilogue == "qkv":
        args += [positions.reshape(m).astype(jnp.int32), inv_freq.astype(jnp.float32),
                 k_cache, v_cache]
        aliases = {len(args) - 2: 1, len(args) - 1: 2}
    n_out = len(out_shape) if isinstance(out_shape, tuple) else 1
    kernel = functools.partial(
        _kernel, m=m, k=k, block_k=block_k, eps=eps, epilogue=epilogue,
        has_residual=residual is not None, half=half, q_len=q_len, q_heads=q_heads,
        kv_heads=kv_heads, rows_pad=MAX_ROWS, rb=rb, fma=fma, zeros=bool(zeros),
        prefetch=tuning.of("prefetch", epilogue))
    return pl.pallas_call(
        kernel,
        grid=(grid,),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.no_block_spec if n_out == 1 else (pl.no_block_spec,) * n_out,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps,
                                                 num_stages=tuning.num_stages),
        interpret=interpret,
        name=(f"decode_gemv_{epilogue}{'_norm' if eps is not None else ''}"
              f"_{'fma' if fma else 'dot'}_bk{block_k}"),
    )(*args)
