"""Plain-jnp references of every kernel: the specification the kernels are tested against.

Everything is computed in float32 and cast back to the query dtype. These functions
favour clarity over speed; they materialise the full score matrix.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked rows give exp(-inf - -inf) problems never
EXACT = jax.lax.Precision.HIGHEST  # true float32 products on GPUs too (no TF32)


def causal_mask(sq: int, skv: int) -> jax.Array:
    """Bottom-right aligned causal mask [Sq, Skv]: query i sees keys j <= i + (Skv - Sq)."""
    qi = jnp.arange(sq)[:, None]
    kj = jnp.arange(skv)[None, :]
    return kj <= qi + (skv - sq)


def attention_scores(q, k, sm_scale):
    """Scores [B, Hkv, G, Sq, Skv] in float32, GQA groups kept apart (no repeated K)."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, hq // hkv, d).astype(jnp.float32)
    return jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=EXACT) * sm_scale


def flash_attention_with_lse(q, k, v, *, causal: bool = True, sm_scale: float | None = None):
    """Attention and its log-sum-exp.

    q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv] -> (o [B, Sq, Hq, Dv] in
    q.dtype, lse [B, Hq, Sq] float32, the natural log of the softmax denominator, scale
    included).
    """
    b, sq, hq, d = q.shape
    skv = k.shape[1]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    s = attention_scores(q, k, sm_scale)  # (B, Hkv, G, Sq, Skv)
    if causal:
        s = jnp.where(causal_mask(sq, skv), s, NEG_INF)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - m)
    l = p.sum(-1, keepdims=True)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / l, v.astype(jnp.float32), precision=EXACT)
    lse = (m + jnp.log(l))[..., 0].reshape(b, hq, sq)
    return o.reshape(b, sq, hq, v.shape[-1]).astype(q.dtype), lse


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None):
    """q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [.., Dv] -> o [B, Sq, Hq, Dv]; see
    kernels.flash_attention."""
    return flash_attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale)[0]


def gather_pages(pages, block_tables):
    """pages [Hkv, P, page, D], block_tables [B, n] -> contiguous [B, n * page, Hkv, D]."""
    g = pages[:, block_tables]  # (Hkv, B, n, page, D)
    hkv, b, n, ps, d = g.shape
    return g.reshape(hkv, b, n * ps, d).transpose(1, 2, 0, 3)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale: float | None = None,
                    layer=None):
    """Single-token decode attention over a paged KV cache.

    q [B, Hq, D]; k_pages/v_pages [Hkv, num_pages, page_size, D], or a layer stack
    [L, Hkv, num_pages, page_size, D] with `layer` naming the one to read; block_tables
    int32 [B, max_pages]; lengths int32 [B]. Sequence b attends to its first lengths[b]
    cached tokens; a length of 0 gives zeros.
    """
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    b, hq, d = q.shape
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    k = gather_pages(k_pages, block_tables)
    v = gather_pages(v_pages, block_tables)
    s = attention_scores(q[:, None], k, sm_scale)[:, :, :, 0]  # (B, Hkv, G, S)
    valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]  # (B, S)
    s = jnp.where(valid[:, None, None, :], s, NEG_INF)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    p = jnp.where(valid[:, None, None, :], p, 0.0)
    denom = jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    o = jnp.einsum("bhgk,bkhd->bhgd", p / denom, v.astype(jnp.float32), precision=EXACT)
    return o.reshape(b, hq, d).astype(q.dtype)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_starts, *,
                           sm_scale: float | None = None, layer=None,
                           max_q_len: int | None = None):
    """Mixed prefill/decode attention of a flat token batch over a paged KV cache.

    q [T, Hq, D]: sequence s's new tokens are rows q_starts[s] .. q_starts[s+1] - 1; they
    are the last q_len of its kv_lens[s] cached tokens, and new token i sees keys
    0 .. kv_lens[s] - q_len + i. Rows at or past q_starts[S] give zeros. k/v pages
    [Hkv, P, page, D] (or [L, ...] with `layer`); block_tables [S, W]. One sequence at a
    time (a scan over S): its keys against every row, kept only for the rows it owns.
    max_q_len is the kernels' hint (no sequence has more new tokens) and changes nothing.
    """
    del max_q_len
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    t, hq, d = q.shape
    hkv, _, page, _ = k_pages.shape
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    n_keys = block_tables.shape[1] * page
    qg = q.reshape(t, hkv, hq // hkv, d).astype(jnp.float32)
    rows, keys = jnp.arange(t), jnp.arange(n_keys)

    def one_sequence(out, s):
        start, end, kv_len = q_starts[s], q_starts[s + 1], kv_lens[s]
        k = gather_pages(k_pages, block_tables[s][None])[0].astype(jnp.float32)  # (W*page, Hkv, D)
        v = gather_pages(v_pages, block_tables[s][None])[0].astype(jnp.float32)
        owned = (rows >= start) & (rows < end)  # (T,)
        pos = kv_len - (end - start) + (rows - start)  # each row's own position
        seen = owned[:, None] & (keys[None, :] <= pos[:, None]) & (keys[None, :] < kv_len)
        sc = jnp.einsum("thgd,khd->hgtk", qg, k, precision=EXACT) * sm_scale
        sc = jnp.where(seen, sc, NEG_INF)
        p = jnp.where(seen, jnp.exp(sc - sc.max(-1, keepdims=True)), 0.0)
        p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
        o = jnp.einsum("hgtk,khd->thgd", p, v, precision=EXACT).reshape(t, hq, d)
        return jnp.where(owned[:, None, None], o, out), None

    out, _ = jax.lax.scan(one_sequence, jnp.zeros((t, hq, d), jnp.float32),
                          jnp.arange(kv_lens.shape[0]))
    return out.astype(q.dtype)


def rms_norm(x, scale, eps):
    """x / rms(x) * scale in float32, returned in x's dtype (as model.layers.RMSNorm)."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (h * scale.astype(jnp.float32)).astype(x.dtype)


def decode_gemv(x, w, *, norm_scale=None, eps=None, residual=None, epilogue="none",
                positions=None, inv_freq=None, q_len=1, q_heads=0, k_cache=None,
                v_cache=None):
    """`kernels.decode_matmul` step by step in float32 (the arguments and results of
    `kernels.pallas.gemv_triton.decode_gemv`, without its `zeros`)."""
    h = x if norm_scale is None else rms_norm(x, norm_scale, eps)
    y = jnp.einsum("mk,...k->m...", h.astype(jnp.float32), w.astype(jnp.float32),
                   precision=EXACT)
    return gemv_epilogue(y, x.dtype, residual=residual, epilogue=epilogue,
                         positions=positions, inv_freq=inv_freq, q_len=q_len,
                         q_heads=q_heads, k_cache=k_cache, v_cache=v_cache)


def gemv_epilogue(y, dtype, *, residual, epilogue, positions, inv_freq, q_len, q_heads,
                  k_cache, v_cache):
    """The epilogue of `decode_gemv` on the float32 product y [M, *outputs], in `dtype`."""
    f32 = jnp.float32
    if epilogue == "none":
        if residual is not None:
            y = y + residual.astype(f32)
        return y.astype(dtype)
    if epilogue == "glu":
        return (jax.nn.silu(y[:, 0]) * y[:, 1]).astype(dtype)
    # "qkv": y [M, H, D]
    kv_heads = (y.shape[1] - q_heads) // 2
    angle = positions.astype(f32)[:, None, None] * inv_freq.astype(f32)  # [M, 1, D/2]
    a, b = jnp.split(y[:, :q_heads + kv_heads], 2, axis=-1)
    roped = jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle),
                             b * jnp.cos(angle) + a * jnp.sin(angle)], axis=-1)
    q, k = roped[:, :q_heads], roped[:, q_heads:]
    v = y[:, q_heads + kv_heads:]
    rows = jnp.arange(y.shape[0]) // q_len
    k_cache = k_cache.at[rows, :, positions].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[rows, :, positions].set(v.astype(v_cache.dtype))
    return q.astype(dtype), k_cache, v_cache


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """out[m] = lhs[m] @ rhs[g(m)], rows sorted by group: group g owns the group_sizes[g]
    rows after those of groups 0 .. g-1; rows past sum(group_sizes) give zeros. Every
    group's product over all rows, kept where the row belongs (a spec, not fast)."""
    out_dtype = preferred_element_type or lhs.dtype
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])
    group = jnp.searchsorted(ends, rows, side="right")  # G for rows past the last group
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for g in range(rhs.shape[0]):
        y = jnp.dot(lhs, rhs[g], preferred_element_type=jnp.float32)
        out = jnp.where((group == g)[:, None], y, out)
    return out.astype(out_dtype)


def mla_decode(q, kv_pages, block_tables, lengths, *, v_dim: int, sm_scale: float | None = None,
               layer=None):
    """Absorbed multi-head latent attention decode over a paged latent cache.

    q [B, Hq, Dk]; kv_pages [P, page, Dk] (or [L, P, page, Dk] with `layer`): one latent
    row per token, shared by every head, the key the whole row and the value its first
    v_dim columns; block_tables [B, W]; lengths [B] (0 gives zeros). -> [B, Hq, v_dim].
    """
    if layer is not None:
        kv_pages = kv_pages[layer]
    d = q.shape[-1]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    kv = gather_pages(kv_pages[None], block_tables)[:, :, 0].astype(jnp.float32)  # (B, S, Dk)
    s = jnp.einsum("bhd,bkd->bhk", q.astype(jnp.float32), kv, precision=EXACT) * sm_scale
    valid = (jnp.arange(kv.shape[1])[None, :] < lengths[:, None])[:, None, :]  # (B, 1, S)
    s = jnp.where(valid, s, NEG_INF)
    p = jnp.where(valid, jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    o = jnp.einsum("bhk,bkd->bhd", p, kv[..., :v_dim], precision=EXACT)
    return o.astype(q.dtype)
