"""Grouped-query attention (MHA / GQA / MQA through n_kv_heads), training form."""
from __future__ import annotations

from flax import nnx

from jaxllm.kernels.xla import cached_attention
from jaxllm.model.layers import Linear, RMSNorm, apply_rope, param
from jaxllm.sharding.context import causal_attention


class HeadNorm(RMSNorm):
    """RMSNorm over head_dim of every head (Qwen3's q/k norm); the scale lies on head_dim."""

    def __init__(self, head_dim: int, *, eps: float, dtype, param_dtype, rngs):
        super().__init__(head_dim, eps=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.scale = param(rngs, (head_dim,), ("head_dim",), param_dtype, value=1.0)


class Attention(nnx.Module):
    def __init__(self, *, d_model, n_heads, n_kv_heads, head_dim, rope_theta, attention_impl,
                 qkv_bias=False, qk_norm=False, norm_eps=1e-6, rope_scaling=None,
                 sliding_window=None, dtype, param_dtype, rngs, std, out_std):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = Linear((d_model,), (n_heads, head_dim), ("embed", "q_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.k = Linear((d_model,), (n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.v = Linear((d_model,), (n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                        "bsd,dhk->bshk", std=std, bias=qkv_bias, **kw)
        self.o = Linear((n_heads, head_dim), (d_model,), ("q_heads", "head_dim", "embed"),
                        "bshk,hkd->bsd", std=out_std, **kw)
        if qk_norm:
            norm = dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.q_norm, self.k_norm = HeadNorm(head_dim, **norm), HeadNorm(head_dim, **norm)
        self.qk_norm = qk_norm
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.impl, self.window = attention_impl, sliding_window

    def __call__(self, x, positions):
        """Causal self-attention: x (B, S, d), positions int (B, S) -> (B, S, d)."""
        q, k = self.q(x), self.k(x)  # (B, S, Hq, D), (B, S, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.rope_theta, self.rope_scaling)
        k = apply_rope(k, positions, self.rope_theta, self.rope_scaling)
        v = self.v(x)
        if self.window is not None and self.window < x.shape[1]:  # the kernels have no window
            o = cached_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), positions, self.window)
        else:
            o = causal_attention(q, k, v, impl=self.impl)  # context-parallel when cp > 1
        return self.o(o)
