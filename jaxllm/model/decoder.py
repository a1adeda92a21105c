"""The Llama-family decoder: embed -> N x [norm, attention, norm, SwiGLU] -> norm -> head.

The N blocks are one stacked module (every parameter has a leading `layers` axis) run by
`jax.lax.scan`, so compile time does not grow with depth and pipeline stages are slices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.attention import Attention, KVCache
from jaxllm.model.layers import MLP, Embed, Linear, RMSNorm, as_dtype, rope_frequencies
from jaxllm.model.mtp import MTPHeads
from jaxllm.sharding import context

REMAT_POLICIES = {
    "full": None,  # save nothing; recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype, pdtype = as_dtype(cfg.dtype), as_dtype(cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(d_model=cfg.d_model, n_heads=cfg.n_heads,
                              n_kv_heads=cfg.n_kv_heads, head_dim=cfg.resolved_head_dim,
                              rope_theta=cfg.rope_theta, attention_impl=cfg.attention_impl,
                              qkv_bias=cfg.qkv_bias, rope_scaling=cfg.rope_scaling,
                              sliding_window=cfg.sliding_window,
                              decode_impl=cfg.decode_impl, dtype=dtype,
                              param_dtype=pdtype, rngs=rngs, std=cfg.init_std, out_std=out_std)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        self.mlp = MLP(cfg.d_model, cfg.mlp_dim, dtype=dtype, param_dtype=pdtype, rngs=rngs,
                       std=cfg.init_std, out_std=out_std)
        self.fused_decode = False  # see Decoder.fuse_projections

    def __call__(self, x, positions, cache=None, layer=None, prefill=False):
        if (self.fused_decode and isinstance(cache, KVCache) and cache.per_layer
                and not prefill):
            from jaxllm.kernels.pallas import gemv_triton  # kernels load on first use
            if x.shape[0] * x.shape[1] <= gemv_triton.TUNED["model_rows"]:
                return self._decode_fused(x, positions, cache, layer)
        h, cache = self.attn(self.attn_norm(x), positions, cache, layer, prefill)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache

    def _decode_fused(self, x, positions, cache: KVCache, layer: int):
        """The block for a few new tokens (at most gemv_triton.TUNED["model_rows"] rows:
        one-token steps at batch 1 by default) in five kernels: norm + q/k/v + RoPE +
        cache write, attention over the cache, output projection + residual, norm +
        gate/up + SwiGLU, down projection + residual (kernels/pallas/gemv_triton.py). The
        same numbers as __call__, to rounding."""
        from jaxllm.kernels.pallas import gemv_triton

        attn, mlp = self.attn, self.mlp
        b, s, d = x.shape
        x2 = x.reshape(b * s, d)
        head_dim = attn.qkv.kernel.shape[1]
        # the q/k/v kernel also zeroes the counters with which the attention kernel
        # merges its context splits in place (two fewer kernels than a merge after it)
        zeros = b * attn.n_kv_heads if gemv_triton.TUNED["split_counters"] else 0
        q, k_cache, v_cache, *counters = gemv_triton.decode_gemv(
            x2, attn.qkv.kernel[...], norm_scale=self.attn_norm.scale[...],
            eps=self.attn_norm.eps, epilogue="qkv", positions=positions.reshape(b * s),
            inv_freq=rope_frequencies(head_dim, attn.rope_theta, attn.rope_scaling),
            q_len=s, q_heads=attn.n_heads, k_cache=cache.k[layer], v_cache=cache.v[layer],
            zeros=zeros)
        counters = counters[0] if counters else None
        cache = cache.with_layer(layer, k_cache, v_cache)
        o = cache.attend(layer, q.reshape(b, s, attn.n_heads, head_dim), positions,
                         attn.window, attn.decode_impl, counters=counters)
        x2 = gemv_triton.decode_gemv(o.reshape(b * s, -1), attn.o.kernel[...].reshape(d, -1),
                                     residual=x2)
        h = gemv_triton.decode_gemv(x2, mlp.gate_up.kernel[...], epilogue="glu",
                                    norm_scale=self.mlp_norm.scale[...], eps=self.mlp_norm.eps)
        x2 = gemv_triton.decode_gemv(h, mlp.down.kernel[...], residual=x2)
        return x2.reshape(b, s, d), cache


class Decoder(nnx.Module):
    """tokens int32 [B, S] -> logits float32 [B, S, V]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, pdtype = as_dtype(cfg.dtype), as_dtype(cfg.param_dtype)
        self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=pdtype,
                           rngs=rngs, std=cfg.init_std)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype, param_dtype=pdtype,
                                  rngs=rngs)
        self.head = None if cfg.tie_embeddings else Linear(
            (cfg.d_model,), (cfg.vocab_size,), ("embed", "vocab"), "bsd,dv->bsv",
            dtype=dtype, param_dtype=pdtype, rngs=rngs, std=cfg.init_std)
        # multi-token-prediction modules (model/mtp.py): extra training loss, drafting
        self.mtp = MTPHeads(cfg, rngs=rngs) if cfg.mtp_depth > 0 else None

    # -- pieces, so that MTP heads and speculative decoding can reuse them -------------

    def logits(self, h):
        """Final norm + output head: hidden (B, S, d) -> float32 logits (B, S, V)."""
        h = self.final_norm(h)
        if self.head is None:
            return self.embed.attend(h)
        return self.head(h).astype(jnp.float32)

    def run_blocks(self, x, positions, cache: KVCache | None = None, prefill: bool = False):
        """Run the blocks over x (B, S, d). Returns (hidden, cache).

        Stacked blocks are scanned; unstacked ones (see `unstack_layers`) run in a Python
        loop.
        """
        if isinstance(self.blocks, nnx.List):  # unstacked (see unstack_layers): a Python loop
            for i, block in enumerate(self.blocks):
                x, cache = block(x, positions, cache, i, prefill)
            return x, cache
        graphdef, state = nnx.split(self.blocks)

        def body(carry, layer_state):
            x, cache, layer = carry
            block = nnx.merge(graphdef, layer_state)
            x, cache = block(x, positions, cache, layer, prefill)
            return (x, cache, layer + 1), None

        if self.cfg.remat != "none" and cache is None:
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat])
        (x, cache, _), _ = jax.lax.scan(body, (x, cache, jnp.int32(0)), state)
        return x, cache

    def __call__(self, tokens, *, return_hidden: bool = False):
        """Training / scoring forward: causal attention over the whole sequence."""
        b, s = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x, positions = context.balance(self.embed(tokens), positions)  # cp > 1: reorder
        h, _ = self.run_blocks(x, positions)
        h = context.unbalance(h)
        logits = self.logits(h)
        return (logits, h) if return_hidden else logits

    def forward_cached(self, tokens, cache: KVCache, start, *, prefill: bool = False,
                       return_hidden: bool = False):
        """Forward with a KV cache. tokens (B, S) sit at positions start[b] + i.

        Returns (logits (B, S, V), cache[, hidden]). With prefill=True every row starts at 0.
        """
        b, s = tokens.shape
        positions = start[:, None].astype(jnp.int32) + jnp.arange(s, dtype=jnp.int32)[None]
        h, cache = self.run_blocks(self.embed(tokens), positions, cache, prefill)
        logits = self.logits(h)
        return (logits, cache, h) if return_hidden else (logits, cache)

    def unstack_layers(self) -> "Decoder":
        """Replace the stacked blocks by a list of per-layer blocks, in place.

        For decoding: each layer's weights become separate arrays, so a decode step reads
        them directly instead of slicing them out of the stacked [L, ...] arrays inside
        a loop, and the layer loop is unrolled. Training keeps the stacked, scanned form.
        """
        if not isinstance(self.blocks, nnx.List):
            graphdef, state = nnx.split(self.blocks)
            self.blocks = nnx.List([nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
                                    for i in range(self.cfg.n_layers)])
        return self

    def fuse_projections(self, matmul_impl: str = "xla") -> "Decoder":
        """Join q/k/v and gate/up weights (per layer, and in the MTP modules), in place.

        For decoding, after `unstack_layers`: each layer then reads its weights in three
        matmuls (qkv, gate_up, down) plus the output projection instead of six. The
        numbers are the same; training keeps the separate weights.

        `matmul_impl="pallas_triton"` also stores every layer weight out-major and runs a
        block's decode steps over a per-layer cache with few rows (gemv_triton.TUNED
        ["model_rows"]: 1 by default, where they measure faster than XLA) in the fused
        decode kernels (`Block._decode_fused`): norms, RoPE, cache writes, SwiGLU and
        residual adds folded into the four weight reads. Single-device only (the kernels see whole
        weights); blocks with q/k/v biases keep the XLA path.
        """
        if matmul_impl not in ("xla", "pallas_triton"):
            raise ValueError(f"matmul_impl={matmul_impl!r}; choose 'xla' or 'pallas_triton'")
        if not isinstance(self.blocks, nnx.List):
            raise ValueError("fuse_projections needs unstacked layers: call unstack_layers()")
        why = self.fused_decode_unsupported() if matmul_impl == "pallas_triton" else None
        if why:
            raise ValueError(f"inference.matmul_impl=pallas_triton: {why}")
        blocks = list(self.blocks) + ([m.block for m in self.mtp.layers] if self.mtp else [])
        for block in blocks:
            bias = (block.attn.q or block.attn.qkv).bias is not None
            fused = matmul_impl == "pallas_triton" and not bias
            block.attn.fuse_projections(out_major=fused)
            block.mlp.fuse_projections(out_major=fused)
            block.fused_decode = fused
        return self

    def fused_decode_unsupported(self) -> str | None:
        """Why the fused decode kernels cannot take this model's weights (None if they can)."""
        from jaxllm.kernels.pallas import gemv_triton

        c = self.cfg
        hq, hkv, hd, d, f = (c.n_heads, c.n_kv_heads, c.resolved_head_dim, c.d_model,
                             c.mlp_dim)
        shape = jax.ShapeDtypeStruct
        for name, k, w, epilogue in (("q/k/v", d, (hq + 2 * hkv, hd, d), "qkv"),
                                     ("output", hq * hd, (d, hq * hd), "none"),
                                     ("gate/up", d, (2, f, d), "glu"),
                                     ("down", f, (d, f), "none")):
            why = gemv_triton.unsupported_reason(shape((1, k), jnp.float32),
                                                 shape(w, jnp.float32), epilogue)
            if why:
                return f"the fused decode kernels cannot take the {name} projection: {why}"
        return None

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """A contiguous cache: per-layer buffers once the layers are unstacked (Python loop),
        one stacked buffer for the scanned stack."""
        c = self.cfg
        return KVCache.init(c.n_layers, batch, max_len, c.n_kv_heads, c.resolved_head_dim,
                            as_dtype(dtype or c.dtype),
                            per_layer=isinstance(self.blocks, nnx.List))


def build_model(cfg: ModelConfig, *, rngs: nnx.Rngs | None = None) -> Decoder:
    """The decoder for `cfg` (a ModelConfig, or a full Config whose .model is used)."""
    cfg = getattr(cfg, "model", cfg)
    return Decoder(cfg, rngs=rngs if rngs is not None else nnx.Rngs(0))
