"""Hugging Face interop of DeepSeek-V3 and V2 (MLA, DeepSeekMoE): parity with `transformers`
(logits, greedy decoding) on small random models, export to and round trip through HF
directories, MTP layers skipped, and the configs jaxllm refuses."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_hf import (_check_saved_again, _greedy_pair, _perturbed, _randomize, _tokens,
                     _torch_logits)

import jaxllm
from jaxllm import hf
from jaxllm.config import load_config
from jaxllm.hf import deepseek

V = 101
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
# name -> (config class, config kwargs), each three layers, the first dense:
# v3: low-rank queries, YaRN with mscale != mscale_all_dim, 8 experts in 4 groups (2 kept),
#     top 3 renormalised and scaled by 2.5, a random selection bias;
# v3_plain: full-rank queries, rotary pairs not interleaved, one group, not renormalised;
# v2: softmax greedy routing, YaRN as DeepSeek-V2 sets it (mscale = mscale_all_dim)
CASES = {
    "v3": ("DeepseekV3Config", dict(
        q_lora_rank=48, n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
            "mscale_all_dim": 0.7, "beta_fast": 8, "beta_slow": 1,
            "original_max_position_embeddings": 32})),
    "v3_plain": ("DeepseekV3Config", dict(
        q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False,
        routed_scaling_factor=1.0, rope_interleave=False)),
    "v2": ("DeepseekV2Config", dict(
        q_lora_rank=None, num_experts_per_tok=2, routed_scaling_factor=1.5, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 32})),
}


def _hf_model(case, path, seed=0):
    cls, kwargs = CASES[case]
    c = getattr(transformers, cls)(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **MLA, **kwargs)
    torch.manual_seed(seed)
    model = _randomize(transformers.AutoModelForCausalLM.from_config(c), seed)
    with torch.no_grad():  # a buffer, which _randomize leaves at zero
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def hf_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _hf_model(request.param, path)


def _logits(model, tokens):
    return np.asarray(model(jnp.asarray(tokens, jnp.int32)))


def test_deepseek_logits_and_round_trip_match_transformers(hf_model, tmp_path, monkeypatch):
    case, path, ref_model = hf_model
    tokens = _tokens(1, (2, 40))
    ref = _torch_logits(ref_model, tokens)
    model, cfg = hf.load(path)
    m = cfg.model
    assert m.attention == "mla" and m.moe.dense_layers == 1 and m.moe.num_shared_experts == 1
    assert (m.moe.router, m.moe.balance) == (("softmax", "aux_loss") if case == "v2"
                                             else ("sigmoid", "bias"))
    got = _logits(model, tokens)
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits

    # each mapped feature changes the logits (so the parity above covers it): YaRN, the
    # expert groups, the selection bias, the rotary rows' de-interleaving
    def without(**change):
        plain = dataclasses.replace(m, **change)
        return nnx.merge(nnx.graphdef(jaxllm.build_model(plain)), nnx.state(model))
    if m.rope_scaling is not None:
        assert np.abs(_logits(without(rope_scaling=None), tokens) - ref).max() > 1e-2
    if m.moe.n_groups > 1:
        ungrouped = dataclasses.replace(m.moe, n_groups=1, topk_groups=1)
        assert np.abs(_logits(without(moe=ungrouped), tokens) - ref).max() > 1e-2
    if m.moe.balance == "bias":
        bias = model.blocks.mlp.expert_bias
        kept = bias[...]
        bias[...] = jnp.zeros_like(kept)
        assert np.abs(_logits(model, tokens) - ref).max() > 1e-2
        bias[...] = kept
    if case != "v3_plain":
        with monkeypatch.context() as patch:
            patch.setattr(deepseek, "_deinterleave", np.arange)
            assert np.abs(_logits(hf.load(path)[0], tokens) - ref).max() > 1e-2

    # saved again: the same model to transformers (its class, its logits) and to us
    _check_saved_again(model, cfg, tmp_path, ref_model, tokens, ref)


def test_deepseek_greedy_generation_matches_transformers(hf_model):
    _, path, ref_model = hf_model
    got, ref = _greedy_pair(ref_model, path, _tokens(3, (9,)).tolist())
    assert got == ref
    assert len(set(ref)) > 3  # not one token repeated


@pytest.mark.parametrize("hf_model", ["v3", "v3_plain"], indirect=True)  # V2 has no MTP
def test_mtp_layers_are_skipped_with_a_note(hf_model, tmp_path, capsys):
    """A V3 checkpoint's num_nextn_predict_layers layers past the last one: read by no
    parameter, named in a note, the model unchanged; a layer past them is still an error."""
    _, path, _ = hf_model
    tensors = load_file(str(path / "model.safetensors"))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    d = tensors["model.norm.weight"].shape[0]
    mtp.update({f"model.layers.3.{k}": np.ones(s, np.float32) for k, s in [
        ("enorm.weight", (d,)), ("hnorm.weight", (d,)), ("eh_proj.weight", (d, 2 * d)),
        ("shared_head.norm.weight", (d,))]})
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"))
    tokens = _tokens(2, (1, 12))
    model, cfg = hf.load(tmp_path)
    note = capsys.readouterr().err
    assert f"skipping 1 multi-token-prediction layer(s) (model.layers.3+, {len(mtp)} tensors)" \
        in note
    assert cfg.model.mtp_depth == 0
    np.testing.assert_array_equal(_logits(model, tokens), _logits(hf.load(path)[0], tokens))
    with pytest.raises(ValueError, match="mtp_depth=1"):
        hf.load(tmp_path, ["model.mtp_depth=1"])
    save_file({**tensors, **mtp, "model.layers.4.enorm.weight": np.ones(d, np.float32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.4.enorm.weight'\]"):
        hf.load(tmp_path)


@pytest.mark.parametrize("hf_model", ["v3"], indirect=True)  # V2's router has no bias
def test_nonzero_selection_bias_needs_bias_balancing(hf_model):
    _, path, _ = hf_model
    with pytest.raises(ValueError, match="e_score_correction_bias is not zero"):
        hf.load(path, ["model.moe.balance=aux_loss"])


def _base_config(**change):
    c = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
         "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, **MLA,
         "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
         "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
         "max_position_embeddings": 128}
    return {**c, **change}


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 differs"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"n_shared_experts": 0}, "n_shared_experts=0"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'llama3'"),
    ({"rope_scaling": {**YARN, "mscale": 0.8}}, "mscale=0.8, mscale_all_dim=None"),
    ({"rope_scaling": {**YARN, "attention_factor": 1.2}}, "attention_factor=1.2"),
    ({"rope_scaling": {**YARN, "truncate": False}}, "truncate=False"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
      "topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
     "norm_topk_prob=True"),
])
def test_unsupported_deepseek_config_is_a_clear_error(change, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_base_config(**change)))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        hf.load(tmp_path)


MODEL = ["model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=4",
         "model.mlp_dim=96", f"model.vocab_size={V}", "model.max_seq_len=128",
         "train.seq_len=64", "model.attention=mla"] + [
    f"model.mla.{k}={v}" for k, v in {**MLA, "q_lora_rank": 48}.items()]
MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.expert_mlp_dim=32",
       "model.moe.num_shared_experts=2", "model.moe.dense_layers=1"]
# jaxllm-initialised MLA models exported to HF: dense (V3 without MoE layers), V3 (sigmoid,
# groups, random selection bias, YaRN), V2 (softmax, top k not renormalised)
EXPORTS = {
    "dense_v3": [],
    "moe_v3": MOE + ["model.moe.router=sigmoid", "model.moe.n_groups=4", "model.moe.topk_groups=2",
                     "model.moe.routed_scaling=2.0", "model.moe.balance=bias"] + [
        f"model.rope_scaling.{k}={v}" for k, v in {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5,
                                                   "beta_fast": 16.0, "beta_slow": 2.0}.items()],
    "moe_v2": MOE + ["model.moe.norm_topk_prob=false", "model.moe.routed_scaling=1.5"],
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_saved_deepseek_loads_in_transformers(case, tmp_path):
    cfg = load_config(None, MODEL + EXPORTS[case])
    model = _perturbed(cfg)  # the selection bias too
    hf.save(model, cfg, tmp_path)

    tokens = _tokens(4, (2, 24))
    ref = _logits(model, tokens)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == {"moe_v2": "DeepseekV2ForCausalLM"}.get(
        case, "DeepseekV3ForCausalLM")
    assert np.abs(_torch_logits(theirs, tokens) - ref).max() < 1e-4
    back, back_cfg = hf.load(tmp_path)
    assert back_cfg.model == dataclasses.replace(cfg.model, init_std=back_cfg.model.init_std)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("change, message", [
    (MOE + ["model.moe.router=softmax"], "model.moe.norm_topk_prob=True: no Hugging Face "
                                         "counterpart in DeepseekV2ForCausalLM"),
    (MOE + ["model.moe.router=softmax", "model.moe.norm_topk_prob=false",
            "model.moe.n_groups=2"], "model.moe.n_groups to 1"),
    (MOE + ["model.moe.router=sigmoid", "model.moe.num_shared_experts=0"],
     "model.moe.num_shared_experts to 1 or more"),
    ([f"model.rope_scaling.{k}={v}" for k, v in {**YARN, "mscale": 0.8}.items()],
     "mscale_all_dim 0 with mscale 1"),
])
def test_unexportable_deepseek_config_is_a_clear_error(change, message):
    with pytest.raises(ValueError, match=message):
        hf.config_json(load_config(None, MODEL + change))


def test_yarn_is_exported_only_with_mla():
    """transformers' Llama-layout families scale YaRN otherwise (and jaxllm reads it only
    for DeepSeek): a grouped-query model with YaRN has no export."""
    cfg = load_config(None, ["model.n_layers=2"] + [f"model.rope_scaling.{k}={v}"
                                                     for k, v in YARN.items()])
    with pytest.raises(ValueError, match="rope_type='yarn' has no counterpart in "
                                         "LlamaForCausalLM"):
        hf.config_json(cfg)
