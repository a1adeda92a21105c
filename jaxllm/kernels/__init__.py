"""The kernels, one entry point per op: `flash_attention`, `paged_attention`,
`ragged_paged_attention` (a serving step's mixed prefill and decode tokens over the paged
KV cache), `decode_attention` (a few new tokens over a contiguous KV cache) and
`decode_matmul` (a decode step's weight read with its norm, RoPE, cache write, SwiGLU or
residual folded in), `grouped_matmul` (one matmul per group of rows: MoE experts) and
`mla_decode` (multi-head latent attention decode over a paged latent cache).

`impl` names the implementation; "auto" takes the fastest one that runs here and takes
the inputs. Which implementations exist and what each supports is `registry.py`: `pick`,
`names` and `available` are re-exported here, and nothing else chooses a kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels.registry import available, names, pick


def _check_flash_inputs(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"flash_attention wants q, k, v of rank 4 [B, S, H, D]; got "
                         f"q{q.shape} k{k.shape} v{v.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k{k.shape} and v{v.shape} must agree in batch, length and heads "
                         f"(their head dims may differ)")
    b, sq, hq, d = q.shape
    bk, skv, hkv, dk = k.shape
    if b != bk or d != dk:
        raise ValueError(f"q{q.shape} and k{k.shape} disagree in batch or head_dim")
    if sq < 1 or skv < 1:
        raise ValueError(f"sequence lengths must be >= 1; got Sq={sq}, Skv={skv}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not divisible by kv heads {hkv}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point; got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                    impl: str = "auto", **kwargs):
    """Multi-head attention, q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv]
    -> [B, Sq, Hq, Dv].

    Hq % Hkv == 0 (MHA, GQA, MQA). The value head dim Dv may differ from the query-key
    dim D (MLA: D = nope + rope dims, Dv = v_head_dim). Causal with Sq != Skv is
    bottom-right aligned: query i sees keys j <= i + (Skv - Sq). `sm_scale` defaults to
    1/sqrt(D). Differentiable. Extra keyword arguments (e.g. block sizes) go to the
    chosen implementation.
    """
    _check_flash_inputs(q, k, v)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    fn = pick("flash", impl, q, k, v).fn
    with jax.named_scope("flash_attention"):  # names the kernels in profiles
        return fn(q, k, v, causal=causal, sm_scale=sm_scale, **kwargs)


def _check_pages(op: str, q_layout: str, q, k_pages, v_pages, layer) -> None:
    """The checks the paged ops share: q of rank 3, pages [Hkv, P, page, D] (or a layer
    stack with `layer`), matching head dims and a whole number of query heads per kv head."""
    if q.ndim != 3 or k_pages.ndim not in (4, 5) or k_pages.shape != v_pages.shape:
        raise ValueError(f"{op} wants q {q_layout} and k/v pages [Hkv, P, page, D] (or "
                         f"[L, Hkv, P, page, D] with layer=); got q{q.shape} "
                         f"k{k_pages.shape} v{v_pages.shape}")
    if (k_pages.ndim == 5) != (layer is not None):
        raise ValueError(f"layer={layer!r} goes with k/v pages of rank 5 [L, Hkv, P, page, D], "
                         f"and only with them; got pages{k_pages.shape}")
    if q.shape[-1] != k_pages.shape[-1] or q.shape[1] % k_pages.shape[-4]:
        raise ValueError(f"q{q.shape} does not fit pages{k_pages.shape}: head_dim must match "
                         f"and Hq must be a multiple of Hkv")


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale: float | None = None,
                    impl: str = "auto", layer=None, **kwargs):
    """Decode attention over a paged KV cache.

    q [B, Hq, D]; k_pages/v_pages [Hkv, num_pages, page_size, D], or a layer stack
    [L, Hkv, num_pages, page_size, D] with `layer` (an int or traced int32 scalar) naming
    the layer to read in place; block_tables int32 [B, max_pages_per_seq]; lengths int32
    [B] (0 allowed: the output row is zeros).
    """
    _check_pages("paged_attention", "[B, Hq, D]", q, k_pages, v_pages, layer)
    if block_tables.ndim != 2 or lengths.shape != (q.shape[0],):
        raise ValueError(f"block_tables must be [B, n] and lengths [B]; got "
                         f"{block_tables.shape} and {lengths.shape}")
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    fn = pick("paged", impl, q, k_pages).fn
    return fn(q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, layer=layer,
              **kwargs)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, q_starts, *,
                           sm_scale: float | None = None, impl: str = "auto", layer=None,
                           **kwargs):
    """Attention of a flat batch of new tokens from many sequences over a paged KV cache.

    q [T, Hq, D]: sequence s's new tokens are rows q_starts[s] .. q_starts[s+1]-1;
    q_starts int32 [S+1], non-decreasing, q_starts[0] == 0, q_starts[S] <= T; rows at or
    past q_starts[S] are padding and give zeros. kv_lens int32 [S]: the tokens of sequence s
    in the cache, its new ones included (they are the last q_len = q_starts[s+1]-q_starts[s]
    of them and are already written), so new token i of s sits at position
    kv_lens[s] - q_len + i and sees keys 0 .. that position (causal within the sequence).
    A sequence with q_len 0 contributes nothing (padding sequences: q_len 0, kv_len 0).
    k_pages/v_pages [Hkv, P, page, D], or [L, Hkv, P, page, D] with `layer` (int or traced
    int32 scalar; read in place, no slicing copy). block_tables int32 [S, W]; token t of s is
    in page block_tables[s, t // page] at offset t % page. Hq % Hkv == 0. -> [T, Hq, D] in
    q's dtype. `max_q_len=n` (a static int) promises that no sequence has more than n new
    tokens, so an implementation may leave out its work for longer ones (a decode step:
    n = 1). Extra keyword arguments (block sizes) go to the chosen implementation.
    """
    _check_pages("ragged_paged_attention", "[T, Hq, D]", q, k_pages, v_pages, layer)
    if block_tables.ndim != 2 or kv_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables must be [S, W] and kv_lens [S]; got "
                         f"{block_tables.shape} and {kv_lens.shape}")
    if q_starts.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"q_starts must be [S + 1] = [{block_tables.shape[0] + 1}] for "
                         f"block_tables {block_tables.shape}; got {q_starts.shape}")
    for name, x in (("block_tables", block_tables), ("kv_lens", kv_lens),
                    ("q_starts", q_starts)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers (int32); got {x.dtype}")
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    fn = pick("ragged", impl, q, k_pages).fn
    return fn(q, k_pages, v_pages, block_tables, kv_lens, q_starts, sm_scale=sm_scale,
              layer=layer, **kwargs)


def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale: float | None = None,
                     impl: str = "auto", counters=None, **kwargs):
    """New tokens over a contiguous KV cache: decoding (S = 1) and speculative verification.

    q [B, S, Hq, D]: row b's S new tokens sit at positions lengths[b] - S .. lengths[b] - 1
    and are already written to the cache; query s sees keys 0 .. lengths[b] - S + s.
    k_cache/v_cache [B, Hkv, T, D] (the contiguous cache's per-layer layout);
    lengths int32 [B], S <= lengths[b] <= T. -> [B, S, Hq, D].
    counters: optional int32 zeros [B * Hkv] scratch (e.g. `decode_matmul`'s `zeros`);
    `pallas_triton` then merges a context split over several programs inside its kernel
    (the other impls have no splits and leave it unused).
    """
    if q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention wants q [B, S, Hq, D] and k/v [B, Hkv, T, D]; got "
                         f"q{q.shape} k{k_cache.shape} v{v_cache.shape}")
    b, _, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or hq % k_cache.shape[1]:
        raise ValueError(f"q{q.shape} does not fit the cache {k_cache.shape}: batch and "
                         f"head_dim must match and Hq must be a multiple of Hkv")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B]={b}; got {lengths.shape}")
    sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    fn = pick("decode", impl, q, k_cache).fn
    return fn(q, k_cache, v_cache, lengths, sm_scale=sm_scale, counters=counters, **kwargs)


_EPILOGUES = ("none", "glu", "qkv")


def decode_matmul(x, w, *, norm_scale=None, eps: float | None = None, residual=None,
                  epilogue: str = "none", positions=None, inv_freq=None, q_len: int = 1,
                  q_heads: int = 0, k_cache=None, v_cache=None, zeros: int = 0,
                  impl: str = "auto", **kwargs):
    """out = epilogue(prologue(x) @ w^T) for the few rows x [M, K] of a decode step.

    prologue: with `norm_scale` [K] and `eps`, x becomes rmsnorm(x) * norm_scale.
    epilogue ("none", "glu" or "qkv"; weights out-major):
      "none": w [N, K] -> [M, N], plus `residual` [M, N] if given;
      "glu":  w [2, R, K] (gate, up) -> silu(x w[0]^T) * (x w[1]^T), [M, R];
      "qkv":  w [Hq + 2 Hkv, D, K], q_heads = Hq -> (q [M, Hq, D], k_cache, v_cache):
              RoPE (half-split) at `positions` [M] with `inv_freq` [D/2] on q and k; row
              m = b * q_len + s is token s of cache row b, its k and v written into
              k_cache / v_cache [B, Hkv, T, D] at positions[m]; with `zeros` = n > 0 also
              int32 zeros [n] (the `counters` of the decode_attention that follows).
    Extra keyword arguments (`pallas_triton`: tuning=GemvTuning(...), interpret) go to
    the chosen implementation.
    """
    if epilogue not in _EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r}; choose one of {_EPILOGUES}")
    if x.ndim != 2 or w.shape[-1] != x.shape[1]:
        raise ValueError(f"decode_matmul wants x [M, K] and out-major w [..., K]; got "
                         f"x{x.shape} w{w.shape}")
    if (norm_scale is None) != (eps is None):
        raise ValueError("decode_matmul: the norm prologue needs both norm_scale and eps")
    if residual is not None and epilogue != "none":
        raise ValueError(f"decode_matmul: a residual goes with epilogue 'none', not "
                         f"{epilogue!r}")
    if zeros and epilogue != "qkv":
        raise ValueError(f"decode_matmul: zeros go with epilogue 'qkv', not {epilogue!r}")
    if epilogue == "qkv" and any(a is None for a in (positions, inv_freq, k_cache, v_cache)):
        raise ValueError("decode_matmul: epilogue 'qkv' needs positions, inv_freq, k_cache "
                         "and v_cache")
    if epilogue == "qkv" and (not 0 < q_heads < w.shape[0] or (w.shape[0] - q_heads) % 2):
        raise ValueError(f"decode_matmul: a qkv weight of {w.shape[0]} heads does not split "
                         f"into q_heads={q_heads} and two equal k and v parts")
    fn = pick("matmul", impl, x, w, epilogue).fn
    return fn(x, w, norm_scale=norm_scale, eps=eps, residual=residual, epilogue=epilogue,
              positions=positions, inv_freq=inv_freq, q_len=q_len, q_heads=q_heads,
              k_cache=k_cache, v_cache=v_cache, zeros=zeros, **kwargs)


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None, impl: str = "auto",
                   **kwargs):
    """One matmul per group of rows (the experts of an MoE layer).

    lhs [M, K], its rows sorted by group: group g owns the group_sizes[g] rows after those
    of groups 0 .. g-1 (empty groups allowed); rhs [G, K, N]; group_sizes int32 [G] with
    sum <= M. out[m] = lhs[m] @ rhs[g] for row m of group g; rows past sum(group_sizes)
    give zeros. -> [M, N] in `preferred_element_type` (default lhs's dtype), accumulated in
    f32. Differentiable in lhs and rhs. As `jax.lax.ragged_dot`.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul wants lhs [M, K] and rhs [G, K, N]; got "
                         f"lhs{lhs.shape} rhs{rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype,
                                                                   jnp.integer):
        raise ValueError(f"group_sizes must be integers [G]=[{rhs.shape[0]}]; got "
                         f"{group_sizes.dtype}{group_sizes.shape}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs and rhs dtypes differ: {lhs.dtype}, {rhs.dtype}")
    fn = pick("gmm", impl, lhs, rhs, group_sizes).fn
    return fn(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, **kwargs)


def mla_decode(q, kv_pages, block_tables, lengths, *, v_dim: int,
               sm_scale: float | None = None, impl: str = "auto", layer=None, **kwargs):
    """Multi-head latent attention decode, absorbed form, over a paged latent cache.

    Every query head attends over the one latent row [Dk] of each token (MQA with a
    single kv head): the key is the whole row (kv_lora_rank latent + rope part), the
    value its first `v_dim` columns. q [B, Hq, Dk] (the absorbed queries); kv_pages
    [P, page, Dk], or a layer stack [L, P, page, Dk] with `layer` (int or traced int32
    scalar; read in place); block_tables int32 [B, W]: token t of row b is at offset
    t % page of page block_tables[b, t // page]; lengths int32 [B] (0 allowed: the row
    is zeros). -> [B, Hq, v_dim] in q's dtype, softmax(q k^T * sm_scale) @ v.
    `sm_scale` defaults to 1/sqrt(Dk); the model passes its own (the q/k head dim's).
    Extra keyword arguments (block sizes, splits) go to the chosen implementation.
    The pages' rows past a length must hold finite values ("pallas_mosaic" reads whole
    tiles and weights those rows 0; a NaN there would still spread): a zeroed pool written
    only by the model is.
    """
    if q.ndim != 3 or kv_pages.ndim not in (3, 4):
        raise ValueError(f"mla_decode wants q [B, Hq, Dk] and kv_pages [P, page, Dk] (or "
                         f"[L, P, page, Dk] with layer=); got q{q.shape} kv{kv_pages.shape}")
    if (kv_pages.ndim == 4) != (layer is not None):
        raise ValueError(f"layer={layer!r} goes with kv pages of rank 4 [L, P, page, Dk], and "
                         f"only with them; got kv{kv_pages.shape}")
    b, _, dk = q.shape
    if kv_pages.shape[-1] != dk:
        raise ValueError(f"q{q.shape} and kv{kv_pages.shape} disagree in Dk (the latent "
                         f"row width)")
    if not isinstance(v_dim, int) or not 0 < v_dim <= dk:
        raise ValueError(f"v_dim={v_dim!r} must be an int in [1, Dk={dk}] (the latent "
                         f"columns that are the value, e.g. kv_lora_rank)")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"block_tables must be [B, W] and lengths [B] with B={b}; got "
                         f"{block_tables.shape} and {lengths.shape}")
    for name, x in (("block_tables", block_tables), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers (int32); got {x.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating) or q.dtype != kv_pages.dtype:
        raise ValueError(f"q and kv_pages must share one floating dtype; got {q.dtype} and "
                         f"{kv_pages.dtype}")
    sm_scale = dk ** -0.5 if sm_scale is None else float(sm_scale)
    fn = pick("mla", impl, q, kv_pages, v_dim).fn
    return fn(q, kv_pages, block_tables, lengths, v_dim=v_dim, sm_scale=sm_scale, layer=layer,
              **kwargs)


__all__ = ["flash_attention", "paged_attention", "ragged_paged_attention", "decode_attention",
           "decode_matmul", "grouped_matmul", "mla_decode", "pick", "names", "available"]
