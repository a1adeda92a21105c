"""Hugging Face checkpoints: load a model directory into jaxllm, save one `transformers` loads.

    model, cfg = jaxllm.hf.load("Llama-3.2-1B")   # config.json, *.safetensors, tokenizer.json
    model, cfg = jaxllm.hf.load(d, ["model.param_dtype=bfloat16", "model.dtype=bfloat16"])
    jaxllm.hf.save(model, cfg, "out")             # config.json, model.safetensors, tokenizer

Families, one mapping per group (FAMILIES, by config.json's architecture):
- hf/llama.py: Llama (Llama 3 RoPE scaling included), Mistral (sliding window), Qwen2 (q/k/v
  biases), Qwen3 (q/k head norms), with any GQA ratio, and the mixture-of-experts Mixtral
  and Qwen3-MoE (their router and experts: hf/moe.py);
- hf/deepseek.py: DeepSeek-V3 and V2 (multi-head latent attention, YaRN, DeepSeekMoE with
  shared experts, dense first layers, V3's group-limited sigmoid routing and selection bias,
  V3's multi-token-prediction layers as our MTP modules).

A family gives our `model:` section for its config.json and a table of our parameter paths
to HF tensor names and layouts (hf/tensors.py); export picks the family from our config
(`config_json`). HF linear weights are [out, in], ours [*in, *out]. Loading reads one
tensor at a time from the safetensors files and stacks the layers into our [L, ...]
parameters (and an MoE layer's per-expert tensors into our [L, E, ...] ones), placing each
on its sharding when given one; an MTP module is one HF layer past the last (unstacked).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxllm.config import Config, TrainConfig, apply_overrides, config_from_dict
from jaxllm.hf import deepseek, llama
from jaxllm.hf.common import generation_defaults
from jaxllm.hf.tensors import (Tensors, get_path, load_into, lookup, set_path,
                               shardings_from_mesh, slots, table_key, to_hf)
from jaxllm.model.moe import BIAS_KEY, ExpertBias

FAMILIES = {**llama.FAMILIES, **deepseek.FAMILIES}
IGNORED = (".rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here
BIAS_PATH = f"blocks/mlp/{BIAS_KEY}"  # an MoE stack's selection bias (model.moe.balance=bias)

__all__ = ["load", "save", "config_json", "model_section", "generation_defaults", "FAMILIES"]


def family(c: dict):
    """The family of an HF config.json dict (by architecture, else model_type)."""
    arch = (c.get("architectures") or [None])[0]
    by_type = {f.model_type: f for f in FAMILIES.values()}
    fam = FAMILIES.get(arch) or (by_type.get(c.get("model_type")) if arch is None else None)
    if fam is None:
        raise ValueError(f"unsupported architecture {arch!r} (model_type "
                         f"{c.get('model_type')!r}); jaxllm.hf reads {sorted(FAMILIES)}")
    return fam


def model_section(c: dict) -> dict:
    """Our `model:` config section for an HF config.json dict (ValueError if unsupported)."""
    return family(c).model_section(c)


def config_json(cfg: Config, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The HF config.json of our model config: DeepSeek (hf/deepseek.py) for multi-head
    latent attention, else a Llama-layout family (hf/llama.py)."""
    if cfg.model.attention == "mla":
        return deepseek.config_json(cfg, bos_id, eos_id)
    return llama.config_json(cfg, bos_id, eos_id)


# ---------------------------------------------------------------------------------------
# loading


def load(path, overrides: list[str] | None = None, *, shardings=None, mesh=None, rules=None):
    """(model, cfg) from an HF model directory.

    `overrides` are dotted config overrides applied on top (e.g. "model.param_dtype=bfloat16",
    "model.attention_impl=xla"). Parameters are cast to model.param_dtype. `shardings` (a
    pytree like `nnx.to_pure_dict(nnx.state(model))`) or a `mesh` (with the sharding
    `rules`, default `Rules.for_mesh(mesh)`) place each parameter straight onto its devices.
    cfg.data.tokenizer points at the directory's tokenizer.json when there is one; the
    sampling defaults of its generation_config.json (`generation_defaults`) fill
    cfg.inference where `overrides` do not set them. A DeepSeek-V3 checkpoint's MTP layers
    load as MTP modules (model.mtp_depth; "model.mtp_depth=0" skips them). The MoE
    selection bias of "model.moe.balance=bias" is DeepSeek-V3's e_score_correction_bias;
    the other families have none, and it starts at zero.
    """
    from jaxllm.model import build_model
    from jaxllm.model.layers import as_dtype

    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{str(path)!r} has no config.json; expected an HF model directory")
    config = json.loads((path / "config.json").read_text())
    fam = family(config)
    model = fam.model_section(config)
    tensors = Tensors(path)
    if model.get("mtp_depth"):  # the MTP layers config.json counts, as far as they are held
        model["mtp_depth"] = fam.mtp_held(config, tensors.where, model["mtp_depth"])
    raw = {"model": model,
           "train": {"seq_len": min(TrainConfig.seq_len, model["max_seq_len"])}}
    if (path / "tokenizer.json").exists():
        raw["data"] = {"tokenizer": str(path / "tokenizer.json")}
    if generation := generation_defaults(path):
        raw["inference"] = generation
    cfg = config_from_dict(apply_overrides(raw, overrides))
    table = fam.weights(config, cfg.model)

    abstract = nnx.eval_shape(lambda: build_model(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    if shardings is None and mesh is not None:
        shardings = shardings_from_mesh(state, mesh, rules)
    shapes = nnx.to_pure_dict(state)
    dtype = np.dtype(as_dtype(cfg.model.param_dtype))
    n_dense = cfg.model.moe.dense_layers if cfg.model.moe else 0
    params = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        ours = "/".join(str(k.key) for k in keys)
        bias = keys[-1].key == BIAS_KEY
        if bias and table_key(ours) not in table:  # the family's routers choose by score alone
            x = np.zeros(leaf.shape, leaf.dtype)
        else:
            w = lookup(table, ours)
            # each HF tensor is cast and laid out straight into the parameter's one host
            # array (no per-tensor copies, no full-model copy in another dtype)
            x = np.empty(leaf.shape, leaf.dtype if bias else dtype)
            for index, hf_name in slots(ours, leaf.shape, w.name, n_dense, cfg.model.n_layers):
                load_into(x[index], tensors.get(hf_name), hf_name, w)
        sharding = get_path(shardings, keys) if shardings is not None else None
        arr = jax.device_put(x, sharding) if sharding is not None else jax.numpy.asarray(x)
        set_path(params, keys, arr.block_until_ready())
        # jax holds the last device_put's source until the next op dispatches: one
        # tiny op frees x now, so one parameter's host array is alive at a time
        del x
        jax.numpy.zeros(())
    _check_unloaded_bias(table, shapes, tensors, cfg)
    _check_copies(fam.copies(config, cfg.model), tensors)
    tensors.used |= fam.unread(config, tensors.where, cfg.model)
    unused = sorted(k for k in set(tensors.where) - tensors.used
                    if not k.endswith(IGNORED)
                    and not (k == "lm_head.weight" and cfg.model.tie_embeddings))
    if unused:
        raise ValueError(f"the checkpoint holds tensors jaxllm has no place for: "
                         f"{unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return nnx.merge(graphdef, params), cfg


def _check_unloaded_bias(table: dict, shapes: dict, tensors: Tensors, cfg: Config) -> None:
    """A checkpoint's selection bias our model has no place for (a model.moe.balance other
    than 'bias') must be zero: else the experts chosen would differ."""
    if BIAS_PATH not in table or cfg.model.moe is None or BIAS_KEY in shapes["blocks"]["mlp"]:
        return
    m = cfg.model
    for i in range(m.moe.dense_layers, m.n_layers + m.mtp_depth):  # the MTP layers' too
        name = table[BIAS_PATH][0].format(i=i)
        if np.any(tensors.get(name)):
            raise ValueError(f"the checkpoint's {name} is not zero: its experts are chosen "
                             f"with a selection bias, which model.moe.balance="
                             f"{m.moe.balance!r} has no place for; load with "
                             f"model.moe.balance=bias")


def _check_copies(copies: dict, tensors: Tensors) -> None:
    """Tensors that copy others (a DeepSeek-V3 MTP layer's embedding and head) must equal
    them: jaxllm keeps one embedding and one head. Absent copies are fine."""
    for copy, main in copies.items():
        if copy not in tensors.where:
            continue
        a, b = tensors.get(copy), tensors.get(main)
        if a.shape != b.shape:
            raise ValueError(f"the checkpoint's {copy} has shape {a.shape}, its copy of {main} "
                             f"{b.shape}")
        if not np.array_equal(a, b):
            diff = np.abs(a.astype(np.float32) - b.astype(np.float32)).max()
            raise ValueError(f"the checkpoint's {copy} differs from {main} (by up to "
                             f"{diff:.3g}): jaxllm's MTP modules share the main model's "
                             f"embedding and head; load with model.mtp_depth=0 to skip the "
                             f"MTP layers")


# ---------------------------------------------------------------------------------------
# saving


def save(model, cfg: Config, path, *, drop_mtp: bool = False) -> None:
    """Write an HF model directory: config.json, model.safetensors, and the tokenizer
    (tokenizer.json, with the tokenizer_config.json, chat_template.jinja and
    generation_config.json that lie beside it) if cfg has one.

    MTP modules are saved as DeepSeek-V3's MTP layers (with their copies of the embedding
    and head), the one family that has them: any other model with them needs
    `drop_mtp=True`, which saves it without them. The selection bias of
    model.moe.balance='bias' is saved as DeepSeek-V3's e_score_correction_bias; the other
    families have none (their routers choose by score alone), so there it must be zero.
    """
    from safetensors.numpy import save_file

    from jaxllm.tokenizer import load_tokenizer

    m = cfg.model
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if drop_mtp:
        m = dataclasses.replace(m, mtp_depth=0)
        cfg = cfg.replace(model=m)
        params.pop("mtp", None)
    tok = load_tokenizer(cfg.data.tokenizer)
    config = config_json(cfg, tok.bos_id, tok.eos_id)
    arch = config["architectures"][0]
    if m.mtp_depth and config.get("num_nextn_predict_layers") != m.mtp_depth:
        raise ValueError(f"model.mtp_depth={m.mtp_depth}: {arch} has no multi-token-prediction "
                         f"layers (DeepSeek-V3 has); pass drop_mtp=True to save without the "
                         f"MTP modules")
    fam = family(config)
    table = fam.weights(config, m)
    n_dense = m.moe.dense_layers if m.moe else 0
    biases = jax.tree.leaves(nnx.state(model, ExpertBias))
    if BIAS_PATH not in table and any(np.any(np.asarray(b)) for b in biases):
        raise ValueError("the model's MoE selection bias (model.moe.balance='bias') is not "
                         f"zero, and {arch}'s router has none: the exported model would "
                         "choose other experts; export a model balanced with "
                         "model.moe.balance 'aux_loss' or 'none', or with an MLA sigmoid "
                         "router (DeepSeek-V3)")
    if BIAS_PATH in table:  # every MoE block's bias (main stack, MTP blocks), or zeros
        bias = nnx.to_pure_dict(nnx.state(model, ExpertBias))
        for keys, router in jax.tree_util.tree_flatten_with_path(params)[0]:
            if keys[-1].key == "router":  # [(L,) d, E] -> its bias [(L,) E]
                at = (*keys[:-1], jax.tree_util.DictKey(BIAS_KEY))
                set_path(params, at, get_path(bias, at) if biases else
                         np.zeros(router.shape[:-2] + router.shape[-1:], np.float32))
    tensors = {}
    for keys, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        ours = "/".join(str(k.key) for k in keys)
        w = lookup(table, ours)
        x = np.asarray(jax.device_get(x))
        tensors.update({hf_name: to_hf(x[index], w)
                        for index, hf_name in slots(ours, x.shape, w.name, n_dense, m.n_layers)})
    tensors.update({copy: tensors[main] for copy, main in fam.copies(config, m).items()})
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
