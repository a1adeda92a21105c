"""Hugging Face checkpoints: load a model directory into jaxllm, save one `transformers` loads.

    model, cfg = jaxllm.hf.load("Llama-3.2-1B")   # config.json, *.safetensors, tokenizer.json
    model, cfg = jaxllm.hf.load(d, ["model.param_dtype=bfloat16", "model.dtype=bfloat16"])
    jaxllm.hf.save(model, cfg, "out")             # config.json, model.safetensors, tokenizer

Families: Llama (Llama 3 RoPE scaling included), Mistral (sliding window), Qwen2 (q/k/v
biases) and Qwen3 dense (q/k head norms), with any GQA ratio, and the mixture-of-experts
Mixtral (Mistral's attention) and Qwen3-MoE (Qwen3's). They share one weight layout
(WEIGHTS below) and differ in a few config.json fields (FAMILIES); the MoE families add one
layer's router and experts under their own names (`_expert_weights`). Our RoPE rotates
halves (`rotate_half`), as HF Llama does, so q/k weights load without a permutation; HF
linear weights are [out, in], ours [*in, *out]. Loading reads one tensor at a time from
the safetensors files and stacks the layers into our [L, ...] parameters (and an MoE
layer's per-expert tensors into our [L, E, ...] ones), placing each on its sharding when
given one.

Both MoE families route as model/moe.py's softmax router does: softmax of the router
logits in float32, the top k, renormalised to sum to 1 (Mixtral always, Qwen3-MoE with
norm_topk_prob). Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) are our
moe.dense_layers when they come before all MoE layers, the form its checkpoints take.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxllm.config import Config, ModelConfig, TrainConfig, apply_overrides, config_from_dict


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
# ("dense_blocks/..." take the "blocks/..." names: the first layers), "{e}" an expert.
# layout: "same" (identical), "flat" (ours [H, D], HF [H*D]), "T1" / "T2" (ours
# [*in, *out] with 1 or 2 input axes, HF [out, in]).
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
IGNORED = (".rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here


def _expert_weights(fam: Family) -> dict:
    """WEIGHTS with the family's MoE layer: router ours [d, E], HF [E, d]; each expert's
    slice of our stacked gate / up [E, d, f] and down [E, f, d] one HF linear weight."""
    if fam.experts is None:
        return WEIGHTS
    module, projections = fam.experts
    layer = f"model.layers.{{i}}.{module}"
    table = {**WEIGHTS, "blocks/mlp/router": (f"{layer}.gate.weight", "T1")}
    for ours, theirs in zip(("gate", "up", "down"), projections):
        table[f"blocks/mlp/{ours}"] = (f"{layer}.experts.{{e}}.{theirs}.weight", "T1")
    return table


def _slots(ours: str, shape, name: str, n_dense: int) -> list[tuple[tuple, str]]:
    """(index into our parameter, HF tensor name) of each HF tensor parameter `ours` of
    `shape` holds: one for a plain one, one per layer of a stack (blocks follow the
    n_dense dense_blocks), one per layer and expert of stacked experts."""
    if not ours.startswith(("blocks/", "dense_blocks/")):
        return [((), name)]
    first = n_dense if ours.startswith("blocks/") else 0
    if "{e}" not in name:
        return [((i,), name.format(i=first + i)) for i in range(shape[0])]
    return [((i, e), name.format(i=first + i, e=e))
            for i in range(shape[0]) for e in range(shape[1])]


def _lookup(table: dict, ours: str) -> tuple[str, str]:
    """(HF name, layout) of our parameter path; the dense_blocks share the blocks' names."""
    key = "blocks/" + ours[len("dense_blocks/"):] if ours.startswith("dense_blocks/") else ours
    if key not in table:
        raise ValueError(f"parameter {ours!r} has no Hugging Face counterpart")
    return table[key]


def _hf_shape(shape, layout: str) -> tuple:
    if layout == "same":
        return tuple(shape)
    if layout == "flat":
        return (math.prod(shape),)
    n = int(layout[1])
    return (math.prod(shape[n:]), math.prod(shape[:n]))



def _to_hf(x: np.ndarray, layout: str) -> np.ndarray:
    hf = _hf_shape(x.shape, layout)
    return np.ascontiguousarray(x.reshape(hf[::-1]).T) if layout[0] == "T" else x.reshape(hf)


# ---------------------------------------------------------------------------------------
# config.json <-> our config


def _family(c: dict) -> Family:
    arch = (c.get("architectures") or [None])[0]
    by_type = {f.model_type: f for f in FAMILIES.values()}
    fam = FAMILIES.get(arch) or (by_type.get(c.get("model_type")) if arch is None else None)
    if fam is None:
        raise ValueError(f"unsupported architecture {arch!r} (model_type "
                         f"{c.get('model_type')!r}); jaxllm.hf reads {sorted(FAMILIES)}")
    return fam


def _require(c: dict, key: str, allowed, default):
    value = c.get(key, default)
    if value not in allowed:
        raise ValueError(f"config.json {key}={value!r} is not supported; jaxllm reads "
                         f"{' or '.join(map(repr, allowed))}")


def _rope(c: dict) -> tuple[float, dict | None]:
    """(rope_theta, our model.rope_scaling as a mapping) from either config.json form:
    `rope_theta` and `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5)."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json partial_rotary_factor != 1 is not supported")
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


def model_section(c: dict) -> dict:
    """Our `model:` config section for an HF config.json dict (ValueError if unsupported)."""
    fam = _family(c)
    _require(c, "hidden_act", ("silu",), "silu")
    _require(c, "attention_bias", (False,), False)  # Llama's also puts a bias on o_proj
    _require(c, "mlp_bias", (False,), False)
    try:
        n_layers, n_heads = c["num_hidden_layers"], c["num_attention_heads"]
        d_model = c["hidden_size"]
        section = dict(vocab_size=c["vocab_size"], d_model=d_model, n_layers=n_layers,
                       n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
                       mlp_dim=c["intermediate_size"])
        if fam.experts is not None:
            section["moe"] = _moe_section(c, fam, n_layers)
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


def _moe_section(c: dict, fam: Family, n_layers: int) -> dict:
    """Our model.moe for a Mixtral or Qwen3-MoE config.json (KeyError for a missing key).

    Fine-tuning balances with the Switch loss weighted by router_aux_loss_coef, the loss
    transformers adds. Mixtral's expert width is its intermediate_size (model.mlp_dim,
    which no layer then uses, takes it too); Qwen3-MoE's is moe_intermediate_size, its
    dense layers' intermediate_size.
    """
    experts = c.get("num_local_experts", c.get("num_experts"))  # Qwen3-MoE: either name
    if experts is None:
        raise KeyError("num_local_experts")
    moe = dict(num_experts=experts, top_k=c["num_experts_per_tok"], router="softmax",
               balance="aux_loss", aux_loss_weight=float(c.get("router_aux_loss_coef", 0.001)))
    if fam.model_type == "mixtral":
        _require(c, "router_jitter_noise", (0.0,), 0.0)
        return dict(moe, expert_mlp_dim=c["intermediate_size"], norm_topk_prob=True)
    step, dense_only = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json decoder_sparse_step={step!r} must be a positive integer")
    # transformers' rule: layer i is MoE unless listed in mlp_only_layers or (i+1) % step
    dense = [i for i in range(n_layers) if i in dense_only or (i + 1) % step]
    if dense != list(range(len(dense))) or len(dense) == n_layers:
        raise ValueError(f"config.json decoder_sparse_step={step}, mlp_only_layers="
                         f"{dense_only} make layers {dense} of {n_layers} dense; jaxllm "
                         f"supports dense layers only before all MoE layers, at least one "
                         f"MoE layer (decoder_sparse_step=1, mlp_only_layers=[0, ..., k-1])")
    return dict(moe, expert_mlp_dim=c["moe_intermediate_size"],
                norm_topk_prob=bool(c.get("norm_topk_prob", False)), dense_layers=len(dense))


def _moe_json(m: ModelConfig, arch: str) -> dict:
    """The MoE fields of config.json for model.moe (ValueError where the family has no
    counterpart: another router, shared experts, expert groups, scaled weights)."""
    moe = m.moe
    # model.<key>: (ours, the only value the family has)
    fields = {"moe.router": (moe.router, "softmax"),
              "moe.num_shared_experts": (moe.num_shared_experts, 0),
              "moe.n_groups": (moe.n_groups, 1), "moe.routed_scaling": (moe.routed_scaling, 1.0),
              "qkv_bias": (m.qkv_bias, False)}
    if arch == "MixtralForCausalLM":
        fields.update({"moe.norm_topk_prob": (moe.norm_topk_prob, True),
                       "moe.dense_layers": (moe.dense_layers, 0)})
    off = {k: (ours, theirs) for k, (ours, theirs) in fields.items() if ours != theirs}
    if off:
        raise ValueError(
            ", ".join(f"model.{k}={ours!r}" for k, (ours, _) in off.items())
            + f": no Hugging Face counterpart in {arch}; jaxllm exports MoE models as Mixtral "
            f"(softmax router, renormalised top k, no shared experts or dense layers) or, "
            f"with model.qk_norm, Qwen3-MoE (dense first layers allowed, norm_topk_prob "
            f"either way); set " + " and ".join(f"model.{k}={theirs!r}"
                                               for k, (_, theirs) in off.items()))
    c = {"num_experts_per_tok": moe.top_k, "output_router_logits": False,
         "router_aux_loss_coef": moe.aux_loss_weight if moe.balance == "aux_loss" else 0.0}
    if arch == "MixtralForCausalLM":
        return {**c, "num_local_experts": moe.num_experts,
                "intermediate_size": moe.expert_mlp_dim, "router_jitter_noise": 0.0}
    return {**c, "num_experts": moe.num_experts, "moe_intermediate_size": moe.expert_mlp_dim,
            "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.dense_layers))}


def config_json(cfg: Config, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The HF config.json of our model config: with model.moe Qwen3-MoE (q/k head norms)
    or Mixtral; else Qwen3 with q/k head norms, Qwen2 with q/k/v biases, else Mistral with
    a sliding window, else Llama."""
    m = cfg.model
    if m.attention != "gqa":
        raise ValueError(f"model.attention={m.attention!r} has no Hugging Face export here; "
                         f"only grouped-query attention models are exported")
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
         "rope_theta": m.rope_theta,
         "rope_scaling": {k: v for k, v in dataclasses.asdict(m.rope_scaling).items()
                          if v is not None} if m.rope_scaling else None,
         "tie_word_embeddings": m.tie_embeddings, "bos_token_id": bos_id,
         "eos_token_id": eos_id, "torch_dtype": m.param_dtype}
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        c.update(attention_bias=False)
    if m.moe is not None:
        c.update(_moe_json(m, arch))
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


def generation_defaults(path) -> dict:
    """Our `inference:` values from the directory's generation_config.json ({} without one),
    as transformers' `generate` reads it: greedy unless do_sample, else its temperature,
    top_k and top_p (transformers' defaults 1.0, 50, 1.0 where absent)."""
    f = Path(path) / "generation_config.json"
    if not f.exists():
        return {}
    g = {k: v for k, v in json.loads(f.read_text()).items() if v is not None}
    out = {"max_new_tokens": g["max_new_tokens"]} if g.get("max_new_tokens") else {}
    if not g.get("do_sample", False):
        return {**out, "temperature": 0.0}
    return {**out, "temperature": float(g.get("temperature", 1.0)),
            "top_k": int(g.get("top_k", 50)), "top_p": float(g.get("top_p", 1.0))}


# ---------------------------------------------------------------------------------------
# loading


class _Tensors:
    """Tensors by name over one or several (indexed) safetensors files."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: path / f for k, f in json.loads(index.read_text())["weight_map"]
                          .items()}
        else:
            from safetensors import safe_open
            self.where = {}
            for f in sorted(path.glob("*.safetensors")):
                with safe_open(str(f), framework="numpy") as h:
                    self.where.update({k: f for k in h.keys()})
        if not self.where:
            raise ValueError(f"no *.safetensors weights in {str(path)!r}")
        self.used = set()

    def get(self, name: str) -> np.ndarray:
        from safetensors import safe_open
        if name not in self.where:
            raise ValueError(f"the checkpoint lacks tensor {name!r}")
        self.used.add(name)
        # opened per tensor: a file held open keeps every page read so far mapped
        with safe_open(str(self.where[name]), framework="numpy") as h:
            return h.get_tensor(name)


def _shardings_from_mesh(abstract_state, mesh, rules=None):
    """NamedShardings of every parameter from its logical axes and the sharding rules."""
    from jax.sharding import NamedSharding

    from jaxllm.sharding.rules import Rules
    rules = rules or Rules.for_mesh(mesh)

    def one(v):
        spec = rules.param_spec(v.get_metadata()["out_sharding"], v.get_value().shape)
        return NamedSharding(mesh, spec)

    return nnx.to_pure_dict(jax.tree.map(one, abstract_state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def load(path, overrides: list[str] | None = None, *, shardings=None, mesh=None, rules=None):
    """(model, cfg) from an HF model directory.

    `overrides` are dotted config overrides applied on top (e.g. "model.param_dtype=bfloat16",
    "model.attention_impl=xla"). Parameters are cast to model.param_dtype. `shardings` (a
    pytree like `nnx.to_pure_dict(nnx.state(model))`) or a `mesh` (with the sharding
    `rules`, default `Rules.for_mesh(mesh)`) place each parameter straight onto its devices.
    cfg.data.tokenizer points at the directory's tokenizer.json when there is one; the
    sampling defaults of its generation_config.json (`generation_defaults`) fill
    cfg.inference where `overrides` do not set them. An MoE model loaded with
    "model.moe.balance=bias" starts from a zero selection bias.
    """
    from jaxllm.model import build_model
    from jaxllm.model.layers import as_dtype
    from jaxllm.model.moe import BIAS_KEY

    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{str(path)!r} has no config.json; expected an HF model directory")
    config = json.loads((path / "config.json").read_text())
    table = _expert_weights(_family(config))
    model = model_section(config)
    raw = {"model": model,
           "train": {"seq_len": min(TrainConfig.seq_len, model["max_seq_len"])}}
    if (path / "tokenizer.json").exists():
        raw["data"] = {"tokenizer": str(path / "tokenizer.json")}
    if generation := generation_defaults(path):
        raw["inference"] = generation
    cfg = config_from_dict(apply_overrides(raw, overrides))

    abstract = nnx.eval_shape(lambda: build_model(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    if shardings is None and mesh is not None:
        shardings = _shardings_from_mesh(state, mesh, rules)
    shapes = nnx.to_pure_dict(state)
    dtype = np.dtype(as_dtype(cfg.model.param_dtype))
    n_dense = cfg.model.moe.dense_layers if cfg.model.moe else 0
    params = {}
    tensors = _Tensors(path)
    for keys, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        ours = "/".join(str(k.key) for k in keys)
        if keys[-1].key == BIAS_KEY:  # no HF counterpart: HF routers choose by score alone
            x = np.zeros(leaf.shape, leaf.dtype)
        else:
            name, layout = _lookup(table, ours)
            # each HF tensor is cast and laid out straight into the parameter's one host
            # array (no per-tensor copies, no full-model copy in another dtype)
            x = np.empty(leaf.shape, dtype)
            for index, hf_name in _slots(ours, leaf.shape, name, n_dense):
                _load_into(x[index], tensors.get(hf_name), hf_name, layout)
        sharding = _get(shardings, keys) if shardings is not None else None
        arr = jax.device_put(x, sharding) if sharding is not None else jax.numpy.asarray(x)
        _set(params, keys, arr.block_until_ready())
        # jax holds the last device_put's source until the next op dispatches: one
        # tiny op frees x now, so one parameter's host array is alive at a time
        del x
        jax.numpy.zeros(())
    unused = sorted(k for k in set(tensors.where) - tensors.used
                    if not k.endswith(IGNORED)
                    and not (k == "lm_head.weight" and cfg.model.tie_embeddings))
    if unused:
        raise ValueError(f"the checkpoint holds tensors jaxllm has no place for: "
                         f"{unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return nnx.merge(graphdef, params), cfg


def _load_into(dst: np.ndarray, w: np.ndarray, name: str, layout: str) -> None:
    """Write HF tensor `w` into our (contiguous) array `dst`, casting, in one pass."""
    if w.shape != _hf_shape(dst.shape, layout):
        raise ValueError(f"tensor {name!r} has shape {w.shape}; config.json implies "
                         f"{_hf_shape(dst.shape, layout)}")
    if layout[0] == "T":  # ours [*in, *out] is HF's [out, in] transposed
        dst.reshape(w.shape[::-1])[...] = w.T
    else:
        dst.reshape(w.shape)[...] = w


def _get(tree, keys):
    for k in keys:
        tree = tree[k.key]
    return tree


def _set(tree, keys, value):
    for k in keys[:-1]:
        tree = tree.setdefault(k.key, {})
    tree[keys[-1].key] = value


# ---------------------------------------------------------------------------------------
# saving


def save(model, cfg: Config, path, *, drop_mtp: bool = False) -> None:
    """Write an HF model directory: config.json, model.safetensors, and the tokenizer
    (tokenizer.json, with the tokenizer_config.json, chat_template.jinja and
    generation_config.json that lie beside it) if cfg has one.

    MTP heads have no HF counterpart: a model with them needs `drop_mtp=True`; nor has
    the selection bias of model.moe.balance='bias' (HF routers choose by score alone): it
    must be zero.
    """
    from safetensors.numpy import save_file

    from jaxllm.model.moe import ExpertBias
    from jaxllm.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    config = config_json(cfg, tok.bos_id, tok.eos_id)
    table = _expert_weights(_family(config))
    n_dense = cfg.model.moe.dense_layers if cfg.model.moe else 0
    if any(np.any(np.asarray(b)) for b in jax.tree.leaves(nnx.state(model, ExpertBias))):
        raise ValueError("the model's MoE selection bias (model.moe.balance='bias') is not "
                         "zero, and Hugging Face routers have none: the exported model would "
                         "choose other experts; export a model balanced with model.moe.balance "
                         "'aux_loss' or 'none'")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if "mtp" in params:
        if not drop_mtp:
            raise ValueError(f"model.mtp_depth={cfg.model.mtp_depth}: MTP heads have no "
                             f"Hugging Face counterpart; pass drop_mtp=True to save without")
        params = {k: v for k, v in params.items() if k != "mtp"}
    tensors = {}
    for keys, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        ours = "/".join(str(k.key) for k in keys)
        name, layout = _lookup(table, ours)
        x = np.asarray(jax.device_get(x))
        tensors.update({hf_name: _to_hf(x[index], layout)
                        for index, hf_name in _slots(ours, x.shape, name, n_dense)})
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if cfg.data.tokenizer != "byte":
        src = Path(tok.name)
        if src.resolve() != (path / "tokenizer.json").resolve():
            shutil.copyfile(src, path / "tokenizer.json")
            for name in ("tokenizer_config.json", "chat_template.jinja",
                         "generation_config.json"):
                if (src.parent / name).exists():
                    shutil.copyfile(src.parent / name, path / name)
