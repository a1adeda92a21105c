"""The decode program: pure functions over `DecodeParams` and a KV cache.

    logits, cache, hidden = forward(params, tokens, cache, start, prefill=...)

runs new tokens (B, S) at positions start[b] + i through every layer (a Python loop over
the per-layer weights) and writes their K/V into the cache (inference/cache.py). Prefill
(every row from position 0) attends over the new tokens alone with the flash kernel;
decoding and speculative verification attend over the cache. Which kernel runs is the
kernel registry's pick (`jaxllm.kernels`); steps of at most `params.fused_rows` rows over
a contiguous cache run each layer in the fused decode matmuls (their `pallas_triton`
implementation, picked once by `decode_params`) instead of XLA's.

Multi-head latent attention layers cache their latent (`LatentCache`). Prefill expands it
to per-head K/V and runs the flash kernel (query-key dim nope + rope, value dim v_head_dim);
decoding runs the absorbed form: each head's q_nope is taken through W_uk into the latent
space, attention is multi-query over the cached latents, and the attended latent goes
through W_uv to the head's values before the output projection. The serving engine's flat
batches (`hidden_states` without prefill) run every token in the absorbed form over the
paged latent pool (`RaggedLatentCache`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.inference.cache import ContiguousCache, LatentCache
from jaxllm.inference.params import DecodeParams, LayerParams, MLALayerParams, MoEParams
from jaxllm.kernels import decode_matmul, flash_attention
from jaxllm.kernels.xla import cached_attention
from jaxllm.model.layers import apply_rope, as_dtype, rope_frequencies, softmax_scale_factor
from jaxllm.model.moe import expert_ffn, route


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def eos_ids(eos) -> tuple[int, ...]:
    """An EOS id, several (generation_config.json may list them) or None -> a tuple of ids."""
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, (int, np.integer)) else tuple(int(e) for e in eos)


def is_eos(tokens, eos):
    """Whether each of `tokens` (any int array) is one of the EOS ids `eos` (see eos_ids)."""
    ids = eos_ids(eos)
    if not ids:
        return jnp.zeros(jnp.shape(tokens), bool)
    return jnp.isin(tokens, jnp.asarray(ids, jnp.int32))


def pad_prompts(prompts: list[list[int]], multiple: int = 16):
    """Token-id prompts -> (tokens int32 (B, P) right-padded to a multiple of `multiple`,
    true lengths int32 (B,)); P in few sizes, so prefill compiles for few shapes."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must hold at least one token")
    tokens = np.zeros((len(prompts), round_up(max(map(len, prompts)), multiple)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def init_cache(params: DecodeParams, batch: int, max_len: int, n_layers: int | None = None):
    """A zeroed contiguous cache for `n_layers` layers (default: the model's); the latent
    cache for a multi-head latent attention model."""
    c = params.cfg
    n_layers = params.n_layers if n_layers is None else n_layers
    if c.mla is not None:
        return LatentCache.init(n_layers, batch, max_len, c.mla.latent_dim,
                                c.mla.kv_lora_rank, as_dtype(c.dtype))
    return ContiguousCache.init(n_layers, batch, max_len, c.n_kv_heads, c.resolved_head_dim,
                                as_dtype(c.dtype))


def rms_norm(x, scale, eps: float):
    """x / rms(x) * scale in float32, returned in x's dtype (as model.layers.RMSNorm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def dense(x, w, bias=None):
    """x (..., K) @ out-major w (*out, K) -> (..., *out)."""
    y = jnp.dot(x.reshape(-1, x.shape[-1]), w.reshape(-1, w.shape[-1]).T)
    y = y.reshape(*x.shape[:-1], *w.shape[:-1])
    return y if bias is None else y + bias


def embed(params: DecodeParams, tokens):  # (B, S) -> (B, S, d)
    return jnp.take(params.embed, tokens, axis=0)


def logits(params: DecodeParams, h):
    """Final norm + output head: hidden (B, S, d) -> float32 logits (B, S, V)."""
    return head_logits(params, rms_norm(h, params.final_norm, params.cfg.norm_eps))


def head_logits(params: DecodeParams, h):
    """The output head alone over normed hidden states (B, S, d) -> float32 logits
    (B, S, V): the main model's after its final norm, an MTP module's after its own."""
    head = params.embed if params.head is None else params.head
    return jnp.einsum("bsd,vd->bsv", h, head, preferred_element_type=jnp.float32)


def _attention(cfg, q, k, v, positions, cache, layer, prefill: bool):
    """New tokens' q (B, S, Hq, D) over themselves (prefill) or over the cache."""
    window = cfg.sliding_window
    if not prefill:
        return cache.attend(layer, q, positions, window=window, impl=cfg.decode_impl)
    if window is not None and window < q.shape[1]:  # the flash kernels have no window
        return cached_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), positions, window)
    return flash_attention(q, k, v, causal=True, impl=cfg.attention_impl)


def block(cfg, lp: LayerParams, x, positions, cache, layer: int, *, prefill: bool = False,
          fused: bool = False):
    """One transformer block over x (B, S, d) at positions (B, S). Returns (x, cache)."""
    if isinstance(lp, MLALayerParams):
        return _mla_block(cfg, lp, x, positions, cache, layer, prefill=prefill)
    if fused:
        return _fused_block(cfg, lp, x, positions, cache, layer)
    b, s, _ = x.shape
    hq, hkv = cfg.n_heads, cfg.n_kv_heads
    qkv = dense(rms_norm(x, lp.attn_norm, cfg.norm_eps), lp.qkv, lp.qkv_bias)  # (B, S, H, D)
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv]
    if lp.q_norm is not None:  # model.qk_norm: per-head RMSNorm before RoPE
        q, k = rms_norm(q, lp.q_norm, cfg.norm_eps), rms_norm(k, lp.k_norm, cfg.norm_eps)
    q = apply_rope(q, positions, cfg.rope_theta, cfg.rope_scaling)
    k = apply_rope(k, positions, cfg.rope_theta, cfg.rope_scaling)
    v = qkv[:, :, hq + hkv:]
    cache = cache.write(layer, k, v, positions)
    o = _attention(cfg, q, k, v, positions, cache, layer, prefill)  # (B, S, Hq, D)
    x = x + dense(o.reshape(b, s, -1), lp.o)
    return _ffn(cfg, lp, x), cache


def _ffn(cfg, lp: LayerParams | MLALayerParams, x):
    """x + the feed-forward block: the dense SwiGLU, or an MoE layer's routed experts plus
    its shared experts (gate_up None: none)."""
    h = rms_norm(x, lp.mlp_norm, cfg.norm_eps)
    if lp.moe is not None:
        x = x + _routed_experts(cfg, lp.moe, h)
    if lp.gate_up is None:
        return x
    gate_up = dense(h, lp.gate_up)  # (B, S, 2, F)
    return x + dense(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], lp.down)


def _mla_block(cfg, lp: MLALayerParams, x, positions, cache: LatentCache, layer: int, *,
               prefill: bool):
    """A multi-head latent attention block (model/mla.py's numbers): the latent written to
    the cache, attention expanded (prefill) or absorbed (decoding)."""
    b, s, _ = x.shape
    mla, eps = cfg.mla, cfg.norm_eps
    nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
    h = rms_norm(x, lp.attn_norm, eps)
    q_in = h if lp.q_a is None else rms_norm(dense(h, lp.q_a), lp.q_a_norm, eps)
    q = dense(q_in, lp.q_b)  # (B, S, H, Dqk)
    q_rope = apply_rope(q[..., nope:], positions, cfg.rope_theta, cfg.rope_scaling)
    ckv = dense(h, lp.kv_a)  # (B, S, rank + rope)
    c = rms_norm(ckv[..., :rank], lp.kv_norm, eps)
    k_rope = apply_rope(ckv[:, :, None, rank:], positions, cfg.rope_theta, cfg.rope_scaling)
    cache = cache.write(layer, jnp.concatenate([c, k_rope[:, :, 0]], axis=-1), None, positions)
    sm_scale = mla.qk_head_dim ** -0.5 * softmax_scale_factor(cfg.rope_scaling)
    if prefill:  # per-head K/V from the latent, the flash kernel
        k_nope = jnp.einsum("bsr,hnr->bshn", c, lp.w_uk)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3],
                                                                k_rope.shape[-1]))], axis=-1)
        v = jnp.einsum("bsr,hvr->bshv", c, lp.w_uv)
        q = jnp.concatenate([q[..., :nope], q_rope], axis=-1)
        o = flash_attention(q, k, v, causal=True, sm_scale=sm_scale, impl=cfg.attention_impl)
    else:  # absorbed: q_nope into the latent space, MQA over the cached latents
        q_lat = jnp.einsum("bshn,hnr->bshr", q[..., :nope], lp.w_uk)
        o_lat = cache.attend(layer, jnp.concatenate([q_lat, q_rope], axis=-1), positions,
                             sm_scale=sm_scale)  # (B, S, H, rank)
        o = jnp.einsum("bshr,hvr->bshv", o_lat, lp.w_uv)
    x = x + dense(o.reshape(b, s, -1), lp.o)
    return _ffn(cfg, lp, x), cache


def _routed_experts(cfg, mp: MoEParams, h):
    """An MoE layer's routed experts over h (B, S, d), as model/moe.py's MoE block."""
    b, s, d = h.shape
    h2 = h.reshape(b * s, d)
    logits = jnp.dot(h2, mp.router.T, preferred_element_type=jnp.float32)  # (T, E)
    ids, weights, _ = route(logits, mp.expert_bias, cfg.moe)
    return expert_ffn(h2, ids, weights, mp.gate, mp.up, mp.down,
                      impl=cfg.moe.gmm_impl).reshape(b, s, d)


def _fused_block(cfg, lp: LayerParams, x, positions, cache: ContiguousCache, layer: int):
    """The block in five kernels: norm + q/k/v + RoPE + cache write, attention over the
    cache, output projection + residual, norm + gate/up + SwiGLU, down projection +
    residual. The same numbers as `block`, to rounding. No q/k bias or head norm
    (decode_params never picks it then)."""
    b, s, d = x.shape
    hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    x2 = x.reshape(b * s, d)
    # the q/k/v kernel also zeroes the counters with which the attention kernel merges
    # its context splits in place (no merge kernels after it)
    q, k_cache, v_cache, counters = decode_matmul(
        x2, lp.qkv, norm_scale=lp.attn_norm, eps=cfg.norm_eps, epilogue="qkv",
        positions=positions.reshape(b * s),
        inv_freq=rope_frequencies(hd, cfg.rope_theta, cfg.rope_scaling), q_len=s, q_heads=hq,
        k_cache=cache.k[layer], v_cache=cache.v[layer], zeros=b * hkv, impl="pallas_triton")
    cache = cache.with_layer(layer, k_cache, v_cache)
    o = cache.attend(layer, q.reshape(b, s, hq, hd), positions, window=cfg.sliding_window,
                     impl=cfg.decode_impl, counters=counters)
    x2 = decode_matmul(o.reshape(b * s, -1), lp.o, residual=x2, impl="pallas_triton")
    h = decode_matmul(x2, lp.gate_up, epilogue="glu", norm_scale=lp.mlp_norm, eps=cfg.norm_eps,
                      impl="pallas_triton")
    x2 = decode_matmul(h, lp.down, residual=x2, impl="pallas_triton")
    return x2.reshape(b, s, d), cache


def _positions(start, s: int):
    return start[:, None].astype(jnp.int32) + jnp.arange(s, dtype=jnp.int32)[None]


def forward(params: DecodeParams, tokens, cache, start, *, prefill: bool = False):
    """tokens (B, S) at positions start[b] + i -> (logits (B, S, V), cache, hidden (B, S, d)).

    prefill=True is for rows that start at 0: attention over the new tokens alone is then
    exact (the flash kernel)."""
    b, s = tokens.shape
    fused = (not prefill and b * s <= params.fused_rows
             and isinstance(cache, ContiguousCache))
    x, cache = hidden_states(params, tokens, _positions(start, s), cache, prefill=prefill,
                             fused=fused)
    return logits(params, x), cache, x


def hidden_states(params: DecodeParams, tokens, positions, cache, *, prefill: bool = False,
                  fused: bool = False):
    """tokens (B, S) at any positions (B, S) through every layer -> (hidden (B, S, d),
    cache), before the final norm. The serving engine's flat batches come this way (its
    cache knows which sequence each token belongs to); `forward` is the common case."""
    x = embed(params, tokens)
    for layer, lp in enumerate(params.layers):
        x, cache = block(params.cfg, lp, x, positions, cache, layer, prefill=prefill,
                         fused=fused)
    return x, cache


def mtp_forward(params: DecodeParams, depth: int, h, tokens, cache, start, *,
                prefill: bool = False):
    """MTP module `depth` (0-based; model/mtp.py) over h (B, S, d), the previous depth's
    output (for depth 0 the main model's hidden states after the final norm), and the
    tokens one ahead of each (B, S); its K/V live in layer `depth` of `cache`. Returns
    (this depth's output (B, S, d), normed for `head_logits`; cache)."""
    m, cfg = params.mtp[depth], params.cfg
    x = jnp.concatenate([rms_norm(embed(params, tokens), m.e_norm, cfg.norm_eps),
                         rms_norm(h, m.h_norm, cfg.norm_eps)], axis=-1)
    positions = _positions(start, tokens.shape[1])
    x, cache = block(cfg, m.block, dense(x, m.proj), positions, cache, depth, prefill=prefill)
    return rms_norm(x, m.final_norm, cfg.norm_eps), cache
