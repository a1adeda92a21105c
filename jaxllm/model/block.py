"""One transformer block: x + attention(norm(x)), then + SwiGLU(norm(x)) or + MoE(norm(x));
the attention is grouped-query or multi-head latent (model.attention).

A block returns (x, stats): the MoE block's routing statistics (model/moe.py), {} for a
dense one, so the scanned stack of blocks gives them per layer.
"""
from __future__ import annotations

from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.attention import Attention
from jaxllm.model.layers import MLP, RMSNorm, as_dtype
from jaxllm.model.mla import MLA
from jaxllm.model.moe import MoE


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        """`moe`: the feed-forward part is model.moe's MoE block, else the dense MLP."""
        dtype, pdtype = as_dtype(cfg.dtype), as_dtype(cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5  # residual outputs scaled by depth
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        if cfg.attention == "mla":
            self.attn = MLA(d_model=cfg.d_model, n_heads=cfg.n_heads, mla=cfg.mla,
                            rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                            attention_impl=cfg.attention_impl, norm_eps=cfg.norm_eps,
                            dtype=dtype, param_dtype=pdtype, rngs=rngs, std=cfg.init_std,
                            out_std=out_std)
        else:
            self.attn = Attention(d_model=cfg.d_model, n_heads=cfg.n_heads,
                                  n_kv_heads=cfg.n_kv_heads, head_dim=cfg.resolved_head_dim,
                                  rope_theta=cfg.rope_theta, attention_impl=cfg.attention_impl,
                                  qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm,
                                  norm_eps=cfg.norm_eps, rope_scaling=cfg.rope_scaling,
                                  sliding_window=cfg.sliding_window, dtype=dtype,
                                  param_dtype=pdtype, rngs=rngs, std=cfg.init_std, out_std=out_std)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        ffn = MoE if moe else MLP
        self.mlp = ffn(cfg.d_model, cfg.moe if moe else cfg.mlp_dim, dtype=dtype,
                       param_dtype=pdtype, rngs=rngs, std=cfg.init_std, out_std=out_std)
        self.moe = moe

    def __call__(self, x, positions):
        """x (B, S, d), positions int (B, S) -> ((B, S, d), stats)."""
        x = x + self.attn(self.attn_norm(x), positions)
        if not self.moe:
            return x + self.mlp(self.mlp_norm(x)), {}
        y, stats = self.mlp(self.mlp_norm(x))
        return x + y, stats
