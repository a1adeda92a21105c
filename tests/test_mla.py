"""Multi-head latent attention: the training form against an explicit per-head reference,
flash attention with a value head dim other than the query-key dim, the absorbed decode
form against the expanded one, the latent cache's size, greedy generation, config errors."""
import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxllm
from jaxllm.config import ConfigError, MLAConfig, RopeScaling
from jaxllm.inference.params import decode_params
from jaxllm.inference.step import forward, init_cache
from jaxllm.kernels import flash_attention, reference
from jaxllm.model.layers import apply_rope, rope_frequencies
from jaxllm.model.mla import MLA

YARN = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.7,
                   mscale_all_dim=1.0)


def _rms(x, scale, eps=1e-5):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _per_head_reference(p, x, positions, mla: MLAConfig, n_heads: int):
    """MLA spelled out: every head's K and V built from the latent, softmax by hand."""
    nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
    if mla.q_lora_rank:
        q = _rms(x @ p["q_a"]["kernel"], p["q_a_norm"]["scale"])
        q = jnp.einsum("bsr,rhk->bshk", q, p["q_b"]["kernel"])
    else:
        q = jnp.einsum("bsd,dhk->bshk", x, p["q"]["kernel"])
    ckv = x @ p["kv_a"]["kernel"]
    c = _rms(ckv[..., :rank], p["kv_norm"]["scale"])
    k_rope = apply_rope(ckv[:, :, None, rank:], positions, 10000.0, YARN)[:, :, 0]
    mscale = 0.1 * YARN.mscale_all_dim * math.log(YARN.factor) + 1
    scale = mscale ** 2 / math.sqrt(mla.qk_head_dim)
    outs = []
    for h in range(n_heads):
        w = p["kv_b"]["kernel"][:, h]  # (rank, nope + Dv)
        k = jnp.concatenate([c @ w[:, :nope], k_rope], -1)  # (B, S, Dqk)
        v = c @ w[:, nope:]
        qh = jnp.concatenate([q[:, :, h, :nope],
                              apply_rope(q[:, :, h:h + 1, nope:], positions, 10000.0,
                                         YARN)[:, :, 0]], -1)
        s = jnp.einsum("bqk,btk->bqt", qh, k) * scale
        s = jnp.where(jnp.tril(jnp.ones(s.shape[1:], bool)), s, -jnp.inf)
        outs.append(jax.nn.softmax(s, -1) @ v)  # (B, S, Dv)
    return jnp.einsum("bshv,hvd->bsd", jnp.stack(outs, 2), p["o"]["kernel"])


def test_mla_forward_and_grads_equal_per_head_reference():
    """Low-rank queries here; the model of the decode tests has full-rank ones."""
    mla = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                    q_lora_rank=12)
    layer = MLA(d_model=16, n_heads=3, mla=mla, rope_theta=10000.0, rope_scaling=YARN,
                attention_impl="reference", norm_eps=1e-5, dtype=jnp.float32,
                param_dtype=jnp.float32, rngs=nnx.Rngs(0), std=0.3, out_std=0.3)
    graphdef, params = nnx.split(layer, nnx.Param)
    x = jax.random.normal(jax.random.key(1), (2, 9, 16))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9)) + jnp.array([[0], [5]])  # rows at offsets
    ct = jax.random.normal(jax.random.key(2), (2, 9, 16))

    def ours(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x, pos) * ct)

    def ref(params, x):
        return jnp.sum(_per_head_reference(nnx.to_pure_dict(params), x, pos, mla, 3) * ct)

    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(ours, (0, 1)))(params, x),
                                jax.jit(jax.value_and_grad(ref, (0, 1)))(params, x),
                                atol=1e-5, rtol=1e-4)


def test_flash_with_value_dim_unlike_query_key_dim():
    """D_qk 192 (padded to 256 inside) and D_v 128 as in DeepSeek-V3; GQA 2:1; causal
    with Sq < Skv and tails that fill no tile; forward and all three gradients."""
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (1, 20, 2, 192))
    k = jax.random.normal(ks[1], (1, 23, 1, 192))
    v = jax.random.normal(ks[2], (1, 23, 1, 128))
    ct = jax.random.normal(ks[3], (1, 20, 2, 128))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * ct)

    triton = loss(lambda q, k, v: flash_attention(q, k, v, sm_scale=0.1, impl="pallas_triton"))
    ref = loss(lambda q, k, v: reference.flash_attention(q, k, v, sm_scale=0.1))
    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(triton, (0, 1, 2)))(q, k, v),
                                jax.jit(jax.value_and_grad(ref, (0, 1, 2)))(q, k, v),
                                atol=1e-4, rtol=1e-4)
    # the Mosaic kernel takes no pair of unequal head dims but 192 / 128 (see
    # tests/test_flash_mosaic.py), cuDNN (through jax.nn) one head dim: they say so
    half = [jax.ShapeDtypeStruct(x.shape[:3] + (128 if i < 2 else 64,), jnp.bfloat16)
            for i, x in enumerate((q, k, v))]
    from jaxllm.kernels.pallas.flash_mosaic import unsupported_reason
    from jaxllm.kernels.xla import cudnn_unsupported_reason
    assert "v_head_dim=64" in unsupported_reason(*half)
    assert "one head dim" in cudnn_unsupported_reason(*half)
    with pytest.raises(ValueError, match="must agree in batch, length and heads"):
        flash_attention(q, k, v[:, :5])


@pytest.fixture(scope="module")
def tiny_mla():
    cfg = jaxllm.load_config("configs/tiny_mla.yaml", [
        "model.n_layers=1", "model.mla.q_lora_rank=0", "inference.decode_chunk=4",
        "model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 8,"
        " mscale_all_dim: 1}"])
    return jaxllm.build_model(cfg.model, rngs=nnx.Rngs(0)), cfg


def test_absorbed_decode_equals_expanded_form(tiny_mla):
    model, cfg = tiny_mla
    tokens = jax.random.randint(jax.random.key(4), (2, 11), 0, cfg.model.vocab_size)
    p = decode_params(model, cfg)
    step = jax.jit(forward, static_argnames="prefill")
    expanded, cache, _ = step(p, tokens, init_cache(p, 2, 16), jnp.zeros(2, jnp.int32),
                              prefill=True)
    np.testing.assert_allclose(expanded, nnx.jit(lambda m, t: m(t))(model, tokens), atol=1e-5)
    absorbed = []
    for i in range(7, 11):  # one token at a time; the cached keys after it are masked
        out, cache, _ = step(p, tokens[:, i:i + 1], cache, jnp.full(2, i, jnp.int32))
        absorbed.append(out)
    np.testing.assert_allclose(jnp.concatenate(absorbed, 1), expanded[:, 7:], atol=1e-5)


def test_latent_cache_holds_rank_plus_rope_values_per_token(tiny_mla):
    model, cfg = tiny_mla
    params = decode_params(model, cfg).replace(
        cfg=dataclasses.replace(cfg.model, dtype="bfloat16", n_layers=3))
    cache = init_cache(params, 5, 40, n_layers=3)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert nbytes / (5 * 40 * 3) == (cfg.model.mla.kv_lora_rank
                                     + cfg.model.mla.qk_rope_head_dim) * 2  # bf16


def test_generate_greedy_equals_training_argmax(tiny_mla):
    model, cfg = tiny_mla
    prompts = [[5, 17, 99, 3], [42, 8]]
    out = jaxllm.generate(model, cfg, prompts, max_new_tokens=6, temperature=0.0,
                          return_result=True)
    for prompt, new in zip(prompts, out.tokens):
        seq = jnp.asarray([prompt + new])
        argmax = np.asarray(model(seq)[0].argmax(-1))
        assert new and list(argmax[len(prompt) - 1:-1]) == new


@pytest.mark.parametrize("overrides,match", [
    (["model.attention=mla"], "needs a model.mla section"),
    (["model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=8",
      "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8"], "takes no model.mla"),
    (["model.attention=mla", "model.mla.kv_lora_rank=0", "model.mla.qk_nope_head_dim=8",
      "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8"], "kv_lora_rank=0 must be"),
    (["model.attention=mla", "model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=8",
      "model.mla.qk_rope_head_dim=5", "model.mla.v_head_dim=8"], "must be even"),
    (["model.attention=mla", "model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=8",
      "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8", "model.n_kv_heads=2"],
     "takes no n_kv_heads=2"),
    (["model.rope_scaling.rope_type=yarn", "model.rope_scaling.factor=4",
      "model.rope_scaling.original_max_position_embeddings=64",
      "model.rope_scaling.low_freq_factor=1"], "'yarn' takes no low_freq_factor"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        jaxllm.load_config(None, overrides)


def test_yarn_frequencies_and_mla_counts(tiny_mla):
    """YaRN keeps the fast-turning frequency pairs, divides the slow ones by `factor` and
    ramps between; the parameter count of an MLA model is that of its modules."""
    model, cfg = tiny_mla
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == \
        cfg.model.num_params()
    plain = np.asarray(rope_frequencies(64, 10000.0))
    ratio = plain / np.asarray(rope_frequencies(64, 10000.0, RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=4096)))
    turns = 4096 * plain / (2 * np.pi)  # rotations of each pair over the original context
    np.testing.assert_allclose(ratio[turns > 40], 1.0, rtol=1e-6)
    np.testing.assert_allclose(ratio[turns < 0.5], 4.0, rtol=1e-6)
    between = ratio[(turns > 1.5) & (turns < 20)]
    assert between.size and np.all((between > 1) & (between < 4))
    assert np.all(np.diff(ratio) >= -1e-6)  # slower pairs are stretched at least as much
