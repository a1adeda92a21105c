"""Grouped-query attention (MHA / GQA / MQA through n_kv_heads) and its contiguous KV cache."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels.xla import cached_attention
from jaxllm.model.layers import Linear, apply_rope
from jaxllm.sharding.context import causal_attention


class KVCache(NamedTuple):
    """Contiguous cache for all layers, in the compute dtype: k, v [L, B, Hkv, max_len, D],
    or (per-layer form) tuples of L arrays [B, Hkv, max_len, D].

    Position p of row b lives at [b, :, p] of its layer: each (row, head) is one contiguous
    [max_len, D] matrix, the layout a batched matmul reads without a transpose. Writes
    are indexed by position, so tokens written past a row's true length (padding,
    rejected speculative drafts) are simply overwritten later and never read, since
    attention masks keys after the query.

    The stacked form serves a scan over layers (traced layer index). The per-layer form
    serves an unrolled layer loop (Python int layer index): attention then reads the
    layer's own buffer, where slicing a stacked array would copy the layer out first
    (a full read and write of that layer's cache per step).
    """
    k: jax.Array | tuple
    v: jax.Array | tuple

    @classmethod
    def init(cls, n_layers, batch, max_len, n_kv_heads, head_dim, dtype,
             per_layer: bool = False) -> "KVCache":
        if per_layer:
            shape = (batch, n_kv_heads, max_len, head_dim)
            return cls(tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
                       tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)))
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2] if self.per_layer else self.k.shape[3]

    @property
    def dtype(self):
        return self.k[0].dtype if self.per_layer else self.k.dtype

    # The cache interface the attention layer uses (PagedKV in inference/kv_cache.py too):

    def update(self, layer, k, v, positions) -> "KVCache":
        """Write k/v (B, S, Hkv, D) of layer `layer` at `positions` (B, S)."""
        rows = jnp.arange(k.shape[0])[:, None]  # (B, 1)
        if self.per_layer:
            # (rows, :, positions) selects [B, S, Hkv, D]: k's own layout
            return self.with_layer(
                layer, self.k[layer].at[rows, :, positions].set(k.astype(self.dtype)),
                self.v[layer].at[rows, :, positions].set(v.astype(self.dtype)))
        return KVCache(self.k.at[layer, rows, :, positions].set(k.astype(self.dtype)),
                       self.v.at[layer, rows, :, positions].set(v.astype(self.dtype)))

    def with_layer(self, layer: int, k, v) -> "KVCache":
        """The per-layer cache with layer `layer`'s buffers replaced by k, v [B, Hkv, T, D]."""
        if not self.per_layer or not isinstance(layer, int):
            raise TypeError("replacing a layer's buffers needs the per-layer KVCache and a "
                            f"Python int layer index (unrolled layers), got "
                            f"{type(layer).__name__}")
        return KVCache(self.k[:layer] + (k,) + self.k[layer + 1:],
                       self.v[:layer] + (v,) + self.v[layer + 1:])

    def attend(self, layer, q, positions, window: int | None = None, impl: str = "auto",
               counters=None):
        """Queries q (B, S, Hq, D) at `positions` over the cached keys of layer `layer`.

        Without a window, the S tokens of a row sit at consecutive positions (decoding,
        speculative verification): `kernels.decode_attention` with `impl` (and its
        optional `counters`).
        """
        k, v, q = self.k[layer], self.v[layer], q.astype(self.dtype)
        if window is not None:
            return cached_attention(q, k, v, positions, window)
        from jaxllm.kernels import decode_attention
        return decode_attention(q, k, v, positions[:, -1] + 1, impl=impl, counters=counters)


class Attention(nnx.Module):
    def __init__(self, *, d_model, n_heads, n_kv_heads, head_dim, rope_theta, attention_impl,
                 qkv_bias=False, rope_scaling=None, sliding_window=None, dtype, param_dtype,
                 rngs, std, out_std, decode_impl="auto"):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = Linear((d_model,), (n_heads, head_dim), ("embed", "q_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.k = Linear((d_model,), (n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.v = Linear((d_model,), (n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.o = Linear((n_heads, head_dim), (d_model,), ("q_heads", "head_dim", "embed"),
                        "bshk,hkd->bsd", std=out_std, **kw)
        self.qkv = nnx.data(None)  # decode form, see fuse_projections
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.rope_theta, self.impl, self.decode_impl = rope_theta, attention_impl, decode_impl
        self.rope_scaling = rope_scaling  # a RopeScaling (hashable: static in the jit) or None
        self.window = sliding_window

    def fuse_projections(self, out_major: bool = False):
        """Decode form: q, k and v become one [d, Hq + 2 Hkv, D] weight, read by one matmul
        (at batch 1 a decode step is a chain of small weight reads; fewer, larger ones get
        closer to the memory bandwidth). `out_major`: every weight stored [*out, *in], as
        the fused decode kernels read it."""
        if self.qkv is None:
            self.qkv = Linear.fused([self.q, self.k, self.v], 1, ("embed", None, "head_dim"),
                                    "bsd,dhk->bshk", out_major=out_major)
            self.q = self.k = self.v = None
            if out_major:
                self.o = Linear.fused([self.o], 0, ("q_heads", "head_dim", "embed"),
                                      "bshk,hkd->bsd", out_major=True)
        return self

    def _project(self, x):
        if self.qkv is None:
            return self.q(x), self.k(x), self.v(x)
        qkv, hq, hkv = self.qkv(x), self.n_heads, self.n_kv_heads  # (B, S, Hq + 2 Hkv, D)
        return qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]

    def _self_attention(self, q, k, v, positions):
        """Causal attention of the new tokens over themselves (positions 0..S-1)."""
        if self.window is not None and self.window < q.shape[1]:  # the kernels have no window
            return cached_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), positions,
                                    self.window)
        return causal_attention(q, k, v, impl=self.impl)  # context-parallel when cp > 1

    def __call__(self, x, positions, cache: KVCache | None = None, layer=None,
                 prefill: bool = False):
        """x (B, S, d), positions int (B, S) -> (out (B, S, d), cache).

        Without a cache: causal self-attention over x (training, scoring).
        With a cache: the new K/V are written at `positions` of layer `layer`, then
        - prefill=True: positions start at 0 in every row, so attention over the new
          tokens alone (the flash kernel) is exact;
        - otherwise the queries attend over the cache, keys after each query masked.
        """
        q, k, v = self._project(x)
        q = apply_rope(q, positions, self.rope_theta, self.rope_scaling)  # (B, S, Hq, D)
        k = apply_rope(k, positions, self.rope_theta, self.rope_scaling)  # (B, S, Hkv, D)
        if cache is None:
            return self.o(self._self_attention(q, k, v, positions)), None
        cache = cache.update(layer, k, v, positions)
        if prefill:
            o = self._self_attention(q, k, v, positions)
        else:
            o = cache.attend(layer, q, positions, self.window, self.decode_impl)
        return self.o(o), cache
