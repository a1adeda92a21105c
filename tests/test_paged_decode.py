"""Decoding through the model over the paged cache gives the contiguous-cache logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxllm
from jaxllm.config import load_config
from jaxllm.inference.kv_cache import PagedKV, PagedKVCache


@pytest.mark.parametrize("kv,page", [(2, 4), (1, 8)])
def test_paged_decode_matches_contiguous(kv, page):
    cfg = load_config(None, ["model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                             f"model.n_kv_heads={kv}", "model.mlp_dim=96", "model.vocab_size=97"])
    model = jaxllm.build_model(cfg.model, rngs=nnx.Rngs(kv))
    lengths = [5, 11, 1]  # ragged prompts, right-padded to 11
    b, steps, width = len(lengths), 6, 16
    tokens = jax.random.randint(jax.random.key(page), (b, 11 + steps), 0, 97, jnp.int32)

    paged = PagedKVCache.create(n_layers=2, n_kv_heads=kv, head_dim=16, num_pages=40,
                                page_size=page, max_pages_per_seq=8, dtype=jnp.float32)
    seqs = [paged.allocate() for _ in lengths]
    rng = np.random.default_rng(0)
    paged.allocator._free = list(rng.permutation(paged.allocator._free))  # scattered pages
    paged.reserve(seqs, lengths)
    contig = model.init_cache(b, 32, jnp.float32)
    start = jnp.zeros(b, jnp.int32)
    prompt = tokens[:, :11]
    want, contig = model.forward_cached(prompt, contig, start, prefill=True)
    tables, _ = paged.tables(seqs, width)
    got, pkv = model.forward_cached(prompt, PagedKV(paged.k, paged.v, tables), start,
                                    prefill=True)
    for i, n in enumerate(lengths):  # positions past a row's length are padding
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=2e-5)
    paged.k, paged.v = pkv.k, pkv.v

    pos = jnp.asarray(lengths, jnp.int32)
    step = jax.jit(lambda m, t, c, p: m.forward_cached(t, c, p))
    for t in range(steps):  # one token per row, each at its own position
        tok = tokens[jnp.arange(b), pos][:, None]
        paged.reserve(seqs, [1] * b)
        tables, _ = paged.tables(seqs, width)
        want, contig = step(model, tok, contig, pos)
        got, pkv = step(model, tok, PagedKV(paged.k, paged.v, tables), pos)
        paged.k, paged.v = pkv.k, pkv.v
        np.testing.assert_allclose(got, want, atol=2e-5)
        pos = pos + 1
    # several tokens per row at once (speculative verification) over the paged cache
    block = tokens[:, 11:14]
    paged.reserve(seqs, [3] * b)
    tables, _ = paged.tables(seqs, width)
    want, _ = model.forward_cached(block, contig, pos)
    got, _ = model.forward_cached(block, PagedKV(paged.k, paged.v, tables), pos)
    np.testing.assert_allclose(got, want, atol=2e-5)
