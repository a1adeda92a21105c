"""The kernels of the decode program's prefill and decode steps, for `kernel_time.py`.

Prefill and decode (`inference/step.py`: a Python loop over per-layer weights, already in
the compute dtype, so no casts and no stacking): per dense layer the norm, one q/k/v
matmul, RoPE of q and k, the cache writes of k and v, attention (prefill: the flash kernel
over the prompt, after the v slice is made contiguous; decode: the decode kernel reading
the live K/V), o, the residual with the norm (one kernel: XLA fuses an RMSNorm, and the
add before it, into one Triton kernel on a GPU), gate/up, SwiGLU, down, the residual;
prefill's head runs over every prompt position (f32 logits). A step of one row over a contiguous
cache (`params.fused_rows`) runs each layer in five fused kernels (q/k/v with norm, RoPE
and cache write; attention; o with the residual; norm with gate/up and SwiGLU; down with
the residual), each reading its weights. MLA decoding runs the absorbed form: the key
up-projection folded into the query, `kernels.mla_decode` over the live latents (its
context splits merged after it), the value up-projection; a verification step of several
tokens a row runs einsums over the whole buffer (`LatentCache.attend`). MoE decoding runs
the routed experts of `expert_ffn` with the grouped matmul reading the experts the batch's
tokens choose and computing its tiles' rows (`gmm_rows`), after its work items
(GMM_SETUP_KERNELS). Each step adds the embedding, the final norm, the head, the sampling
and the decode loop's own bookkeeping (DECODE_STEP_KERNELS).
"""
from __future__ import annotations

import math

from jaxllm.config import Config, ModelConfig
from jaxllm.kernels.registry import auto_order
from jaxllm.plan.activations import DTYPE_BYTES
from jaxllm.plan.kernel_time import (ROUTING_KERNELS, SORT_KERNELS, Kernel, KernelTime,
                                     attention_flops_fwd, attention_head_dims, heads, repeated,
                                     split)

# Kernels a decode step launches outside the layers: the token's embedding gather, the
# final norm, the head, the sample (an argmax or the sampler), the emitted / done /
# position updates and the loop's counter and condition.
DECODE_STEP_KERNELS = 7
# The grouped-matmul kernel's work items (the groups' row bounds, each item's group and row
# tile: a few small loop-free kernels over [items, experts]), one set a layer: its three
# grouped matmuls share the rows and tiles, so XLA computes them once.
GMM_SETUP_KERNELS = 6
GMM_SETUP_BYTES = 64 * 1024
# Streaming multiprocessors the decode kernels fill with context splits (H100 / H200 SXM).
SMS = 132


def _gemm(m_rows: int, k: int, n: int, c: float, what: str = "matmul",
          out_bytes: float | None = None) -> Kernel:
    out = m_rows * n * c if out_bytes is None else out_bytes
    return Kernel(what, 1, 2 * m_rows * k * n, c * (m_rows * k + k * n) + out, "matmul",
                  (m_rows, k, n))


def _ew(what: str, nbytes: float, launches: int = 1) -> Kernel:
    return Kernel(what, launches, bytes=nbytes / launches)


def _norm(rows: int, dim: int, c: float, residual: bool = False) -> list[Kernel]:
    """An RMSNorm: one kernel on a GPU (XLA fuses the row reduction and the scaling into
    one Triton kernel); with `residual`, the residual add before it too (reading both
    streams, writing the sum and the normalised rows)."""
    x = rows * dim * c
    return [Kernel("norm", 1, bytes=(4 if residual else 2) * x)]


def touched_experts(m: ModelConfig, tokens: int) -> float:
    """Experts of one MoE layer that `tokens` tokens choose, on average (uniform routing)."""
    e, k = m.moe.num_experts, m.moe.top_k
    return e * (1 - (1 - k / e) ** tokens)


def gmm_rows(m: ModelConfig, tokens: int) -> float:
    """Rows the grouped-matmul kernel computes for `tokens` tokens' tokens x top_k rows: a
    row tile straddling group boundaries is computed once for each of its groups, so about
    the rows + each touched expert's (tile rows - 1) (`gmm_triton.tiles`: its tiles follow
    the rows per expert; 16 for a decode step's few, 128 for a prefill's hundreds)."""
    from jaxllm.kernels.pallas.gmm_triton import tiles

    e = m.moe
    rows = tokens * e.top_k
    bm = tiles(rows, e.num_experts, e.expert_mlp_dim)[0]
    return rows + touched_experts(m, tokens) * (bm - 1)


def _ffn_kernels(m: ModelConfig, T: int, c: float, tp: int, moe: bool) -> list[Kernel]:
    d = m.d_model
    X = T * d * c
    hq, hkv, f = heads(m, tp)
    ks = _norm(T, d, c, residual=True)  # the attention's residual and the second norm
    if moe:
        e = m.moe
        fe, R = e.expert_mlp_dim, T * e.top_k
        TE = T * e.num_experts * 4
        g = touched_experts(m, T)
        w = g * d * fe  # the chosen experts' weights of one projection
        Rc = gmm_rows(m, T)  # the rows its tiles compute
        ks += [_gemm(T, d, e.num_experts, c, out_bytes=TE),
               _ew("routing", ROUTING_KERNELS * 2 * TE, ROUTING_KERNELS),
               _ew("sort", 2 * SORT_KERNELS * 2 * R * 4 + 2 * R * 4, 2 * SORT_KERNELS + 2),
               _ew("routing", GMM_SETUP_BYTES, GMM_SETUP_KERNELS),  # the kernel's work items
               _ew("dispatch", 2 * R * d * c),
               Kernel("grouped matmul", 2, 2 * Rc * d * fe, c * (R * d + w + R * fe), "gmm",
                      (R, d, fe, e.num_experts)),
               _ew("elementwise", 3 * R * fe * c),
               Kernel("grouped matmul", 1, 2 * Rc * d * fe, c * (R * fe + w + R * d), "gmm",
                      (R, fe, d, e.num_experts)),
               _ew("dispatch", 2 * R * d * c + R * d * c + X, 2)]  # gather back, weighted sum
        f = e.num_shared_experts * fe
        if f:
            ks.append(_ew("elementwise", 3 * X))  # + the shared experts' output
    if f:
        ks += [_gemm(T, d, 2 * f, c), _ew("elementwise", 3 * T * f * c), _gemm(T, f, d, c)]
    return ks + [_ew("elementwise", 3 * X)]  # the residual


def _gqa_layer(m: ModelConfig, B: int, S: int, ctx: int, c: float, tp: int, prefill: bool,
               fused: bool, moe: bool) -> list[Kernel]:
    d, hd = m.d_model, m.resolved_head_dim
    hq, hkv, f = heads(m, tp)
    T = B * S
    X, Q, K = T * d * c, T * hq * hd * c, T * hkv * hd * c
    kv_read = 2 * B * hkv * ctx * hd * c  # the live K/V of every row
    if fused:  # the five fused kernels, each reading its weights (`decode_gemv`)
        n_qkv = (hq + 2 * hkv) * hd
        return [Kernel("matmul", 1, 2 * T * d * n_qkv, X + c * d * n_qkv + Q + 2 * K, "gemv",
                       (T, d, n_qkv)),
                Kernel("attention", 1, bytes=kv_read + 2 * Q),
                Kernel("matmul", 1, 2 * T * hq * hd * d, Q + c * hq * hd * d + 2 * X, "gemv",
                       (T, hq * hd, d)),
                Kernel("matmul", 1, 2 * T * d * 2 * f, X + c * d * 2 * f + T * f * c, "gemv",
                       (T, d, 2 * f)),
                Kernel("matmul", 1, 2 * T * f * d, T * f * c + c * f * d + 2 * X, "gemv",
                       (T, f, d))]
    ks = _norm(T, d, c) + [_gemm(T, d, (hq + 2 * hkv) * hd, c), _ew("rope", 2 * (Q + K), 2),
                           _ew("cache write", 4 * K, 2)]
    if prefill:
        ks += [_ew("copy", 2 * K),  # v made contiguous for the kernel
               Kernel("attention", 1, attention_flops_fwd(m, B, S, S, hq), Q + 2 * K + Q,
                      "attn_fwd")]
    else:
        ks.append(Kernel("attention", 1, 4 * B * hq * S * ctx * hd, kv_read + 2 * Q))
    ks.append(_gemm(T, hq * hd, d, c))
    return ks + _ffn_kernels(m, T, c, tp, moe)


def mla_decode_splits(m: ModelConfig, B: int, cache_len: int, sms: int = SMS) -> int:
    """Context splits of one MLA decode call over a contiguous cache of `cache_len` tokens
    (`LatentCache.attend`: pages of gcd(cache_len, 64) tokens): the default of the kernel
    "auto" picks for the model's heads."""
    from jaxllm.kernels.pallas import mla_mosaic, mla_triton

    kernel = (mla_mosaic if auto_order("mla", "gpu", rows=m.n_heads)[0] == "pallas_mosaic"
              else mla_triton)
    page = math.gcd(cache_len, 64)
    return kernel.default_splits(B, m.n_heads, cache_len // page, page, sms)


def _mla_decode_kernels(m: ModelConfig, B: int, ctx: int, cache_len: int, c: float
                        ) -> list[Kernel]:
    """`kernels.mla_decode` for B rows of one token over `ctx` live latents: it reads
    those latents once for every head (MQA over the latent: scores over rank + rope
    columns, values over the rank); with several splits, partials in float32 and their
    log-sum-exp merge (a reduction, then the weighted sum)."""
    a, H = m.mla, m.n_heads
    r, dk = a.kv_lora_rank, a.kv_lora_rank + a.qk_rope_head_dim
    splits = mla_decode_splits(m, B, cache_len)
    out = B * H * r * (c if splits == 1 else 4 * splits) + (B * H * splits * 4 if splits > 1
                                                             else 0)
    ks = [Kernel("attention", 1, 2 * B * H * ctx * (dk + r),
                 B * ctx * dk * c + B * H * dk * c + out)]
    if splits > 1:
        ks.append(_ew("attention", out + B * H * r * c, 2))
    return ks


def _mla_layer(m: ModelConfig, B: int, S: int, ctx: int, cache_len: int, c: float,
               prefill: bool, moe: bool) -> list[Kernel]:
    a, d, H = m.mla, m.d_model, m.n_heads
    nope, rope, dv, r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    T = B * S
    Q = T * H * a.qk_head_dim * c
    ks = _norm(T, d, c)
    q_in = d
    if a.q_lora_rank:
        ks += [_gemm(T, d, a.q_lora_rank, c), *_norm(T, a.q_lora_rank, c)]
        q_in = a.q_lora_rank
    ks += [_gemm(T, q_in, H * a.qk_head_dim, c), _ew("rope", 2 * T * H * rope * c),
           _gemm(T, d, r + rope, c), *_norm(T, r, c), _ew("rope", 2 * T * rope * c),
           _ew("cache write", 2 * T * (r + rope) * c)]
    if prefill:
        K = T * H * a.qk_head_dim * c
        Vb = T * H * dv * c
        ks += [_gemm(T, r, H * nope, c), _ew("elementwise", K + T * H * nope * c, 1),
               _gemm(T, r, H * dv, c), _ew("elementwise", 2 * Q)]  # k, v; q's concatenate
        dqk_p = attention_head_dims(m, padded=True)[0]
        if dqk_p != a.qk_head_dim:  # the Triton kernel's padded q and k
            ks.append(_ew("copy", 2 * (Q + K) * (1 + dqk_p / a.qk_head_dim) / 2, 2))
        ks.append(Kernel("attention", 1, attention_flops_fwd(m, B, S, S, H), 2 * Q + 2 * Vb,
                         "attn_fwd"))
    elif S == 1:  # q into the latent, [q_lat | q_rope], the MLA decode kernel (+ merge)
        ks += [Kernel("matmul", 1, 2 * T * H * nope * r, c * (T * H * nope + H * nope * r
                                                              + T * H * r)),
               _ew("elementwise", 2 * T * H * (r + rope) * c),
               *_mla_decode_kernels(m, B, ctx, cache_len, c),
               Kernel("matmul", 1, 2 * T * H * r * dv, c * (T * H * r + H * r * dv + T * H * dv))]
    else:  # several tokens a row (verification): einsums over the whole buffer
        lat = B * cache_len * (r + rope) * c
        sc = B * H * S * cache_len * 4
        ks += [Kernel("matmul", 1, 2 * T * H * nope * r, c * (T * H * nope + H * nope * r
                                                              + T * H * r)),  # q into the latent
               _ew("elementwise", 2 * T * H * (r + rope) * c),  # [q_lat | q_rope]
               Kernel("attention", 1, 2 * T * H * cache_len * (r + rope), lat + sc),  # scores
               _ew("attention", 2 * sc),  # scale and mask
               _ew("attention", 3 * sc, 3),  # softmax: max, sum, normalise (compute dtype)
               _ew("copy", 2 * B * cache_len * r * c),  # the latent's value part
               Kernel("attention", 1, 2 * T * H * cache_len * r, B * cache_len * r * c + sc / 2),
               Kernel("matmul", 1, 2 * T * H * r * dv, c * (T * H * r + H * r * dv + T * H * dv))]
    ks.append(_gemm(T, H * dv, d, c))
    return ks + _ffn_kernels(m, T, c, 1, moe)


def inference_kernels(cfg: Config, batch: int, new: int, ctx: int, *, prefill: bool,
                      tp: int = 1, fused: bool = False, cache_len: int | None = None
                      ) -> KernelTime:
    """The kernels of one call of `inference/step.py`'s `forward`: `batch` rows of `new`
    tokens over `ctx` cached ones (prefill: new = the prompt), plus, for a decode step,
    the sampling and the loop's bookkeeping."""
    m = cfg.model
    c = DTYPE_BYTES[m.dtype]
    d = m.d_model
    V = split(m.vocab_size, tp)
    T = batch * new
    n_moe = 0 if m.moe is None else m.n_layers - m.moe.dense_layers
    cache_len = cache_len or ctx
    ks: list[Kernel] = []
    for moe, count in ((False, m.n_layers - n_moe), (True, n_moe)):
        if not count:
            continue
        if m.mla is not None:
            one = _mla_layer(m, batch, new, ctx, cache_len, c, prefill, moe)
        else:
            one = _gqa_layer(m, batch, new, ctx, c, tp, prefill, fused and not moe, moe)
        ks += repeated(one, count)
    ks += [_ew("embedding", 2 * T * d * c), *_norm(T, d, c),
           _gemm(T, d, V, c, out_bytes=T * V * 4)]
    if prefill:  # the cache's zeroing, the last position's logits and the sample
        per_layer = (cache_len * (m.mla.latent_dim if m.mla is not None
                                  else 2 * m.n_kv_heads * m.resolved_head_dim) * c)
        ks += [Kernel("cache write", m.n_layers * (1 if m.mla is not None else 2),
                      bytes=batch * per_layer / (1 if m.mla is not None else 2)),
               _ew("sampling", batch * V * 4, 2)]
    else:
        ks.append(Kernel("sampling", DECODE_STEP_KERNELS - 3, bytes=batch * V * 4
                         / (DECODE_STEP_KERNELS - 3)))
    return KernelTime("prefill" if prefill else f"decode B={batch}", tuple(ks))


