"""Grouped-query attention (MHA / GQA / MQA through n_kv_heads), training form."""
from __future__ import annotations

from flax import nnx

from jaxllm.kernels.xla import cached_attention
from jaxllm.model.layers import Linear, apply_rope
from jaxllm.sharding.context import causal_attention


class Attention(nnx.Module):
    def __init__(self, *, d_model, n_heads, n_kv_heads, head_dim, rope_theta, attention_impl,
                 qkv_bias=False, rope_scaling=None, sliding_window=None, dtype, param_dtype,
                 rngs, std, out_std):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = Linear((d_model,), (n_heads, head_dim), ("embed", "q_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.k = Linear((d_model,), (n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.v = Linear((d_model,), (n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.o = Linear((n_heads, head_dim), (d_model,), ("q_heads", "head_dim", "embed"),
                        "bshk,hkd->bsd", std=out_std, **kw)
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.impl, self.window = attention_impl, sliding_window

    def __call__(self, x, positions):
        """Causal self-attention: x (B, S, d), positions int (B, S) -> (B, S, d)."""
        q = apply_rope(self.q(x), positions, self.rope_theta, self.rope_scaling)  # (B, S, Hq, D)
        k = apply_rope(self.k(x), positions, self.rope_theta, self.rope_scaling)  # (B, S, Hkv, D)
        v = self.v(x)
        if self.window is not None and self.window < x.shape[1]:  # the kernels have no window
            o = cached_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), positions, self.window)
        else:
            o = causal_attention(q, k, v, impl=self.impl)  # context-parallel when cp > 1
        return self.o(o)
