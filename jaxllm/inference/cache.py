"""KV caches of the decode program: one protocol, a contiguous and a paged implementation.

The protocol, as `inference/step.py` uses it (layer: a Python int, layers unrolled):
    cache = cache.write(layer, k, v, positions)   # k/v (B, S, Hkv, D) at positions (B, S)
    o = cache.attend(layer, q, positions, ...)    # q (B, S, Hq, D) over the cached keys
Writes are indexed by position, so entries past a row's true length (padding, rejected
speculative drafts) are overwritten later and never read: attention masks keys after the
query.

`ContiguousCache`: per layer k, v [B, Hkv, max_len, D] (each (row, head) one contiguous
[max_len, D] matrix, the layout a batched matmul reads without a transpose).

`PagedCache`: pools k, v [L, Hkv, num_pages, page_size, D] (layer l is `k[l]`, the layout
`kernels.paged_attention` reads in place) and the batch's block tables. A sequence owns a
list of pages and a length; token t lives in page `table[t // page_size]` at offset
`t % page_size`. `PageAllocator` (inference/pages.py, re-exported here) is the host
bookkeeping (refcounts, forks with copy-on-write of a shared, partly filled last page,
`OutOfPagesError` before anything changes); `PagePool` ties the pool arrays to it for eager
use; `token_slots`, `write_kv`, `write_layer` and `copy_pages` are the pure device
functions.

`LatentCache`: multi-head latent attention (model.attention mla) caches one latent per token
and layer instead of per-head K/V: c [B, max_len, kv_lora_rank + qk_rope_head_dim], the
normed key-value latent and the shared rotary key. `write(layer, latent, None, positions)`
stores it; `attend` is multi-query attention of the absorbed queries over it, the latent
serving as the key and its first kv_lora_rank values as the value; one new token a row
(decoding) runs `kernels.mla_decode` on it as a paged cache of pages of 64 latent rows with
identity block tables.

`RaggedLatentCache`: the serving engine's latent pool [L, P, page, rank + rope] (one array
per layer stack, pages of latent rows under the same page allocator, block tables and
prefix cache as the K/V pools) as a step sees it: every new token, prefill chunks' included,
attends in the absorbed form through `kernels.mla_decode`, as a row of its own.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxllm.inference.pages import OutOfPagesError, PageAllocator  # noqa: F401  (re-exported)
from jaxllm.kernels import (decode_attention, mla_decode, paged_attention,
                            ragged_paged_attention)
from jaxllm.kernels.reference import gather_pages
from jaxllm.kernels.xla import cached_attention

# ---------------------------------------------------------------------------------------
# Device side: pure, jitted functions over the pool arrays.


def token_slots(block_tables, positions, page_size: int, num_pages: int):
    """Flat pool slots of tokens at `positions` [B, T] (negative: padding) -> int32 [B, T].

    Padding maps to `num_pages * page_size`, one past the end, which `write_kv` drops.
    """
    pos = jnp.maximum(positions, 0)
    page = jnp.take_along_axis(block_tables, pos // page_size, axis=1, mode="clip")
    slots = page * page_size + pos % page_size
    return jnp.where(positions >= 0, slots, num_pages * page_size).astype(jnp.int32)


def _write(pages, new, slots):
    # pages [..., Hkv, P, page, D]; new [..., N, Hkv, D]; slots [N]
    *lead, hkv, p, ps, d = pages.shape
    flat = pages.reshape(*lead, hkv, p * ps, d)
    new = jnp.moveaxis(new, -2, -3).astype(pages.dtype)  # [..., Hkv, N, D]
    return flat.at[..., slots, :].set(new, mode="drop").reshape(pages.shape)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(k_pages, v_pages, k_new, v_new, slots):
    """Write new tokens into the pool; slots out of range (padding) are dropped.

    k_pages/v_pages [L, Hkv, P, page, D] (or one layer, [Hkv, P, page, D]);
    k_new/v_new [L, ..., Hkv, D] (or [..., Hkv, D]), the token axes matching `slots`.
    Prefill chunks and batched decode tokens are the same call. The pool is donated.
    """
    lead = k_pages.ndim - 4
    slots = slots.reshape(-1)
    k_new = k_new.reshape(*k_new.shape[:lead], slots.shape[0], *k_new.shape[-2:])
    v_new = v_new.reshape(*v_new.shape[:lead], slots.shape[0], *v_new.shape[-2:])
    return _write(k_pages, k_new, slots), _write(v_pages, v_new, slots)


def write_layer(k_pool, v_pool, layer, k_new, v_new, slots):
    """One layer's new tokens into the stacked pool, for use inside a jitted layer loop.

    k_pool/v_pool [L, Hkv, P, page, D]; layer an int32 scalar (may be traced);
    k_new/v_new [..., Hkv, D] with token axes matching `slots` (out of range: dropped).
    Returns the updated pools (in place when the caller's buffers can be reused).
    """
    lyr, hkv, p, ps, d = k_pool.shape
    slots = slots.reshape(-1)

    heads = jnp.arange(hkv)[:, None]  # all-array indices: the result is [Hkv, N, D]
    layer = jnp.asarray(layer, jnp.int32)

    def one(pool, new):
        new = new.reshape(slots.shape[0], hkv, d).transpose(1, 0, 2).astype(pool.dtype)
        flat = pool.reshape(lyr, hkv, p * ps, d)
        return flat.at[layer, heads, slots[None, :]].set(new, mode="drop").reshape(pool.shape)
    return one(k_pool, k_new), one(v_pool, v_new)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def copy_pages(k_pages, v_pages, src, dst):
    """k[..., dst[i], :, :] = k[..., src[i], :, :] (same for v); dst out of range is dropped."""
    def one(pages):
        return pages.at[..., dst, :, :].set(pages[..., src, :, :], mode="drop")
    return one(k_pages), one(v_pages)


def _pad_pow2(xs: list[int], fill: int) -> np.ndarray:
    n = 1 << max(0, (len(xs) - 1).bit_length())
    return np.array(xs + [fill] * (n - len(xs)), np.int32)


@dataclasses.dataclass
class PagePool:
    """The pool arrays plus their allocator; eager convenience around the pure functions."""

    k: jax.Array  # [L, Hkv, num_pages, page_size, D]
    v: jax.Array
    allocator: PageAllocator

    @classmethod
    def create(cls, *, n_layers: int, n_kv_heads: int, head_dim: int, num_pages: int,
               page_size: int, max_pages_per_seq: int, dtype=jnp.bfloat16) -> "PagePool":
        shape = (n_layers, n_kv_heads, num_pages, page_size, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   PageAllocator(num_pages, page_size, max_pages_per_seq))

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def allocate(self) -> int:
        return self.allocator.allocate()

    def fork(self, seq: int) -> int:
        return self.allocator.fork(seq)

    def free(self, seq: int) -> None:
        self.allocator.free(seq)

    def reserve(self, seqs, counts) -> np.ndarray:
        """Room for counts[i] tokens in seqs[i]; runs copy-on-write copies; slots concatenated."""
        slots, copies = self.allocator.append(seqs, counts)
        if copies:
            src, dst = zip(*copies)
            self.k, self.v = copy_pages(self.k, self.v, _pad_pow2(list(src), 0),
                                        _pad_pow2(list(dst), self.allocator.num_pages))
        return np.concatenate(slots) if slots else np.zeros((0,), np.int32)

    def write(self, k_new, v_new, slots) -> None:
        """k_new/v_new [L, N, Hkv, D] for the N flat `slots`."""
        self.k, self.v = write_kv(self.k, self.v, k_new, v_new, jnp.asarray(slots, jnp.int32))

    def append(self, seq: int, k_new, v_new) -> None:
        """Append a chunk [L, T, Hkv, D] of one sequence's K/V (a prefill chunk)."""
        self.write(k_new, v_new, self.reserve([seq], [k_new.shape[1]]))

    def tables(self, seqs, width: int | None = None):
        """Device (block_tables int32 [B, width], lengths int32 [B]) for a batch."""
        return (jnp.asarray(self.allocator.block_tables(seqs, width)),
                jnp.asarray(self.allocator.lengths(seqs)))

    def gather(self, seq: int):
        """Contiguous (k, v) [L, length, Hkv, D] of one sequence (for tests and debugging)."""
        pages = jnp.asarray(self.allocator.pages(seq), jnp.int32)
        n = self.allocator.length(seq)

        def one(pool):
            g = pool[:, :, pages]  # [L, Hkv, n_pages, page, D]
            lyr, hkv, npg, ps, d = g.shape
            return g.reshape(lyr, hkv, npg * ps, d)[:, :, :n].transpose(0, 2, 1, 3)
        return one(self.k), one(self.v)


class ContiguousCache(NamedTuple):
    """Per-layer tuples of k, v [B, Hkv, max_len, D] in the compute dtype."""
    k: tuple
    v: tuple

    @classmethod
    def init(cls, n_layers, batch, max_len, n_kv_heads, head_dim, dtype) -> "ContiguousCache":
        shape = (batch, n_kv_heads, max_len, head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def dtype(self):
        return self.k[0].dtype

    def with_layer(self, layer: int, k, v) -> "ContiguousCache":
        """This cache with layer `layer`'s buffers replaced by k, v [B, Hkv, T, D]."""
        return ContiguousCache(self.k[:layer] + (k,) + self.k[layer + 1:],
                               self.v[:layer] + (v,) + self.v[layer + 1:])

    def write(self, layer: int, k, v, positions) -> "ContiguousCache":
        rows = jnp.arange(k.shape[0])[:, None]  # (B, 1); (rows, :, positions) is [B, S, Hkv, D]
        return self.with_layer(
            layer, self.k[layer].at[rows, :, positions].set(k.astype(self.dtype)),
            self.v[layer].at[rows, :, positions].set(v.astype(self.dtype)))

    def attend(self, layer: int, q, positions, *, window: int | None = None,
               impl: str = "auto", counters=None):
        """The S new tokens of a row sit at consecutive positions (decoding, speculative
        verification): `kernels.decode_attention` with `impl` (and its optional split
        `counters`); with a sliding window, the masked einsums."""
        k, v, q = self.k[layer], self.v[layer], q.astype(self.dtype)
        if window is not None:
            return cached_attention(q, k, v, positions, window)
        return decode_attention(q, k, v, positions[:, -1] + 1, impl=impl, counters=counters)


class PagedCache(NamedTuple):
    """A paged cache as a step sees it: the pools [L, Hkv, P, page, D] and the block tables
    int32 [B, max_pages] of the batch's sequences, whose pages the caller has reserved
    (`PagePool.reserve`) before the step."""
    k: jax.Array
    v: jax.Array
    block_tables: jax.Array

    def write(self, layer: int, k, v, positions) -> "PagedCache":
        slots = token_slots(self.block_tables, positions, self.k.shape[3], self.k.shape[2])
        k_pool, v_pool = write_layer(self.k, self.v, layer, k, v, slots)
        return PagedCache(k_pool, v_pool, self.block_tables)

    def attend(self, layer: int, q, positions, *, window: int | None = None,
               impl: str = "auto", counters=None):
        """One token per row (decoding) runs the paged kernel on the pool in place; several
        (verifying speculative drafts) gather the rows' pages and mask by position. `impl`
        and `counters` are the contiguous cache's (pages take the paged kernel)."""
        if window is not None:
            raise ValueError("the paged cache has no sliding-window attention; use the "
                             "contiguous cache for models with model.sliding_window")
        if q.shape[1] == 1:
            o = paged_attention(q[:, 0].astype(self.k.dtype), self.k, self.v,
                                self.block_tables, positions[:, 0] + 1, layer=layer)
            return o[:, None]
        k = gather_pages(self.k[layer], self.block_tables).swapaxes(1, 2)  # (B, Hkv, T, D)
        v = gather_pages(self.v[layer], self.block_tables).swapaxes(1, 2)
        return cached_attention(q.astype(self.k.dtype), k, v, positions)


class RaggedPagedCache(NamedTuple):
    """The paged cache as a serving-engine step sees it: one flat batch of new tokens from
    many sequences (decode rows and prefill chunks), as a single row (B = 1, S = T).

    slots int32 [T]: each new token's flat pool slot (out of range for padding: dropped);
    block_tables int32 [N, W], kv_lens int32 [N] (cached tokens of each sequence, the new
    ones included) and q_starts int32 [N + 1] (its new tokens' rows) are those of
    `kernels.ragged_paged_attention`; max_q_len (a Python int or None) its promise that no
    sequence has more new tokens (1: a decode window's steps, which then skip the kernel's
    prefill work)."""
    k: jax.Array  # [L, Hkv, P, page, D]
    v: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    q_starts: jax.Array
    max_q_len: int | None = None

    def write(self, layer: int, k, v, positions) -> "RaggedPagedCache":
        k_pool, v_pool = write_layer(self.k, self.v, layer, k[0], v[0], self.slots)
        return self._replace(k=k_pool, v=v_pool)

    def attend(self, layer: int, q, positions, *, window: int | None = None,
               impl: str = "auto", counters=None):
        if window is not None:
            raise ValueError("the paged cache has no sliding-window attention; use the "
                             "contiguous cache for models with model.sliding_window")
        o = ragged_paged_attention(q[0].astype(self.k.dtype), self.k, self.v,
                                   self.block_tables, self.kv_lens, self.q_starts, layer=layer,
                                   max_q_len=self.max_q_len)
        return o[None]


@struct.dataclass
class LatentCache:
    """Per-layer tuples of latents c [B, max_len, rank + rope] in the compute dtype: exactly
    kv_lora_rank + qk_rope_head_dim values per token and layer."""
    c: tuple
    rank: int = struct.field(pytree_node=False)  # kv_lora_rank: the value part of c

    @classmethod
    def init(cls, n_layers, batch, max_len, latent_dim, rank, dtype) -> "LatentCache":
        return cls(tuple(jnp.zeros((batch, max_len, latent_dim), dtype)
                         for _ in range(n_layers)), rank)

    @property
    def max_len(self) -> int:
        return self.c[0].shape[1]

    @property
    def dtype(self):
        return self.c[0].dtype

    def write(self, layer: int, k, v, positions) -> "LatentCache":
        """k: the latents (B, S, rank + rope) at positions (B, S); v is None (the latent is
        its own value)."""
        if v is not None or k.shape[-1] != self.c[layer].shape[-1]:
            raise ValueError(f"LatentCache.write takes latents (B, S, "
                             f"{self.c[layer].shape[-1]}) and v=None; got {k.shape}")
        rows = jnp.arange(k.shape[0])[:, None]
        c = self.c[layer].at[rows, positions].set(k.astype(self.dtype))
        return self.replace(c=self.c[:layer] + (c,) + self.c[layer + 1:])

    def attend(self, layer: int, q, positions, *, sm_scale: float, window: int | None = None,
               impl: str = "auto", counters=None):
        """Absorbed queries q (B, S, H, rank + rope) over the cached latents, each query
        seeing keys at positions <= its own -> (B, S, H, rank), the attended latent (the
        caller projects it to per-head values). One token a row goes through
        `kernels.mla_decode` (with `impl`); several (speculative verification), plain
        einsums with the softmax in float32. `counters` is the protocol's and goes unused."""
        if window is not None:
            raise ValueError("multi-head latent attention has no sliding window")
        c = self.c[layer]
        b, t, dk = c.shape
        if q.shape[1] == 1:  # the contiguous cache as pages of its rows, identity tables
            page = math.gcd(t, 64)
            tables = jnp.arange(b * t // page, dtype=jnp.int32).reshape(b, t // page)
            o = mla_decode(q[:, 0].astype(self.dtype), c.reshape(-1, page, dk), tables,
                           positions[:, 0] + 1, v_dim=self.rank, sm_scale=sm_scale, impl=impl)
            return o[:, None]
        s = jnp.einsum("bshk,btk->bhst", q.astype(self.dtype), c,
                       preferred_element_type=jnp.float32) * sm_scale
        visible = jnp.arange(c.shape[1])[None, None, :] <= positions[:, :, None]  # (B, S, T)
        s = jnp.where(visible[:, None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1).astype(self.dtype)
        return jnp.einsum("bhst,btr->bshr", p, c[..., :self.rank])


@struct.dataclass
class RaggedLatentCache:
    """The latent pool as a serving-engine step sees it: one flat batch of new tokens from
    many sequences as a single row (B = 1, S = T), as `RaggedPagedCache` (its slots,
    block_tables, kv_lens and q_starts), over c [L, P, page, rank + rope]."""
    c: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    q_starts: jax.Array
    rank: int = struct.field(pytree_node=False)

    def write(self, layer: int, k, v, positions) -> "RaggedLatentCache":
        """k: the latents (1, T, rank + rope) of the new tokens; v is None."""
        lyr, p, ps, dk = self.c.shape
        if v is not None or k.shape[-1] != dk:
            raise ValueError(f"RaggedLatentCache.write takes latents (1, T, {dk}) and v=None; "
                             f"got {k.shape}")
        flat = self.c.reshape(lyr, p * ps, dk)
        c = flat.at[layer, self.slots].set(k[0].astype(self.c.dtype), mode="drop")
        return self.replace(c=c.reshape(self.c.shape))

    def attend(self, layer: int, q, positions, *, sm_scale: float, window: int | None = None,
               impl: str = "auto", counters=None):
        """Absorbed queries q (1, T, H, rank + rope) -> (1, T, H, rank): token i of sequence
        s is a row of `kernels.mla_decode` with s's block table and length its position + 1
        (causal within the sequence); padding rows (at or past q_starts[-1]) give zeros."""
        if window is not None:
            raise ValueError("multi-head latent attention has no sliding window")
        t, n = q.shape[1], self.kv_lens.shape[0]
        rows = jnp.arange(t, dtype=jnp.int32)
        # compare_all: one fused comparison; the default binary search is a device loop,
        # which XLA steps from the host outside its command buffers
        seq = jnp.clip(jnp.searchsorted(self.q_starts, rows, side="right", method="compare_all")
                       - 1, 0, n - 1)
        lengths = jnp.where(rows < self.q_starts[-1], positions[0] + 1, 0).astype(jnp.int32)
        o = mla_decode(q[0].astype(self.c.dtype), self.c, self.block_tables[seq], lengths,
                       v_dim=self.rank, sm_scale=sm_scale, impl=impl, layer=layer)
        return o[None]
