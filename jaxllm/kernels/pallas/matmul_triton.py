"""Skinny matmul for decoding: y [M, N] = x [M, K] @ w [K, N] with M <= 16, Triton lowering.

A decode step at batch 1 multiplies one activation row by each weight matrix, so its time
is the time to stream the weights from HBM. The grid covers N in column blocks and K in
`split_k` slices, enough programs to keep every SM streaming; each program walks its
slice of K in `block_k` steps, accumulating [16, block_n] in float32 on tensor cores
(the rows past M are zero). The split-K partial sums are added by a small jnp epilogue.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MAX_ROWS = 16  # tl.dot wants >= 16 rows; decode has 1..16 (batch x new tokens)


def _kernel(x_ref, w_ref, o_ref, *, k_steps: int, block_k: int):
    rows, block_n = o_ref.shape
    exact = x_ref.dtype == jnp.float32  # float32 inputs get float32 products

    def step(i, acc):
        x = x_ref[:, pl.ds(i * block_k, block_k)]
        w = w_ref[pl.ds(i * block_k, block_k), :]
        return acc + pltriton.dot(x, w, allow_tf32=not exact)

    acc = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((rows, block_n), jnp.float32))
    o_ref[...] = acc


def _pow2_split(k: int, want: int) -> int | None:
    """The smallest split >= want (or the largest below) with k / split a power of two."""
    options = [s for s in range(1, k + 1) if k % s == 0 and (k // s) & (k // s - 1) == 0
               and k // s >= 16]
    if not options:
        return None
    above = [s for s in options if s >= want]
    return min(above) if above else max(options)


def unsupported_reason(x, w, *_) -> str | None:
    m, k = x.shape
    if m > MAX_ROWS:
        return f"{m} rows: the skinny kernel takes at most {MAX_ROWS}"
    if w.shape[1] % 64:
        return f"N={w.shape[1]} is not a multiple of 64"
    if _pow2_split(k, 1) is None:
        return f"K={k} has no power-of-two slice >= 16"
    return None


def _sm_count() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 4


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "split_k", "num_warps",
                                             "num_stages", "interpret"))
def skinny_matmul(x, w, *, block_n: int | None = None, block_k: int = 64,
                  split_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
                  interpret: bool | None = None):
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype, float32 accumulation; M <= 16."""
    why = unsupported_reason(x, w)
    if why:
        raise ValueError(f"skinny_matmul: {why}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    m, k = x.shape
    n = w.shape[1]
    if block_n is None:
        block_n = 128 if n % 128 == 0 else 64
    n_blocks = n // block_n
    if split_k is None:  # ~3 programs per SM
        split_k = max(1, -(-3 * _sm_count() // n_blocks))
    split_k = _pow2_split(k, split_k)
    k_slice = k // split_k
    block_k = min(block_k, k_slice)
    xp = jnp.zeros((MAX_ROWS, k), x.dtype).at[:m].set(x)
    parts = pl.pallas_call(
        functools.partial(_kernel, k_steps=k_slice // block_k, block_k=block_k),
        grid=(n_blocks, split_k),
        in_specs=[pl.BlockSpec((MAX_ROWS, k_slice), lambda j, s: (0, s)),
                  pl.BlockSpec((k_slice, block_n), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((None, MAX_ROWS, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, MAX_ROWS, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"skinny_matmul_bn{block_n}_bk{block_k}_s{split_k}",
    )(xp, w.astype(x.dtype))
    return parts.sum(0)[:m].astype(x.dtype)
