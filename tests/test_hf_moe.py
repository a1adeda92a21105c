"""Hugging Face interop of the MoE families, Mixtral and Qwen3-MoE: parity with
`transformers` (logits, greedy decoding) on small random models, export to and round trip
through HF directories, and the configs jaxllm refuses."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from test_hf import _randomize, _tokens, _torch_logits

import jaxllm
from jaxllm import hf
from jaxllm.config import ModelConfig, load_config
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params

V = 101
# name -> (config class, config kwargs): Mixtral with a sliding window; Qwen3-MoE with a
# dense first layer, top-k weights not renormalised and head_dim != hidden_size / heads
CASES = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=6)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         mlp_only_layers=[0], norm_topk_prob=False,
                                         head_dim=24)),
}


def _hf_model(case, path, seed=0):
    cls, kwargs = CASES[case]
    c = getattr(transformers, cls)(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=V, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **kwargs)
    torch.manual_seed(seed)
    model = _randomize(transformers.AutoModelForCausalLM.from_config(c), seed)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_moe_logits_match_transformers(case, tmp_path):
    ref_model = _hf_model(case, tmp_path)
    tokens = _tokens(1, (2, 40))
    ref = _torch_logits(ref_model, tokens)
    model, cfg = hf.load(tmp_path)
    assert cfg.model.moe.dense_layers == (1 if case == "qwen3_moe" else 0)
    got = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits


@pytest.mark.parametrize("case", list(CASES))
def test_moe_greedy_generation_matches_transformers(case, tmp_path):
    ref_model = _hf_model(case, tmp_path, seed=2)
    prompt = _tokens(3, (9,)).tolist()
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                                 min_new_tokens=20)[0, len(prompt):].tolist()
    model, cfg = hf.load(tmp_path)
    got, _ = generate_ids(decode_params(model, cfg), [prompt], max_new_tokens=20,
                          temperature=0.0, warmup=False)
    assert got[0] == ref


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_mlp_dim=32"]
# jaxllm-initialised MoE models exported to HF (Mixtral's mlp_dim is its expert width)
EXPORTS = {
    "mixtral": MOE + ["model.mlp_dim=32", "model.sliding_window=5"],
    "qwen3_moe": MOE + ["model.n_layers=3", "model.moe.dense_layers=1", "model.qk_norm=true",
                        "model.head_dim=24", "model.moe.norm_topk_prob=false"],
}


def _small(overrides):
    return load_config(None, ["model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                              "model.n_kv_heads=2", "model.mlp_dim=96",
                              f"model.vocab_size={V}", "model.max_seq_len=128",
                              "train.seq_len=64"] + overrides)


@pytest.mark.parametrize("case", list(EXPORTS))
def test_moe_saved_checkpoint_loads_in_transformers(case, tmp_path):
    cfg = _small(EXPORTS[case])
    model = jaxllm.build_model(cfg.model, rngs=nnx.Rngs(0))
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [
        x + 0.15 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]))
    hf.save(model, cfg, tmp_path)

    tokens = _tokens(4, (2, 24))
    ref = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == json.loads((tmp_path / "config.json").read_text())[
        "architectures"][0] == f"{'Qwen3Moe' if case == 'qwen3_moe' else 'Mixtral'}ForCausalLM"
    assert np.abs(_torch_logits(theirs, tokens) - ref).max() < 1e-4

    # load(save(model)) is the same model; with bias balancing, from a zero bias
    back, back_cfg = hf.load(tmp_path)
    assert back_cfg.model == dataclasses.replace(cfg.model, init_std=ModelConfig.init_std)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    biased, _ = hf.load(tmp_path, ["model.moe.balance=bias"])
    np.testing.assert_array_equal(np.asarray(biased.blocks.mlp.expert_bias[...]),
                                  np.zeros((cfg.model.n_layers - cfg.model.moe.dense_layers, 4)))


@pytest.mark.parametrize("change, message", [
    ({"decoder_sparse_step": 2, "num_hidden_layers": 4}, r"make layers \[0, 2\] of 4 dense"),
    ({"mlp_only_layers": [1]}, r"make layers \[1\] of 2 dense"),
    ({"mlp_only_layers": [0, 1]}, "at least one MoE layer"),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
      "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
])
def test_unsupported_moe_config_json_is_a_clear_error(change, message, tmp_path):
    c = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
         "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": V,
         "num_experts": 4, "num_experts_per_tok": 2, **change}
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=message):
        hf.load(tmp_path)


@pytest.mark.parametrize("change, message", [
    (["model.moe.router=sigmoid", "model.qk_norm=true"],
     "model.moe.router='sigmoid': no Hugging Face counterpart in Qwen3MoeForCausalLM"),
    (["model.moe.num_shared_experts=1"], "set model.moe.num_shared_experts=0"),
    (["model.moe.dense_layers=1"], "model.moe.dense_layers=1: no Hugging Face counterpart "
                                   "in MixtralForCausalLM"),
    (["model.moe.balance=bias"], "selection bias"),
])
def test_unexportable_moe_model_is_a_clear_error(change, message, tmp_path):
    cfg = _small(MOE + change)
    model = jaxllm.build_model(cfg.model, rngs=nnx.Rngs(0))
    if cfg.model.moe.balance == "bias":  # a trained bias: the exported routing would differ
        model.blocks.mlp.expert_bias[...] = jnp.full((2, 4), 0.1)
    with pytest.raises(ValueError, match=message):
        hf.save(model, cfg, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
