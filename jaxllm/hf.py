"""Hugging Face checkpoints: load a model directory into jaxllm, save one `transformers` loads.

    model, cfg = jaxllm.hf.load("Llama-3.2-1B")   # config.json, *.safetensors, tokenizer.json
    model, cfg = jaxllm.hf.load(d, ["model.param_dtype=bfloat16", "model.dtype=bfloat16"])
    jaxllm.hf.save(model, cfg, "out")             # config.json, model.safetensors, tokenizer

Families: Llama (Llama 3 RoPE scaling included), Mistral (sliding window), Qwen2 (q/k/v
biases) and Qwen3 dense (q/k head norms), with any GQA ratio. They share one weight layout
(WEIGHTS below) and differ in a few config.json fields (FAMILIES). Our RoPE rotates halves
(`rotate_half`), as HF Llama does, so q/k weights load without a permutation; HF linear
weights are [out, in], ours [*in, *out]. Loading reads one tensor at a time from the
safetensors files and stacks the layers into our [L, ...] parameters, placing each on its
sharding when given one.
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

from jaxllm.config import Config, TrainConfig, apply_overrides, config_from_dict


@dataclass(frozen=True)
class Family:
    model_type: str
    qkv_bias: bool  # biases on q/k/v (and on nothing else)
    window: str  # "none": no sliding window; "all": config.sliding_window on every layer;
    #              "layer_types": use_sliding_window + layer_types / max_window_layers (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before RoPE (Qwen3)


FAMILIES = {
    "LlamaForCausalLM": Family("llama", qkv_bias=False, window="none"),
    "MistralForCausalLM": Family("mistral", qkv_bias=False, window="all"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, window="layer_types"),
    "Qwen3ForCausalLM": Family("qwen3", qkv_bias=False, window="layer_types", qk_norm=True),
}

# our parameter path -> (HF tensor name, layout); "{i}" is the layer of a stacked block.
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
    """The HF config.json of our model config: Qwen3 with q/k head norms, Qwen2 with q/k/v
    biases, else Mistral with a sliding window, else Llama."""
    m = cfg.model
    if m.attention != "gqa":
        raise ValueError(f"model.attention={m.attention!r} has no Hugging Face export here; "
                         f"only grouped-query attention models are exported")
    if m.qk_norm and m.qkv_bias:
        raise ValueError("model.qk_norm with model.qkv_bias has no Hugging Face family "
                         "(Qwen3's attention_bias also biases o_proj); set one of them false")
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
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        c.update(attention_bias=False)
    if arch == "LlamaForCausalLM":
        c.update(mlp_bias=False)
    elif arch == "MistralForCausalLM":
        c.update(sliding_window=m.sliding_window)
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
    cfg.inference where `overrides` do not set them.
    """
    from jaxllm.model import build_model
    from jaxllm.model.layers import as_dtype

    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{str(path)!r} has no config.json; expected an HF model directory")
    model = model_section(json.loads((path / "config.json").read_text()))
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
    params = {}
    tensors = _Tensors(path)
    for keys, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        ours = "/".join(str(k.key) for k in keys)
        if ours not in WEIGHTS:
            raise ValueError(f"parameter {ours!r} has no Hugging Face counterpart")
        name, layout = WEIGHTS[ours]
        shape = leaf.shape
        # each HF tensor is cast and laid out straight into the parameter's one host
        # array (no per-tensor copies, no full-model copy in another dtype)
        x = np.empty(shape, dtype)
        if ours.startswith("blocks/"):  # stacked: [L, ...], one HF tensor per layer
            for i in range(shape[0]):
                _load_into(x[i], tensors.get(name.format(i=i)), name.format(i=i), layout)
        else:
            _load_into(x, tensors.get(name), name, layout)
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

    MTP heads have no HF counterpart: a model with them needs `drop_mtp=True`.
    """
    from safetensors.numpy import save_file

    from jaxllm.tokenizer import load_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if "mtp" in params:
        if not drop_mtp:
            raise ValueError(f"model.mtp_depth={cfg.model.mtp_depth}: MTP heads have no "
                             f"Hugging Face counterpart; pass drop_mtp=True to save without")
        params = {k: v for k, v in params.items() if k != "mtp"}
    tensors = {}
    for keys, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        ours = "/".join(str(k.key) for k in keys)
        if ours not in WEIGHTS:
            raise ValueError(f"parameter {ours!r} has no Hugging Face counterpart")
        name, layout = WEIGHTS[ours]
        x = np.asarray(jax.device_get(x))
        if ours.startswith("blocks/"):
            tensors.update({name.format(i=i): _to_hf(x[i], layout) for i in range(x.shape[0])})
        else:
            tensors[name] = _to_hf(x, layout)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    tok = load_tokenizer(cfg.data.tokenizer)
    config = config_json(cfg, tok.bos_id, tok.eos_id)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if cfg.data.tokenizer != "byte":
        src = Path(tok.name)
        if src.resolve() != (path / "tokenizer.json").resolve():
            shutil.copyfile(src, path / "tokenizer.json")
            for name in ("tokenizer_config.json", "chat_template.jinja",
                         "generation_config.json"):
                if (src.parent / name).exists():
                    shutil.copyfile(src.parent / name, path / name)
