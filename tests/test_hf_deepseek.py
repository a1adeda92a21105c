"""Hugging Face interop of DeepSeek-V3 and V2 (MLA, DeepSeekMoE): parity with `transformers`
(logits, greedy decoding) on small random models, export to and round trip through HF
directories, V3's MTP layers (loaded into our MTP modules with parity against DeepSeek's
formula on transformers' modules, saved back identically), and the configs jaxllm refuses."""
import dataclasses
import json
import re

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
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

import jaxllm
from jaxllm import hf
from jaxllm.config import load_config
from jaxllm.hf import deepseek
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.inference.speculative import speculative_generate_ids
from jaxllm.model.mtp import mtp_losses

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


def _hf_model(case, path, seed=0, n_layers=3):
    cls, kwargs = CASES[case]
    c = getattr(transformers, cls)(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **MLA, **kwargs)
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


def test_deepseek_logits_and_round_trip_match_transformers(hf_model, tmp_path, monkeypatch,
                                                            capsys):
    case, path, ref_model = hf_model
    tokens = _tokens(1, (2, 40))
    ref = _torch_logits(ref_model, tokens)
    model, cfg = hf.load(path)
    m = cfg.model
    if case != "v2":  # transformers' V3 config counts one MTP layer; it saves none
        assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
        assert m.mtp_depth == 0 and model.mtp is None
        assert ("num_nextn_predict_layers=1 but the checkpoint holds 0 multi-token-prediction "
                "layer(s) (model.layers.3+): model.mtp_depth=0") in capsys.readouterr().err
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


def _hf_mtp_model(case, path, seed=0):
    """A DeepSeek-V3 checkpoint at `path` with one MTP layer (MLA, MoE), made of
    transformers' own modules: a random 4-layer model saved by transformers, whose last
    layer (model.layers.3, an MoE layer) is the MTP layer's decoder layer, beside random
    enorm, hnorm, eh_proj and shared_head.norm and the copies of the embedding and head;
    its config.json says 3 layers and num_nextn_predict_layers 1. Returns (the 3-layer
    model as transformers loads it, which skips the MTP layer; the MTP layer's modules)."""
    big = _hf_model(case, path / "four_layers", seed, n_layers=4)
    d, eps = big.config.hidden_size, big.config.rms_norm_eps
    mtp = torch.nn.Module()
    mtp.enorm, mtp.hnorm, mtp.shared_norm = (DeepseekV3RMSNorm(d, eps) for _ in range(3))
    mtp.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
    _randomize(mtp, seed + 1)  # norms 1 + N(0, 0.1), eh_proj N(0, 0.15)
    mtp.block, mtp.rotary = big.model.layers[3], big.model.rotary_emb
    tensors = load_file(str(path / "four_layers" / "model.safetensors"))
    tensors.update({f"model.layers.3.{k}": v.detach().numpy() for k, v in [
        ("enorm.weight", mtp.enorm.weight), ("hnorm.weight", mtp.hnorm.weight),
        ("eh_proj.weight", mtp.eh_proj.weight),
        ("shared_head.norm.weight", mtp.shared_norm.weight)]})
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    config = json.loads((path / "four_layers" / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(
        {**config, "num_hidden_layers": 3, "num_nextn_predict_layers": 1}))
    save_file(tensors, str(path / "model.safetensors"))
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval(), mtp


def _deepseek_mtp_logits(main, mtp, tokens):
    """DeepSeek-V3's MTP layer on the main model's output (after its final norm, as DeepSeek
    serving engines feed it), in torch: position i embeds token i+1 and predicts i+2.
    eh_proj over [enorm(embedding); hnorm(hidden)], the decoder layer, shared_head.norm,
    the head. -> (B, S-1, V)."""
    with torch.no_grad():
        ids = torch.tensor(tokens)
        h = main.model(ids).last_hidden_state[:, :-1]
        e = main.model.embed_tokens(ids[:, 1:])
        x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], dim=-1))
        s = x.shape[1]
        pos = torch.arange(s)[None]
        causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
        y = mtp.block(x, attention_mask=causal, position_ids=pos,
                      position_embeddings=mtp.rotary(x, pos))
        return main.lm_head(mtp.shared_norm(y)).numpy()


@pytest.fixture(scope="module", params=["v3", "v3_plain"])  # V2 has no MTP layers
def hf_mtp(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}_mtp")
    return (path, *_hf_mtp_model(request.param, path))


def test_mtp_layer_matches_deepseeks_formula(hf_mtp):
    """The checkpoint's MTP layer becomes our MTP module (model.mtp_depth 1, an MoE MLA
    block): its logits are DeepSeek's on transformers' modules, its training loss their
    cross-entropy, and it drafts: greedy MTP speculative decoding of the loaded model
    gives plain greedy decoding's tokens."""
    path, main, mtp = hf_mtp
    tokens = _tokens(5, (2, 24))
    ref = _deepseek_mtp_logits(main, mtp, tokens)
    model, cfg = hf.load(path)
    assert cfg.model.mtp_depth == 1 and cfg.model.moe.dense_layers == 1
    block = model.mtp.layers[0].block
    assert block.moe and type(block.attn).__name__ == "MLA"
    np.testing.assert_allclose(_logits(model, tokens), _torch_logits(main, tokens), atol=1e-4)

    ids = jnp.asarray(tokens, jnp.int32)
    _, h = model(ids, return_hidden=True)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1] - 1), (ids.shape[0], ids.shape[1] - 1))
    out, _ = model.mtp.layers[0](model.final_norm(h)[:, :-1], model.embed(ids[:, 1:]), pos)
    got = np.asarray(model.head_logits(out))
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()
    assert np.abs(ref).max() > 1.0  # not near-zero logits
    # the training loss of the MTP module is the cross-entropy of DeepSeek's logits
    _, h_in = model(ids[:, :-1], return_hidden=True)
    loss = mtp_losses(model, h_in, ids[:, 1:])[0][0]
    lse = torch.logsumexp(torch.tensor(ref[:, :-1]), -1)
    want = (lse - torch.tensor(ref[:, :-1]).gather(-1, torch.tensor(tokens[:, 2:, None]))[..., 0])
    np.testing.assert_allclose(float(loss), float(want.mean()), rtol=1e-5)
    # the MTP layer's own parts matter: without its selection bias the experts differ
    bias = model.mtp.layers[0].block.mlp.expert_bias
    kept = bias[...]
    bias[...] = jnp.zeros_like(kept)
    out, _ = model.mtp.layers[0](model.final_norm(h)[:, :-1], model.embed(ids[:, 1:]), pos)
    assert np.abs(np.asarray(model.head_logits(out)) - ref).max() > 1e-2
    bias[...] = kept

    params, prompt = decode_params(model, cfg), [_tokens(6, (9,)).tolist()]
    plain, _ = generate_ids(params, prompt, max_new_tokens=12, temperature=0, warmup=False)
    spec, _ = speculative_generate_ids(params, prompt, method="mtp", k=1, max_new_tokens=12,
                                       temperature=0, warmup=False)
    assert spec == plain


def test_mtp_checkpoint_round_trip_is_identical(hf_mtp, tmp_path):
    """HF (3 layers + 1 MTP layer) -> ours -> HF: the same tensor names, bit-identical
    (the MTP layer's copies of the embedding and head included), the same MTP fields.
    (Rotary pairs not interleaved are saved interleaved, as DeepSeek's checkpoints: those
    rows are permuted, and load back to the same parameters.)"""
    path = hf_mtp[0]
    model, cfg = hf.load(path)
    hf.save(model, cfg, tmp_path)
    theirs, ours = (load_file(str(p / "model.safetensors")) for p in (path, tmp_path))
    assert sorted(ours) == sorted(theirs)
    assert any(k.startswith("model.layers.3.mlp.experts.") for k in ours)
    interleaved = json.loads((path / "config.json").read_text()).get("rope_interleave", True)
    permuted = () if interleaved else ("q_proj", "q_b_proj", "kv_a_proj_with_mqa")
    for k in theirs:
        if not any(f".{p}." in k for p in permuted):
            np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"],
            config["first_k_dense_replace"]) == (3, 1, 1)
    back, back_cfg = hf.load(tmp_path)
    assert back_cfg.model == cfg.model
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mtp_layers_skipped_or_refused(hf_mtp, tmp_path, capsys):
    """model.mtp_depth=0 skips the MTP layer with a note (the main model unchanged); more
    MTP modules than the checkpoint has is an error; a copy of the embedding that differs
    from it is an error naming both tensors, an absent one is fine; a layer past the MTP
    layers is still an error."""
    path = hf_mtp[0]
    tokens = _tokens(2, (1, 12))
    full = _logits(hf.load(path)[0], tokens)
    model, cfg = hf.load(path, ["model.mtp_depth=0"])
    note = capsys.readouterr().err
    n = sum(k.startswith("model.layers.3.") for k in load_file(str(path / "model.safetensors")))
    assert (f"skipping 1 multi-token-prediction layer(s) (model.layers.3+, {n} tensors): "
            f"model.mtp_depth=0 of num_nextn_predict_layers=1") in note
    assert cfg.model.mtp_depth == 0 and model.mtp is None
    np.testing.assert_array_equal(_logits(model, tokens), full)
    with pytest.raises(ValueError, match="model.mtp_depth=2: the checkpoint holds 1 "
                                         "multi-token-prediction layer"):
        hf.load(path, ["model.mtp_depth=2"])

    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    copy = "model.layers.3.embed_tokens.weight"
    save_file({**tensors, copy: tensors[copy] + 0.5}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{copy} differs from model.embed_tokens.weight "
                                         r"\(by up to 0.5\)"):
        hf.load(tmp_path)
    del tensors[copy]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert hf.load(tmp_path)[1].model.mtp_depth == 1
    save_file({**tensors, "model.layers.4.enorm.weight": tensors["model.norm.weight"]},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.4.enorm.weight'\]"):
        hf.load(tmp_path)


def test_mtp_layers_of_another_kind_are_skipped(tmp_path, capsys):
    """A model whose main layers are all dense but whose MTP layer first_k_dense_replace
    makes an MoE layer: the MTP layer is skipped with a note saying why (our MTP block is
    an MoE block exactly in an MoE model); asking for it is an error."""
    cfg = load_config(None, MODEL + ["model.n_layers=2"])
    hf.save(jaxllm.build_model(cfg.model), cfg, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["first_k_dense_replace"] == 2
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    d = tensors["model.norm.weight"]
    save_file({**tensors, "model.layers.2.enorm.weight": d, "model.layers.2.mlp.gate.weight":
               np.ones((4, d.shape[0]), np.float32)}, str(tmp_path / "model.safetensors"))
    why = ("config.json first_k_dense_replace=2 makes the main layers (num_hidden_layers=2) "
           "dense but MTP layer 2 an MoE layer")
    assert hf.load(tmp_path)[1].model.mtp_depth == 0
    assert f"(model.layers.2+, 2 tensors): {why}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=re.escape(why)):
        hf.load(tmp_path, ["model.mtp_depth=1"])


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
# groups, random selection bias, YaRN), V2 (softmax, top k not renormalised); the V3 ones
# with an MTP module (dense, MoE)
EXPORTS = {
    "dense_v3": ["model.mtp_depth=1"],
    "moe_v3": MOE + ["model.moe.router=sigmoid", "model.moe.n_groups=4", "model.moe.topk_groups=2",
                     "model.moe.routed_scaling=2.0", "model.moe.balance=bias",
                     "model.mtp_depth=1"] + [
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
    config = json.loads((tmp_path / "config.json").read_text())
    if cfg.model.mtp_depth:  # MTP layer 3: an MoE layer in an MoE model, else dense
        assert config["num_nextn_predict_layers"] == 1
        assert (config["first_k_dense_replace"] <= 3) == (cfg.model.moe is not None)


def test_mtp_modules_save_only_as_deepseek_v3(tmp_path):
    """MTP modules have a Hugging Face form only in DeepSeek-V3: a V2 export (or a
    Llama-layout one) with them is an error naming drop_mtp, which saves the model
    without them."""
    for extra in (EXPORTS["moe_v2"], ["model.attention=gqa", "model.n_kv_heads=2"]):
        overrides = MODEL + extra + ["model.mtp_depth=1"]
        if "model.attention=gqa" in extra:
            overrides = [o for o in overrides if not o.startswith("model.mla.")]
        cfg = load_config(None, overrides)
        model = jaxllm.build_model(cfg.model)
        with pytest.raises(ValueError, match=r"model.mtp_depth=1: \w+ has no multi-token-"
                                             r"prediction layers .* pass drop_mtp=True"):
            hf.save(model, cfg, tmp_path)
        hf.save(model, cfg, tmp_path, drop_mtp=True)
        assert not any(k.startswith("model.layers.3.")
                       for k in load_file(str(tmp_path / "model.safetensors")))
        back, back_cfg = hf.load(tmp_path)
        assert back_cfg.model.mtp_depth == 0
        np.testing.assert_array_equal(_logits(back, _tokens(1, (1, 8))),
                                      _logits(model, _tokens(1, (1, 8))))


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
