import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxllm
from jaxllm.config import load_config

BASE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.mlp_dim=96",
        "model.vocab_size=97"]


def _model(*overrides, seed=0):
    cfg = load_config(None, BASE + list(overrides))
    return jaxllm.build_model(cfg.model, rngs=nnx.Rngs(seed)), cfg


def _tokens(key, b, s, v=97):
    return jax.random.randint(key, (b, s), 0, v, jnp.int32)


# The model's forward and cached step, jitted as decoding runs them (run eagerly, every
# op would compile on its own).
_forward = jax.jit(lambda model, tokens: model(tokens))
_cached = jax.jit(lambda model, tokens, cache, start, prefill=False:
                  model.forward_cached(tokens, cache, start, prefill=prefill),
                  static_argnames="prefill")


def test_shapes_and_param_count():
    model, cfg = _model("model.n_kv_heads=2")
    tokens = _tokens(jax.random.key(0), 2, 11)
    logits = model(tokens)
    chex.assert_shape(logits, (2, 11, 97))
    chex.assert_type(logits, jnp.float32)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == cfg.model.num_params()


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_causal_masking(kv):
    """Changing a future token leaves every earlier position's logits unchanged."""
    model, _ = _model(f"model.n_kv_heads={kv}")
    tokens = _tokens(jax.random.key(1), 2, 16)
    cut = 9
    changed = tokens.at[:, cut].set((tokens[:, cut] + 1) % 97)
    a, b = model(tokens), model(changed)
    np.testing.assert_allclose(a[:, :cut], b[:, :cut], atol=1e-5)
    assert np.abs(np.asarray(a[:, cut:] - b[:, cut:])).max() > 1e-3


# MHA and MQA with the scanned stack; GQA in the decode form (unstacked layers: a Python
# layer loop and per-layer caches, q/k/v and gate/up weights joined), with the einsums and
# with the Pallas kernels (interpreted on the CPU): decode attention and the fused decode
# matmuls, which take no q/k/v bias and want head_dim / 2 a multiple of 16 (2 heads of 32)
@pytest.mark.parametrize("kv,form", [(4, "stacked"), (2, "fused"), (1, "kernel"),
                                     (1, "stacked")])
def test_cached_decode_matches_full_forward(kv, form, monkeypatch):
    kernel = form == "kernel"
    if kernel:  # the fused kernels for every call here (2 and 6 rows), not just 1-row ones
        from jaxllm.kernels.pallas import gemv_triton
        monkeypatch.setitem(gemv_triton.TUNED, "model_rows", gemv_triton.MAX_ROWS)
    model, _ = _model(f"model.n_kv_heads={kv}", f"model.qkv_bias={not kernel}",
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
    if form != "stacked":
        model.unstack_layers()
    if form in ("fused", "kernel"):
        model.fuse_projections("pallas_triton" if kernel else "xla")
        assert model.blocks[0].attn.q is None and model.blocks[0].mlp.gate_up is not None
        assert model.blocks[0].fused_decode == kernel
    cache = model.init_cache(b, 32)
    assert cache.per_layer == (form != "stacked") and cache.max_len == 32
    logits, cache = _cached(model, tokens[:, :prompt], cache, jnp.zeros(b, jnp.int32),
                            prefill=True)
    got = [logits]
    for t in range(prompt, s - 3):  # one token at a time
        logits, cache = _cached(model, tokens[:, t:t + 1], cache, jnp.full(b, t, jnp.int32))
        got.append(logits)
    # then a block of 3 tokens at once (as speculative verification does)
    logits, cache = _cached(model, tokens[:, s - 3:], cache, jnp.full(b, s - 3, jnp.int32))
    got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, 1), full, atol=2e-5, rtol=2e-5)


def test_cached_decode_ragged_rows():
    """Rows at different positions in one batch decode like each row alone."""
    model, _ = _model("model.n_kv_heads=2")
    tokens = _tokens(jax.random.key(5), 2, 12)
    full = _forward(model, tokens)
    cache = model.init_cache(2, 16)
    _, cache = _cached(model, tokens[:, :8], cache, jnp.zeros(2, jnp.int32), prefill=True)
    start = jnp.array([5, 8], jnp.int32)  # row 0 rewinds: its later cache entries are stale
    step_tokens = jnp.stack([tokens[0, 5:7], tokens[1, 8:10]])
    logits, _ = _cached(model, step_tokens, cache, start)
    np.testing.assert_allclose(logits[0], full[0, 5:7], atol=2e-5)
    np.testing.assert_allclose(logits[1], full[1, 8:10], atol=2e-5)


def test_tied_embeddings_and_bf16():
    model, cfg = _model("model.tie_embeddings=true", "model.dtype=bfloat16")
    assert model.head is None
    logits = model(_tokens(jax.random.key(2), 1, 8))
    chex.assert_type(logits, jnp.float32)
    assert np.isfinite(np.asarray(logits)).all()


def test_scan_compiles_once_for_any_depth():
    """The blocks are scanned: the jaxpr holds one block body whatever the depth."""
    sizes = []
    for n in (2, 6):
        model, _ = _model(f"model.n_layers={n}")
        g, st = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(g, s)(t))(st, _tokens(jax.random.key(0), 1, 8))
        sizes.append(len(str(jaxpr)))
    assert abs(sizes[0] - sizes[1]) < 0.02 * sizes[0]
