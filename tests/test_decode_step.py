"""The decode program (inference/step.py over DecodeParams) against the training model's
forward: prefill then one token at a time, then a block of tokens at once (speculative
verification), over the contiguous cache and over the paged cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxllm
from jaxllm.config import load_config
from jaxllm.inference.cache import PagedCache, PagePool
from jaxllm.inference.params import decode_params
from jaxllm.inference.step import forward, init_cache

BASE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.mlp_dim=96",
        "model.vocab_size=97"]

_forward = jax.jit(lambda model, tokens: model(tokens))
_step = jax.jit(lambda p, tokens, cache, start, prefill=False:
                forward(p, tokens, cache, start, prefill=prefill)[:2], static_argnames="prefill")


def _model(*overrides, seed=0):
    cfg = load_config(None, BASE + list(overrides))
    return jaxllm.build_model(cfg.model, rngs=nnx.Rngs(seed)), cfg


def _tokens(key, b, s, v=97):
    return jax.random.randint(key, (b, s), 0, v, jnp.int32)


# MHA, GQA and MQA with XLA's matmuls and random q/k/v biases; and with the Pallas kernels
# (interpreted on the CPU) for every step: decode attention and the fused decode matmuls,
# which take no q/k/v bias and want head_dim / 2 a multiple of 16 (2 heads of 32)
@pytest.mark.parametrize("kv,form", [(4, "xla"), (2, "xla"), (1, "kernel"), (1, "xla")])
def test_cached_decode_matches_full_forward(kv, form):
    kernel = form == "kernel"
    model, cfg = _model(f"model.n_kv_heads={kv}", f"model.qkv_bias={not kernel}",
                        f"model.decode_impl={'pallas_triton' if kernel else 'auto'}",
                        *(["model.n_heads=2"] if kernel else []), seed=kv)
    graphdef, state = nnx.split(model)  # random biases (they start at zero)
    state = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.1 * jax.random.normal(jax.random.key(7), x.shape, x.dtype)
        if "bias" in jax.tree_util.keystr(path) else x, state)
    model = nnx.merge(graphdef, state)
    b, s, prompt = 2, 14, 5
    tokens = _tokens(jax.random.key(kv), b, s)
    full = _forward(model, tokens)
    params = decode_params(model, cfg, fused_rows=16 if kernel else None)
    assert params.fused_rows == (16 if kernel else 0)  # the CPU picks XLA's matmuls
    assert params.layers[0].qkv.shape == (cfg.model.n_heads + 2 * kv, 32 if kernel else 16, 64)
    cache = init_cache(params, b, 32)
    assert cache.max_len == 32 and len(cache.k) == 2
    logits, cache = _step(params, tokens[:, :prompt], cache, jnp.zeros(b, jnp.int32),
                          prefill=True)
    got = [logits]
    for t in range(prompt, s - 3):  # one token at a time
        logits, cache = _step(params, tokens[:, t:t + 1], cache, jnp.full(b, t, jnp.int32))
        got.append(logits)
    # then a block of 3 tokens at once (as speculative verification does)
    logits, cache = _step(params, tokens[:, s - 3:], cache, jnp.full(b, s - 3, jnp.int32))
    got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, 1), full, atol=2e-5, rtol=2e-5)


def test_cached_decode_ragged_rows():
    """Rows at different positions in one batch decode like each row alone."""
    model, cfg = _model("model.n_kv_heads=2")
    params = decode_params(model, cfg)
    tokens = _tokens(jax.random.key(5), 2, 12)
    full = _forward(model, tokens)
    _, cache = _step(params, tokens[:, :8], init_cache(params, 2, 16), jnp.zeros(2, jnp.int32),
                     prefill=True)
    start = jnp.array([5, 8], jnp.int32)  # row 0 rewinds: its later cache entries are stale
    step_tokens = jnp.stack([tokens[0, 5:7], tokens[1, 8:10]])
    logits, _ = _step(params, step_tokens, cache, start)
    np.testing.assert_allclose(logits[0], full[0, 5:7], atol=2e-5)
    np.testing.assert_allclose(logits[1], full[1, 8:10], atol=2e-5)


@pytest.mark.parametrize("kv,page", [(2, 4), (1, 8)])
def test_paged_decode_matches_contiguous(kv, page):
    model, cfg = _model(f"model.n_kv_heads={kv}", seed=kv)
    params = decode_params(model, cfg)
    lengths = [5, 11, 1]  # ragged prompts, right-padded to 11
    b, steps, width = len(lengths), 6, 16
    tokens = jax.random.randint(jax.random.key(page), (b, 11 + steps), 0, 97, jnp.int32)

    pool = PagePool.create(n_layers=2, n_kv_heads=kv, head_dim=16, num_pages=40,
                           page_size=page, max_pages_per_seq=8, dtype=jnp.float32)
    seqs = [pool.allocate() for _ in lengths]
    rng = np.random.default_rng(0)
    pool.allocator._free = list(rng.permutation(pool.allocator._free))  # scattered pages
    pool.reserve(seqs, lengths)
    contig = init_cache(params, b, 32)
    start = jnp.zeros(b, jnp.int32)
    prompt = tokens[:, :11]
    want, contig = _step(params, prompt, contig, start, prefill=True)
    tables, _ = pool.tables(seqs, width)
    got, paged = _step(params, prompt, PagedCache(pool.k, pool.v, tables), start, prefill=True)
    for i, n in enumerate(lengths):  # positions past a row's length are padding
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=2e-5)
    pool.k, pool.v = paged.k, paged.v

    pos = jnp.asarray(lengths, jnp.int32)
    for t in range(steps):  # one token per row, each at its own position
        tok = tokens[jnp.arange(b), pos][:, None]
        pool.reserve(seqs, [1] * b)
        tables, _ = pool.tables(seqs, width)
        want, contig = _step(params, tok, contig, pos)
        got, paged = _step(params, tok, PagedCache(pool.k, pool.v, tables), pos)
        pool.k, pool.v = paged.k, paged.v
        np.testing.assert_allclose(got, want, atol=2e-5)
        pos = pos + 1
    # several tokens per row at once (speculative verification) over the paged cache
    block = tokens[:, 11:14]
    pool.reserve(seqs, [3] * b)
    tables, _ = pool.tables(seqs, width)
    want, _ = _step(params, block, contig, pos)
    got, _ = _step(params, block, PagedCache(pool.k, pool.v, tables), pos)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_matmul_impl_picks_the_fused_rows():
    """inference.matmul_impl decides once, in decode_params, whether one-row steps take the
    fused decode matmuls; an explicit choice they cannot take is an error."""
    fits = ["model.n_heads=2", "model.n_kv_heads=1"]  # head_dim 32: the kernels take it
    model, cfg = _model(*fits, "inference.matmul_impl=pallas_triton")
    assert decode_params(model, cfg).fused_rows == 1
    model, cfg = _model(*fits)  # auto: XLA's matmuls on the CPU
    assert decode_params(model, cfg).fused_rows == 0
    model, cfg = _model(*fits, "model.qkv_bias=true", "inference.matmul_impl=pallas_triton")
    with pytest.raises(ValueError, match="no q/k/v bias"):
        decode_params(model, cfg)
    model, cfg = _model("inference.matmul_impl=pallas_triton")  # head_dim 16
    with pytest.raises(ValueError, match="head_dim / 2"):
        decode_params(model, cfg)
