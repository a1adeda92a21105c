"""Random attention inputs shared by the flash-attention kernel tests."""
import jax
import jax.numpy as jnp
import numpy as np


def flash_inputs(seed, b, sq, skv, hq, hkv, d, causal, dtype, dv=None):
    """q, k, v, do, dlse and `seen` (which query rows see at least one key); v and do are
    dv wide (default d).

    Causal with Sq > Skv: the first Sq - Skv queries see no key. The kernels define them
    as o = 0, lse = -inf; the reference does not, so the cotangents are zeroed there and
    those rows are checked separately.
    """
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, skv, hkv, d), jnp.float32).astype(dtype)
    dv = d if dv is None else dv
    v = jax.random.normal(ks[2], (b, skv, hkv, dv), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, hq, dv), jnp.float32).astype(dtype)
    dlse = jax.random.normal(ks[4], (b, hq, sq), jnp.float32)
    seen = np.arange(sq) >= (sq - skv if causal else 0)
    return q, k, v, do * seen[None, :, None, None], dlse * seen[None, None, :], seen
