# placeholder until the ragged kernel branch lands
import jax
import jax.numpy as jnp
from jaxllm.kernels.reference import gather_pages


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_starts, *,
                           sm_scale=None, impl="auto", layer=None):
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    t, hq, d = q.shape
    s = kv_lens.shape[0]
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    rows = jnp.arange(t)
    seq = jnp.clip(jnp.searchsorted(q_starts, rows, side="right") - 1, 0, s - 1)
    valid = rows < q_starts[s]
    q_len = q_starts[1:] - q_starts[:-1]
    pos = kv_lens[seq] - q_len[seq] + rows - q_starts[seq]
    k = gather_pages(k_pages, block_tables)[seq]  # [T, n, Hkv, D]
    v = gather_pages(v_pages, block_tables)[seq]
    hkv = k.shape[2]
    qg = q.reshape(t, hkv, hq // hkv, d)
    sc = jnp.einsum("thgd,tnhd->thgn", qg, k, preferred_element_type=jnp.float32) * sm_scale
    vis = (jnp.arange(k.shape[1])[None] <= pos[:, None]) & valid[:, None]
    sc = jnp.where(vis[:, None, None], sc, -1e30)
    p = jnp.exp(sc - sc.max(-1, keepdims=True)) * vis[:, None, None]
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    o = jnp.einsum("thgn,tnhd->thgd", p, v.astype(jnp.float32))
    return o.reshape(t, hq, d).astype(q.dtype)
