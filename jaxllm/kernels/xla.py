"""Kernels as XLA ops: attention as plain einsums (`xla`) or cuDNN's fused kernel
(`cudnn`), and the fused decode matmul as einsums (`xla`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels.reference import NEG_INF, causal_mask, gemv_epilogue, rms_norm


def xla_attention(q, k, v, *, causal: bool, sm_scale: float):
    """Matmuls in the input dtype, softmax statistics in float32; K/V never repeated."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, hkv, hq // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if causal:
        s = jnp.where(causal_mask(sq, skv), s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v)
    return o.reshape(b, sq, hq, v.shape[-1])


def cudnn_unsupported_reason(q, k, v) -> str | None:
    """None when `jax.nn.dot_product_attention` takes these inputs, else why not."""
    if k.shape[-1] != v.shape[-1]:
        return (f"cudnn (through jax.nn.dot_product_attention) takes one head dim for k and "
                f"v; got {k.shape[-1]} and {v.shape[-1]}")
    return None


def cudnn_attention(q, k, v, *, causal: bool, sm_scale: float):
    """cuDNN fused attention. Causal with Sq != Skv is given as an explicit bottom-right mask."""
    sq, skv = q.shape[1], k.shape[1]
    if causal and sq != skv:
        mask = causal_mask(sq, skv)[None, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=sm_scale,
                                            implementation="cudnn")
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,
                                        implementation="cudnn")


def cached_attention(q, k_cache, v_cache, q_positions, window: int | None = None,
                     sm_scale: float | None = None):
    """Attention of new queries over a contiguous cache, masking keys after each query.

    q (B, S, Hq, D); k_cache/v_cache (B, Hkv, T, D), key t at position t; q_positions int
    (B, S). With a `window`, keys at positions <= query position - window are masked too.
    K/V are read once per group of query heads (no repeat). Softmax in float32.
    `sm_scale` defaults to 1/sqrt(D).
    """
    b, s, hq, d = q.shape
    hkv, t = k_cache.shape[1], k_cache.shape[2]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    qg = q.reshape(b, s, hkv, hq // hkv, d)
    scores = jnp.einsum("bshgd,bhtd->bhgst", qg, k_cache,
                        preferred_element_type=jnp.float32) * sm_scale
    key_pos, q_pos = jnp.arange(t)[None, None, :], q_positions[:, :, None]
    visible = key_pos <= q_pos  # (B, S, T)
    if window is not None:
        visible &= key_pos > q_pos - window
    scores = jnp.where(visible[:, None, None], scores, NEG_INF)
    p = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    o = jnp.einsum("bhgst,bhtd->bshgd", p, v_cache)
    return o.reshape(b, s, hq, v_cache.shape[-1])


def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale: float, counters=None):
    """The S new tokens of row b at positions lengths[b] - S .. lengths[b] - 1 over a
    contiguous cache [B, Hkv, T, D] (see kernels.decode_attention), as einsums.
    `counters` go unused: there are no context splits to merge."""
    s = q.shape[1]
    positions = lengths[:, None] - s + jnp.arange(s)[None]
    return cached_attention(q, k_cache, v_cache, positions, sm_scale=sm_scale)


def decode_gemv(x, w, *, norm_scale=None, eps=None, residual=None, epilogue="none",
                positions=None, inv_freq=None, q_len=1, q_heads=0, k_cache=None,
                v_cache=None, zeros: int = 0):
    """`kernels.decode_matmul` as einsums: the product in x's dtype accumulated in float32,
    the norm and the epilogue as the reference computes them (the arguments and results of
    `kernels.pallas.gemv_triton.decode_gemv`, the `zeros` output included)."""
    h = x if norm_scale is None else rms_norm(x, norm_scale, eps)
    y = jnp.einsum("mk,...k->m...", h, w.astype(x.dtype), preferred_element_type=jnp.float32)
    out = gemv_epilogue(y, x.dtype, residual=residual, epilogue=epilogue, positions=positions,
                        inv_freq=inv_freq, q_len=q_len, q_heads=q_heads, k_cache=k_cache,
                        v_cache=v_cache)
    return (*out, jnp.zeros((zeros,), jnp.int32)) if zeros else out


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """`jax.lax.ragged_dot`: on the GPU XLA lowers it to a padded dense product."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                              preferred_element_type=preferred_element_type or lhs.dtype)
