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


_forward = jax.jit(lambda model, tokens: model(tokens))


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
        tokens = _tokens(jax.random.key(0), 1, 8)
        jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(g, s)(t))(st, tokens)
        sizes.append(len(str(jaxpr)))
    assert abs(sizes[0] - sizes[1]) < 0.02 * sizes[0]


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_equal_the_scan(remat):
    """model.unroll_layers changes the compiled loop only: the same parameters give the same
    logits and gradients, and the unrolled program has no loop left."""
    rolled, _ = _model("model.n_layers=3", f"model.remat={remat}")
    unrolled, _ = _model("model.n_layers=3", f"model.remat={remat}",
                         "model.unroll_layers=true")
    nnx.update(unrolled, nnx.state(rolled))
    tokens = _tokens(jax.random.key(1), 2, 16)

    def loss(model):
        return jnp.mean(jax.nn.log_softmax(model(tokens))[..., 0] ** 2)

    (la, ga), (lb, gb) = (nnx.value_and_grad(loss)(m) for m in (rolled, unrolled))
    chex.assert_trees_all_close((la, nnx.to_pure_dict(ga)), (lb, nnx.to_pure_dict(gb)),
                                rtol=1e-5, atol=1e-6)
    loops = [_forward.lower(m, tokens).as_text().count("stablehlo.while")
             for m in (rolled, unrolled)]
    assert loops == [1, 0]
