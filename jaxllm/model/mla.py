"""Multi-head latent attention (DeepSeek-V2/V3), training form.

Keys and values come from one small latent per token, so decoding caches that latent
(kv_lora_rank + qk_rope_head_dim values) instead of per-head K and V:

  queries   x -> q_a (q_lora_rank) -> RMSNorm -> q_b, or x -> q directly (no q_lora_rank);
            each head is [nope (qk_nope_head_dim) | rope (qk_rope_head_dim)], RoPE on rope
  latent    x -> kv_a -> [c (kv_lora_rank) | k_rope (qk_rope_head_dim)]; RMSNorm on c,
            RoPE on k_rope, which all heads share
  k, v      c -> kv_b -> each head [k_nope | v (v_head_dim)]; k = [k_nope | k_rope]

Attention runs per head with D_qk = nope + rope and D_v = v_head_dim (192 and 128 in
DeepSeek-V3) through the flash kernels, then the output projection. The softmax scale is
1/sqrt(D_qk), times YaRN's mscale(mscale_all_dim)^2 with rope_scaling.rope_type yarn.
The absorbed decode form over the cached latent is `jaxllm.inference.step`'s.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxllm.config import MLAConfig
from jaxllm.model.layers import Linear, RMSNorm, apply_rope, param, softmax_scale_factor
from jaxllm.sharding.context import causal_attention


class LatentNorm(RMSNorm):
    """RMSNorm over a latent (the low-rank query or the key-value latent)."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, rngs):
        super().__init__(dim, eps=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.scale = param(rngs, (dim,), ("latent",), param_dtype, value=1.0)


class MLA(nnx.Module):
    def __init__(self, *, d_model: int, n_heads: int, mla: MLAConfig, rope_theta,
                 rope_scaling, attention_impl, norm_eps, dtype, param_dtype, rngs, std,
                 out_std):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        heads = (n_heads, mla.qk_head_dim)
        if mla.q_lora_rank:
            self.q_a = Linear((d_model,), (mla.q_lora_rank,), ("embed", "latent"),
                              "bsd,dr->bsr", std=std, **kw)
            self.q_a_norm = LatentNorm(mla.q_lora_rank, **norm)
            self.q_b = Linear((mla.q_lora_rank,), heads, ("latent", "q_heads", "head_dim"),
                              "bsr,rhk->bshk", std=std, **kw)
        else:
            self.q = Linear((d_model,), heads, ("embed", "q_heads", "head_dim"),
                            "bsd,dhk->bshk", std=std, **kw)
        self.kv_a = Linear((d_model,), (mla.latent_dim,), ("embed", "latent"), "bsd,dr->bsr",
                           std=std, **kw)
        self.kv_norm = LatentNorm(mla.kv_lora_rank, **norm)
        self.kv_b = Linear((mla.kv_lora_rank,), (n_heads, mla.qk_nope_head_dim + mla.v_head_dim),
                           ("latent", "q_heads", "head_dim"), "bsr,rhk->bshk", std=std, **kw)
        self.o = Linear((n_heads, mla.v_head_dim), (d_model,), ("q_heads", "head_dim", "embed"),
                        "bshk,hkd->bsd", std=out_std, **kw)
        self.mla, self.n_heads = mla, n_heads
        self.rope_theta, self.rope_scaling, self.impl = rope_theta, rope_scaling, attention_impl

    def queries(self, x, positions):
        """x (B, S, d) -> q (B, S, H, nope + rope), RoPE applied to its rope part."""
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.mla.q_lora_rank else self.q(x)
        nope = self.mla.qk_nope_head_dim
        q_rope = apply_rope(q[..., nope:], positions, self.rope_theta, self.rope_scaling)
        return jnp.concatenate([q[..., :nope], q_rope], axis=-1)

    def latent(self, x, positions):
        """x (B, S, d) -> (c (B, S, kv_lora_rank) normed, k_rope (B, S, 1, rope) with RoPE):
        what decoding caches."""
        ckv = self.kv_a(x)
        c, k_rope = ckv[..., :self.mla.kv_lora_rank], ckv[..., self.mla.kv_lora_rank:]
        k_rope = apply_rope(k_rope[:, :, None], positions, self.rope_theta, self.rope_scaling)
        return self.kv_norm(c), k_rope

    def __call__(self, x, positions):
        """Causal self-attention: x (B, S, d), positions int (B, S) -> (B, S, d)."""
        q = self.queries(x, positions)  # (B, S, H, Dqk)
        c, k_rope = self.latent(x, positions)
        kv = self.kv_b(c)  # (B, S, H, nope + Dv)
        nope = self.mla.qk_nope_head_dim
        k_rope = jnp.broadcast_to(k_rope, (*kv.shape[:3], k_rope.shape[-1]))
        k = jnp.concatenate([kv[..., :nope], k_rope], axis=-1)  # (B, S, H, Dqk)
        v = kv[..., nope:]  # (B, S, H, Dv)
        # the kernels scale scores by 1/sqrt(Dqk); YaRN's correction rides on q
        factor = softmax_scale_factor(self.rope_scaling)
        if factor != 1.0:
            q = (q * factor).astype(q.dtype)
        return self.o(causal_attention(q, k, v, impl=self.impl))  # context-parallel when cp > 1
