"""Hugging Face interop of the MoE families, Mixtral and Qwen3-MoE: parity with
`transformers` (logits, greedy decoding) on small random models, export to and round trip
through HF directories, and the configs jaxllm refuses."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_hf import _check_saved_again, _greedy_pair, _randomize, _tokens, _torch_logits

from jaxllm import hf
from jaxllm.config import load_config

V = 101
# name -> (config class, config kwargs): Mixtral with a sliding window; Qwen3-MoE with a
# dense first layer, top-k weights not renormalised and head_dim != hidden_size / heads
CASES = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=6)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=2, num_experts=4,
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


@pytest.fixture(scope="module", params=list(CASES))
def hf_model(request, tmp_path_factory):
    """(case, directory, torch model): a random HF model saved as transformers saves it
    (one tensor per expert)."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _hf_model(request.param, path)


def test_moe_logits_and_round_trip_match_transformers(hf_model, tmp_path):
    case, path, ref_model = hf_model
    tokens = _tokens(1, (2, 40))
    ref = _torch_logits(ref_model, tokens)
    model, cfg = hf.load(path)
    assert cfg.model.moe.dense_layers == (1 if case == "qwen3_moe" else 0)
    got = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits

    # saved again: the same model to transformers (its family, its logits) and to us
    _check_saved_again(model, cfg, tmp_path, ref_model, tokens, ref)


def test_moe_greedy_generation_matches_transformers(hf_model):
    _, path, ref_model = hf_model
    got, ref = _greedy_pair(ref_model, path, _tokens(3, (9,)).tolist())
    assert got == ref


def test_moe_selection_bias_starts_at_zero_and_must_stay_there(hf_model, tmp_path):
    """HF routers choose by score alone: loading for bias balancing gives a zero bias, and
    a model whose bias moved cannot be exported."""
    _, path, _ = hf_model
    model, cfg = hf.load(path, ["model.moe.balance=bias"])
    bias = model.blocks.mlp.expert_bias
    np.testing.assert_array_equal(np.asarray(bias[...]), np.zeros(bias.shape))
    hf.save(model, cfg, tmp_path / "zero")  # a zero bias changes nothing
    bias[...] = bias[...].at[0, 1].set(0.1)
    with pytest.raises(ValueError, match="selection bias"):
        hf.save(model, cfg, tmp_path / "moved")
    assert not (tmp_path / "moved").exists()


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
    (["model.qkv_bias=true"], "model.qkv_bias=True"),
])
def test_unexportable_moe_config_is_a_clear_error(change, message):
    cfg = load_config(None, ["model.n_layers=2", "model.moe.num_experts=4",
                             "model.moe.top_k=2", "model.moe.expert_mlp_dim=32"] + change)
    with pytest.raises(ValueError, match=message):
        hf.config_json(cfg)
