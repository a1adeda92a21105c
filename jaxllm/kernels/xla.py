"""Attention through XLA: plain einsums (`xla`) and cuDNN's fused kernel (`cudnn`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels.reference import NEG_INF, causal_mask


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
    return o.reshape(b, sq, hq, d)


def cudnn_attention(q, k, v, *, causal: bool, sm_scale: float):
    """cuDNN fused attention. Causal with Sq != Skv is given as an explicit bottom-right mask."""
    sq, skv = q.shape[1], k.shape[1]
    if causal and sq != skv:
        mask = causal_mask(sq, skv)[None, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=sm_scale,
                                            implementation="cudnn")
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,
                                        implementation="cudnn")
