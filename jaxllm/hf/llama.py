"""The Llama-layout families: Llama (Llama 3 RoPE scaling included), Mistral (sliding
window), Qwen2 (q/k/v biases), Qwen3 (q/k head norms), and the MoE Mixtral and Qwen3-MoE
(their router and experts: hf/moe.py).

They share one weight layout (WEIGHTS) and differ in a few config.json fields (the
`Family` fields). Our RoPE rotates halves (`rotate_half`), as HF Llama does, so q/k
weights load without a permutation.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config import Config
from jaxllm.hf.common import require, rope_params, rope_scaling_json
from jaxllm.hf.moe import expert_weights, moe_json, moe_section


@dataclass(frozen=True)
class Family:
    model_type: str
    qkv_bias: bool  # biases on q/k/v (and on nothing else)
    window: str  # "none": no sliding window; "all": config.sliding_window on every layer;
    #              "layer_types": use_sliding_window + layer_types / max_window_layers (Qwen2);
    #              "flag": use_sliding_window puts config.sliding_window on every layer
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before RoPE (Qwen3)
    # MoE feed-forward in every layer (but Qwen3-MoE's dense ones): the module holding
    # one layer's router (`.gate`) and experts (`.experts.N.`), and the names of an
    # expert's gate, up and down projections
    experts: tuple[str, tuple[str, str, str]] | None = None

    def model_section(self, c: dict) -> dict:
        return model_section(c, self)

    def weights(self, c: dict, m) -> dict:
        """Our parameter path -> (HF name, layout) (hf/tensors.py)."""
        if m.mtp_depth:
            raise ValueError(f"model.mtp_depth={m.mtp_depth}: {self.model_type} checkpoints "
                             f"hold no multi-token-prediction layers (DeepSeek-V3's do); "
                             f"load without it")
        return expert_weights(self, WEIGHTS)

    def copies(self, c: dict, m) -> dict:
        """HF tensors that copy others: none."""
        return {}

    def unread(self, c: dict, names, m) -> set:
        """Checkpoint tensors deliberately not read: none."""
        return set()


FAMILIES = {
    "LlamaForCausalLM": Family("llama", qkv_bias=False, window="none"),
    "MistralForCausalLM": Family("mistral", qkv_bias=False, window="all"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, window="layer_types"),
    "Qwen3ForCausalLM": Family("qwen3", qkv_bias=False, window="layer_types", qk_norm=True),
    "MixtralForCausalLM": Family("mixtral", qkv_bias=False, window="all",
                                 experts=("block_sparse_moe", ("w1", "w3", "w2"))),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qkv_bias=False, window="flag", qk_norm=True,
                                  experts=("mlp", ("gate_proj", "up_proj", "down_proj"))),
}

# our parameter path -> (HF tensor name, layout); "{i}" is the layer of a stacked block
# ("dense_blocks/..." take the "blocks/..." names: the first layers), "{e}" an expert
WEIGHTS = {
    "embed/embedding": ("model.embed_tokens.weight", "same"),
    "blocks/attn_norm/scale": ("model.layers.{i}.input_layernorm.weight", "same"),
    "blocks/attn/q/kernel": ("model.layers.{i}.self_attn.q_proj.weight", "T1"),
    "blocks/attn/k/kernel": ("model.layers.{i}.self_attn.k_proj.weight", "T1"),
    "blocks/attn/v/kernel": ("model.layers.{i}.self_attn.v_proj.weight", "T1"),
    "blocks/attn/q/bias": ("model.layers.{i}.self_attn.q_proj.bias", "flat"),
    "blocks/attn/k/bias": ("model.layers.{i}.self_attn.k_proj.bias", "flat"),
    "blocks/attn/v/bias": ("model.layers.{i}.self_attn.v_proj.bias", "flat"),
    "blocks/attn/q_norm/scale": ("model.layers.{i}.self_attn.q_norm.weight", "same"),
    "blocks/attn/k_norm/scale": ("model.layers.{i}.self_attn.k_norm.weight", "same"),
    "blocks/attn/o/kernel": ("model.layers.{i}.self_attn.o_proj.weight", "T2"),
    "blocks/mlp_norm/scale": ("model.layers.{i}.post_attention_layernorm.weight", "same"),
    "blocks/mlp/gate/kernel": ("model.layers.{i}.mlp.gate_proj.weight", "T1"),
    "blocks/mlp/up/kernel": ("model.layers.{i}.mlp.up_proj.weight", "T1"),
    "blocks/mlp/down/kernel": ("model.layers.{i}.mlp.down_proj.weight", "T1"),
    "final_norm/scale": ("model.norm.weight", "same"),
    "head/kernel": ("lm_head.weight", "T1"),
}


def _rope(c: dict) -> tuple[float, dict | None]:
    """(rope_theta, our model.rope_scaling as a mapping): none or Llama 3's."""
    theta, kind, params = rope_params(c)
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config.json rope scaling type {kind!r} is not supported; "
                         f"jaxllm reads 'default' and 'llama3'")
    return theta, {
        "rope_type": "llama3", "factor": params["factor"],
        "low_freq_factor": params["low_freq_factor"],
        "high_freq_factor": params["high_freq_factor"],
        "original_max_position_embeddings": params.get(
            "original_max_position_embeddings", c.get("max_position_embeddings"))}


def _sliding_window(c: dict, fam: Family, n_layers: int) -> int | None:
    window = c.get("sliding_window") if fam.window != "none" else None
    if window is None or fam.window == "all":
        return window
    if not c.get("use_sliding_window", False):
        return None
    if fam.window == "flag":
        return window
    kinds = c.get("layer_types") or ["sliding_attention" if i >= c.get("max_window_layers", 0)
                                     else "full_attention" for i in range(n_layers)]
    if set(kinds) == {"full_attention"}:
        return None
    if set(kinds) == {"sliding_attention"}:
        return window
    raise ValueError(f"config.json mixes sliding-window and full-attention layers "
                     f"({sorted(set(kinds))}); jaxllm uses one kind for all layers")


def model_section(c: dict, fam: Family) -> dict:
    """Our `model:` config section for a Llama-layout config.json (ValueError if unsupported)."""
    require(c, "hidden_act", ("silu",), "silu")
    require(c, "attention_bias", (False,), False)  # Llama's also puts a bias on o_proj
    require(c, "mlp_bias", (False,), False)
    try:
        n_layers, n_heads = c["num_hidden_layers"], c["num_attention_heads"]
        d_model = c["hidden_size"]
        section = dict(vocab_size=c["vocab_size"], d_model=d_model, n_layers=n_layers,
                       n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
                       mlp_dim=c["intermediate_size"])
        if fam.experts is not None:
            section["moe"] = moe_section(c, fam, n_layers)
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from None
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim != d_model // n_heads:
        section["head_dim"] = head_dim
    theta, scaling = _rope(c)
    section.update(rope_theta=theta, rope_scaling=scaling,
                   sliding_window=_sliding_window(c, fam, n_layers),
                   norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=fam.qkv_bias, qk_norm=fam.qk_norm,
                   max_seq_len=c.get("max_position_embeddings", 2048))
    return section


def config_json(cfg: Config, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The HF config.json of a grouped-query model: with model.moe Qwen3-MoE (q/k head
    norms) or Mixtral; else Qwen3 with q/k head norms, Qwen2 with q/k/v biases, else
    Mistral with a sliding window, else Llama."""
    m = cfg.model
    if m.qk_norm and m.qkv_bias:
        raise ValueError("model.qk_norm with model.qkv_bias has no Hugging Face family "
                         "(Qwen3's attention_bias also biases o_proj); set one of them false")
    if m.moe is not None:
        arch = "Qwen3MoeForCausalLM" if m.qk_norm else "MixtralForCausalLM"
    else:
        arch = ("Qwen3ForCausalLM" if m.qk_norm else "Qwen2ForCausalLM" if m.qkv_bias else
                "MistralForCausalLM" if m.sliding_window else "LlamaForCausalLM")
    c = {"architectures": [arch], "model_type": FAMILIES[arch].model_type,
         "vocab_size": m.vocab_size, "hidden_size": m.d_model,
         "intermediate_size": m.mlp_dim, "num_hidden_layers": m.n_layers,
         "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
         "head_dim": m.resolved_head_dim, "hidden_act": "silu",
         "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
         "rope_theta": m.rope_theta, "rope_scaling": rope_scaling_json(m.rope_scaling),
         "tie_word_embeddings": m.tie_embeddings, "bos_token_id": bos_id,
         "eos_token_id": eos_id, "torch_dtype": m.param_dtype}
    if m.rope_scaling is not None and m.rope_scaling.rope_type != "llama3":
        raise ValueError(f"model.rope_scaling.rope_type={m.rope_scaling.rope_type!r} has no "
                         f"counterpart in {arch} here (jaxllm exports YaRN with MLA, as "
                         f"DeepSeek); use 'llama3' or no rope_scaling")
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        c.update(attention_bias=False)
    if m.moe is not None:
        c.update(moe_json(m, arch))
    if arch == "LlamaForCausalLM":
        c.update(mlp_bias=False)
    elif arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        c.update(sliding_window=m.sliding_window)
    elif arch == "Qwen3MoeForCausalLM":
        c.update(sliding_window=m.sliding_window, use_sliding_window=bool(m.sliding_window))
    else:
        c.update(sliding_window=m.sliding_window, use_sliding_window=bool(m.sliding_window),
                 max_window_layers=0 if m.sliding_window else m.n_layers,
                 layer_types=[("sliding" if m.sliding_window else "full") + "_attention"]
                 * m.n_layers)
    return c
