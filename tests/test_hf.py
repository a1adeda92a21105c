"""Hugging Face interop: parity with `transformers` (PyTorch CPU) on small random models."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extra pins its CPU build
import transformers
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxllm
from jaxllm import hf
from jaxllm.config import ModelConfig, ParallelismConfig, load_config
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.params import decode_params
from jaxllm.sharding.mesh import make_mesh

V = 101
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# name -> (config class, config kwargs)
CASES = {
    "llama_mha": ("LlamaConfig", dict(num_key_value_heads=4)),
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2, head_dim=24)),
    "llama3_scaled": ("LlamaConfig", dict(num_key_value_heads=2, rope_scaling=LLAMA3,
                                          rope_theta=500000.0)),
    "mistral_window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=6)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32)),  # != 64 / 4
}


def _randomize(model, seed):
    """Weights large enough that attention patterns, RoPE and masks matter (HF inits
    biases to zero and matrices at std 0.02)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def _hf_model(case, path, seed=0, vocab=V, **extra):
    cls, kwargs = CASES[case]
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=vocab, max_position_embeddings=128,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    c = getattr(transformers, cls)(**{**base, **kwargs, **extra})
    torch.manual_seed(seed)
    model = _randomize(transformers.AutoModelForCausalLM.from_config(c), seed)
    model.save_pretrained(path)
    return model


def _tokens(seed, shape, vocab=V):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _greedy_pair(ref_model, path, prompt) -> tuple[list[int], list[int]]:
    """(ours, transformers') 20 greedy tokens after `prompt`, ours from the checkpoint at path."""
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                                 min_new_tokens=20)[0, len(prompt):].tolist()
    model, cfg = hf.load(path)
    got, _ = generate_ids(decode_params(model, cfg), [prompt], max_new_tokens=20,
                          temperature=0.0, warmup=False)
    return got[0], ref


def _check_saved_again(model, cfg, path, ref_model, tokens, ref):
    """Saved to path: transformers loads ref_model's class with logits `ref`, and we load
    the same config and bit-identical parameters."""
    hf.save(model, cfg, path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(theirs) is type(ref_model)
    np.testing.assert_allclose(_torch_logits(theirs, tokens), ref, rtol=0, atol=1e-6)
    back, back_cfg = hf.load(path)
    assert back_cfg.model == cfg.model
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _perturbed(cfg, *filters):
    """A fresh model of cfg with N(0, 0.15) added to its state (of `filters`, default all),
    so that exports carry non-trivial biases, norm scales and selection biases."""
    model = jaxllm.build_model(cfg.model, rngs=nnx.Rngs(0))
    leaves, treedef = jax.tree.flatten(nnx.state(model, *filters))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [
        x + 0.15 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    ref_model = _hf_model(case, tmp_path)
    tokens = _tokens(1, (2, 40))
    ref = _torch_logits(ref_model, tokens)
    if case == "llama3_scaled":  # transformers 5 writes the Llama 3 scaling this way
        assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"][
            "rope_type"] == "llama3"
    model, cfg = hf.load(tmp_path)
    got = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits
    # the feature under test changes the logits (so the parity above covers it)
    if cfg.model.rope_scaling or cfg.model.sliding_window:
        plain = dataclasses.replace(cfg.model, rope_scaling=None, sliding_window=None)
        off = nnx.merge(nnx.graphdef(jaxllm.build_model(plain)), nnx.state(model))
        assert np.abs(np.asarray(off(jnp.asarray(tokens, jnp.int32))) - ref).max() > 1e-2


@pytest.mark.parametrize("case", ["llama3_scaled", "mistral_window", "qwen2", "qwen3"])
def test_greedy_generation_matches_transformers(case, tmp_path):
    ref_model = _hf_model(case, tmp_path, seed=2)
    got, ref = _greedy_pair(ref_model, tmp_path, _tokens(3, (9,)).tolist())
    assert got == ref


# jaxllm-initialised models exported to HF: Llama, Mistral (window) and Qwen2 (biases)
EXPORTS = {
    "llama": ["model.n_kv_heads=2"],
    "mistral_tied_llama3": ["model.n_kv_heads=1", "model.tie_embeddings=true",
                            "model.sliding_window=5"] + [
        f"model.rope_scaling.{k}={v}" for k, v in [
            ("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1),
            ("high_freq_factor", 4), ("original_max_position_embeddings", 32)]],
    "qwen2_window": ["model.n_kv_heads=2", "model.qkv_bias=true", "model.sliding_window=7"],
    "qwen3": ["model.n_kv_heads=2", "model.qk_norm=true", "model.head_dim=24"],
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_saved_checkpoint_loads_in_transformers(case, tmp_path):
    cfg = load_config(None, ["model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                             "model.mlp_dim=96", f"model.vocab_size={V}",
                             "model.max_seq_len=128", "train.seq_len=64"] + EXPORTS[case])
    model = _perturbed(cfg, nnx.Param)  # random biases and norm scales too
    hf.save(model, cfg, tmp_path)

    tokens = _tokens(4, (2, 24))
    ref = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == json.loads((tmp_path / "config.json").read_text())[
        "architectures"][0]
    assert np.abs(_torch_logits(theirs, tokens) - ref).max() < 1e-4

    # load(save(model)) is the same model
    back, back_cfg = hf.load(tmp_path)
    assert back_cfg.model == dataclasses.replace(cfg.model, init_std=ModelConfig.init_std)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bf16, bf16_cfg = hf.load(tmp_path, ["model.param_dtype=bfloat16"])
    assert {x.dtype for x in jax.tree.leaves(nnx.state(bf16))} == {jnp.dtype(jnp.bfloat16)}
    if cfg.model.qk_norm:  # the fused one-row decode path has no head norm
        assert decode_params(back, back_cfg).fused_rows == 0
        with pytest.raises(ValueError, match="qk_norm"):
            decode_params(back, back_cfg.replace(inference=dataclasses.replace(
                back_cfg.inference, matmul_impl="pallas_triton")))


def test_sharded_checkpoint_and_placement(tmp_path):
    ref_model = _hf_model("llama_gqa", tmp_path / "one")
    ref_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    one, _ = hf.load(tmp_path / "one")
    # a given shardings tree: every parameter replicated but up (mlp split)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), nnx.to_pure_dict(nnx.state(one)))
    shardings["blocks"]["mlp"]["up"]["kernel"] = NamedSharding(mesh, P(None, None, "x"))
    sharded, _ = hf.load(tmp_path / "sharded", shardings=shardings)
    for a, b in zip(jax.tree.leaves(nnx.state(one)), jax.tree.leaves(nnx.state(sharded))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    up = sharded.blocks.mlp.up.kernel[...]
    assert up.sharding == shardings["blocks"]["mlp"]["up"]["kernel"]
    assert up.addressable_shards[0].data.shape == (2, 64, 48)
    # a mesh: the sharding rules place each parameter (fsdp on embed, tp on heads / mlp)
    mesh = make_mesh(ParallelismConfig(dp=1, fsdp=2, tp=2), jax.devices()[:4])
    placed, _ = hf.load(tmp_path / "sharded", mesh=mesh)
    q = placed.blocks.attn.q.kernel[...]  # [L, d, Hq, D]
    assert q.sharding.spec == P(None, "fsdp", "tp", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 2, 24)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(one.blocks.attn.q.kernel[...]))


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
      "sliding_window": 8, "max_window_layers": 1}, "mixes sliding-window"),
])
def test_unsupported_config_is_a_clear_error(change, message, tmp_path):
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": V, **change}
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        hf.load(tmp_path)


def _text_model(case, path, seed=5):
    """An HF model directory with a small BPE tokenizer.json (a BOS post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
            "all that glitters is not gold; fortune favours the bold.\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text] * 4, trainers.BpeTrainer(vocab_size=120,
                                                            special_tokens=["<s>", "</s>"]))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    ref_model = _hf_model(case, path, seed=seed, vocab=tok.get_vocab_size(), bos_token_id=bos,
                          eos_token_id=eos)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    return ref_model, bos, eos


@pytest.mark.parametrize("case", ["llama3_scaled", "mistral_window", "qwen2", "qwen3"])
def test_cli_text_generation_per_family(case, tmp_path, capsys):
    """python -m jaxllm.generate --hf DIR (in process) from text: transformers' tokens."""
    from jaxllm.generate import main

    ref_model, _, eos = _text_model(case, tmp_path, seed=7)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>"}))
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    prompt = "a stitch in"
    ids = ref_tok(prompt).input_ids
    with torch.no_grad():
        out = ref_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10,
                                 eos_token_id=eos)[0, len(ids):].tolist()
    out = out[:-1] if out[-1] == eos else out
    assert len(out) >= 3  # text to compare
    assert main(["--hf", str(tmp_path), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == prompt + ref_tok.decode(out, skip_special_tokens=True) + "\n"


def test_cli_generates_like_transformers(tmp_path):
    ref_model, bos, eos = _text_model("llama_gqa", tmp_path)
    template = ("{% for m in messages %}{{ bos_token + m['role'] + ': ' + m['content'] + "
                "eos_token }}{% endfor %}{% if add_generation_prompt %}{{ bos_token + "
                "'assistant:' }}{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)

    def reference(ids, stop):
        with torch.no_grad():
            return ref_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12,
                                      eos_token_id=stop)[0, len(ids):].tolist()

    prompt = "the lazy fox"
    ids = ref_tok(prompt).input_ids
    assert ids[0] == bos
    # generation_config.json: greedy, 12 tokens, and a second stop id the greedy text meets
    out = reference(ids, [eos])
    stop = next(t for j, t in enumerate(out) if j >= 3 and t not in out[:j])
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "max_new_tokens": 12, "eos_token_id": [eos, stop]}))
    out = reference(ids, [eos, stop])
    assert len(out) < 12 and out[-1] == stop  # our output stops before the stop id
    expected = prompt + ref_tok.decode(out[:-1], skip_special_tokens=True)

    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-m", "jaxllm.generate", "--hf", str(tmp_path),
                          "--prompt", prompt], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected + "\n"
    assert len(expected) > len(prompt)
    assert "temperature=0.0 (generation_config.json)" in run.stderr
    assert "max_new_tokens=12 (generation_config.json)" in run.stderr

    # a chat turn: the template's ids, the same reply as transformers
    messages = [{"role": "user", "content": "the quick dog"}]
    chat_ids = ref_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
    model, cfg = hf.load(tmp_path)
    reply = jaxllm.chat(model, cfg, messages)
    out = reference(chat_ids, [eos, stop])
    out = out[:-1] if out[-1] in (eos, stop) else out
    assert reply == ref_tok.decode(out, skip_special_tokens=True)


def test_bf16_load_makes_no_f32_copy(tmp_path):
    """A bf16 checkpoint into bf16 parameters: the host arrays alive while loading are one
    stacked parameter and one tensor at a time (the MLP weights here, about a fifth of the
    checkpoint each), never a copy of the whole model, let alone an f32 one."""
    import tracemalloc

    _hf_model("llama_gqa", tmp_path / "f32", vocab=2000, num_hidden_layers=4,
              hidden_size=256, intermediate_size=768).to(torch.bfloat16).save_pretrained(
        tmp_path / "bf16")
    size = sum(f.stat().st_size for f in (tmp_path / "bf16").glob("*.safetensors"))
    bf16 = ["model.param_dtype=bfloat16", "model.dtype=bfloat16"]
    hf.load(tmp_path / "bf16", bf16)  # once untraced: what is built once (shapes, jit caches)
    tracemalloc.start()
    model, _ = hf.load(tmp_path / "bf16", bf16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.bfloat16)}
    assert peak < 0.4 * size, (peak, size)


def test_several_eos_ids_stop_rows_in_speculative_decoding():
    """generation_config.json may list several EOS ids: each row stops at the first of any."""
    from jaxllm.inference.speculative import speculative_generate_ids

    cfg = load_config(None, ["model.d_model=64", "model.n_layers=1", "model.n_heads=4",
                             "model.mlp_dim=96", f"model.vocab_size={V}", "train.seq_len=64"])
    model = jaxllm.build_model(cfg.model, rngs=nnx.Rngs(0))
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [
        x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]))
    params = decode_params(model, cfg)
    prompts = [_tokens(5, (3,)).tolist(), _tokens(6, (5,)).tolist()]
    greedy = dict(max_new_tokens=16, temperature=0.0, warmup=False)
    full, _ = generate_ids(params, prompts, **greedy)
    stops = (full[0][5], full[1][8])
    cuts = [row[:next(i for i, t in enumerate(row) if t in stops)] for row in full]
    assert min(map(len, cuts)) >= 1 and cuts != full
    spec, _ = speculative_generate_ids(params, prompts, method="draft", k=2, draft=params,
                                       eos_id=list(stops), **greedy)
    assert spec == cuts  # plain decoding with a list: test_cli_generates_like_transformers
