"""Sampling from logits: temperature, top-k and top-p (nucleus) masks, greedy at 0."""
from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -jnp.inf


def top_k_mask(logits, k: int):
    """Keep the k largest logits per row (ties at the threshold kept); k <= 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, MASKED, logits)


def top_p_mask(logits, p: float):
    """Keep the smallest set of tokens whose probability reaches p (at least one token)."""
    if p >= 1.0:
        return logits
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
    keep_sorted = before < p  # the first token always has before == 0
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # unsort
    return jnp.where(keep, logits, MASKED)


def process_logits(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Temperature-scaled, top-k then top-p masked float32 logits (temperature > 0)."""
    logits = logits.astype(jnp.float32) / temperature
    return top_p_mask(top_k_mask(logits, top_k), top_p)


def sample(logits, key, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """logits (..., V) -> token ids (...). temperature == 0 is greedy (argmax)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits, temperature, top_k, top_p),
                                  axis=-1).astype(jnp.int32)


def probabilities(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """The distribution `sample` draws from; one-hot on the argmax when temperature == 0."""
    if temperature == 0:
        return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(process_logits(logits, temperature, top_k, top_p), axis=-1)
