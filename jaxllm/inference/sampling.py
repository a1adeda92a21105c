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


def sample_rows(logits, keys, temperature, top_k, top_p):
    """Per-row options: logits (N, V); keys (N,) typed PRNG keys; temperature, top_p float32
    (N,) and top_k int32 (N,) arrays -> token ids (N,). Rows at temperature 0 are greedy;
    top_k 0 and top_p 1 are off. Ties at a top-k or top-p threshold are kept. Every row
    goes through the sort (no device-side branch: see inference/runner.py); a caller whose
    rows are all greedy takes the argmax instead."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    v = logits.shape[-1]
    x = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    desc = -jnp.sort(-x, axis=-1)  # (N, V), largest first
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    ranks = jnp.arange(v)[None]
    desc = jnp.where(ranks < k[:, None], desc, MASKED)  # top-k on the sorted copy
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = jnp.sum((before < top_p[:, None]) & (ranks < k[:, None]), axis=-1)  # >= 1
    threshold = jnp.take_along_axis(desc, (keep - 1)[:, None], axis=-1)
    x = jnp.where(x < threshold, MASKED, x)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, x)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)
