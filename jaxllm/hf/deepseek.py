"""DeepSeek-V3 and DeepSeek-V2: multi-head latent attention (model/mla.py) and DeepSeekMoE
(model/moe.py: shared experts, the first layers dense).

config.json -> ours: q_lora_rank (null: full-rank queries), kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim -> model.mla; rope_scaling "yarn" (factor, beta_fast,
beta_slow, mscale, mscale_all_dim, original_max_position_embeddings) -> model.rope_scaling;
n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts,
routed_scaling_factor, norm_topk_prob, first_k_dense_replace (dense_layers) -> model.moe.
V3 routes by sigmoid scores, chooses within the topk_group of n_group groups of highest
top-2 sums, with its aux-loss-free selection bias (e_score_correction_bias, our
`balance: bias` ExpertBias, loaded and saved); V2 by softmax scores, greedily ("greedy"
topk_method), its top-k weights never renormalised (transformers ignores V2's
norm_topk_prob).

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... of q_pe and k_pe (V3 with
rope_interleave, V2 always); ours rotates halves. Rotating pairs and then de-interleaving
([x0, x2, ... | x1, x3, ...]) equals de-interleaving and then rotating halves, and q and k
are permuted alike, so the rotary output rows of q_proj / q_b_proj (per head) and of
kv_a_proj_with_mqa load de-interleaved and save re-interleaved: the same scores, exactly.

Multi-token prediction: a V3 checkpoint holds num_nextn_predict_layers more layers
(model.layers.{num_hidden_layers + k}), DeepSeek's MTP layers, which are our MTP modules
(model/mtp.py, model.mtp_depth = num_nextn_predict_layers) one to one: enorm, hnorm,
eh_proj (over [embedding; hidden], our order too), a decoder layer of the main layers'
kind (an MoE layer past first_k_dense_replace) and shared_head.norm. Each also stores
copies of the main model's embedding (embed_tokens) and head (shared_head.head): loading
checks that they equal the main ones, saving writes them. model.mtp_depth=k loads the
first k of them only (0: none), the others skipped with a note. A checkpoint saved by
transformers holds none, though its config.json counts them (DeepseekV3Config's default
is one): it loads without MTP modules, with a note. A model whose main layers are all
dense but whose MTP layers first_k_dense_replace makes MoE has no such form here; its MTP
layers are skipped with a note.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import numpy as np

from jaxllm.config import Config
from jaxllm.hf.common import require, rope_params
from jaxllm.hf.llama import WEIGHTS
from jaxllm.model.moe import BIAS_KEY


@dataclass(frozen=True)
class DeepSeek:
    model_type: str
    version: int  # 2 or 3

    def model_section(self, c: dict) -> dict:
        return model_section(c, self.version)

    def mtp_held(self, c: dict, names, depth: int) -> int:
        """model.mtp_depth for the checkpoint's tensor `names`: `depth` (the section's),
        less the MTP layers config.json counts but the checkpoint lacks (transformers
        saves none, and its DeepseekV3Config counts one by default), with a note."""
        held, n_layers = 0, c["num_hidden_layers"]
        while held < depth and f"model.layers.{n_layers + held}.eh_proj.weight" in names:
            held += 1
        if held < depth:
            print(f"[jaxllm.hf] config.json num_nextn_predict_layers={_mtp_layers(c)} but the "
                  f"checkpoint holds {held} multi-token-prediction layer(s) (model.layers."
                  f"{n_layers}+): model.mtp_depth={held}", file=sys.stderr, flush=True)
        return held

    def weights(self, c: dict, m) -> dict:
        """Our parameter path -> (HF name, layout[, permutation]) (hf/tensors.py)."""
        if m.mtp_depth > _mtp_fit(c):
            raise ValueError(_mtp_misfit(c, m.mtp_depth))
        table = weights(m, interleaved=self.version == 2 or c.get("rope_interleave", True))
        if m.mtp_depth:
            layer = "model.layers.{i}"
            table.update({"mtp/e_norm/scale": (f"{layer}.enorm.weight", "same"),
                          "mtp/h_norm/scale": (f"{layer}.hnorm.weight", "same"),
                          "mtp/proj/kernel": (f"{layer}.eh_proj.weight", "T1"),
                          "mtp/final_norm/scale": (f"{layer}.shared_head.norm.weight", "same")})
        return table

    def copies(self, c: dict, m) -> dict:
        """{HF name: the HF name it copies}: each MTP layer's copies of the main model's
        embedding and head (of the embedding when tied)."""
        n_layers, main = c["num_hidden_layers"], "model.embed_tokens.weight"
        head = main if m.tie_embeddings else "lm_head.weight"
        return {k: v for i in range(n_layers, n_layers + m.mtp_depth) for k, v in (
            (f"model.layers.{i}.embed_tokens.weight", main),
            (f"model.layers.{i}.shared_head.head.weight", head))}

    def unread(self, c: dict, names, m) -> set:
        """The multi-token-prediction layers past model.mtp_depth, skipped (with a note)."""
        n_layers, n_mtp = c["num_hidden_layers"], _mtp_layers(c)
        first = n_layers + m.mtp_depth
        skipped = {k for k in names if (i := re.match(r"model\.layers\.(\d+)\.", k))
                   and first <= int(i[1]) < n_layers + n_mtp}
        if skipped:
            why = (f"model.mtp_depth={m.mtp_depth} of num_nextn_predict_layers={n_mtp}"
                   if m.mtp_depth < _mtp_fit(c) else _mtp_misfit(c, n_mtp))
            print(f"[jaxllm.hf] skipping {n_layers + n_mtp - first} multi-token-prediction "
                  f"layer(s) (model.layers.{first}+, {len(skipped)} tensors): {why}",
                  file=sys.stderr, flush=True)
        return skipped


FAMILIES = {"DeepseekV2ForCausalLM": DeepSeek("deepseek_v2", 2),
            "DeepseekV3ForCausalLM": DeepSeek("deepseek_v3", 3)}


def _mtp_layers(c: dict) -> int:
    return c.get("num_nextn_predict_layers", c.get("num_mtp_layers")) or 0


def _mtp_fit(c: dict) -> int:
    """How many of the checkpoint's MTP layers our MTP modules can hold: all of them when
    their blocks are of the main stack's kind (MoE layers in an MoE model, dense layers in
    a dense one), else none."""
    n_layers, n_mtp, dense = c["num_hidden_layers"], _mtp_layers(c), c["first_k_dense_replace"]
    return n_mtp if dense < n_layers or dense >= n_layers + n_mtp else 0


def _mtp_misfit(c: dict, depth: int) -> str:
    n_layers, n_mtp, dense = c["num_hidden_layers"], _mtp_layers(c), c["first_k_dense_replace"]
    if n_mtp and _mtp_fit(c) == 0:
        return (f"config.json first_k_dense_replace={dense} makes the main layers "
                f"(num_hidden_layers={n_layers}) dense but MTP layer {dense} an MoE layer; "
                f"jaxllm's MTP blocks are MoE blocks exactly in an MoE model. Load with "
                f"model.mtp_depth=0")
    return (f"model.mtp_depth={depth}: the checkpoint holds {n_mtp} multi-token-prediction "
            f"layer(s) (config.json num_nextn_predict_layers); set model.mtp_depth to at "
            f"most {n_mtp}")


def _deinterleave(n: int) -> np.ndarray:
    """[0, 2, 4, ..., 1, 3, 5, ...]: the first of each rotary pair, then the second."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def weights(m, *, interleaved: bool) -> dict:
    mla = m.mla
    att, mlp = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    rope = _deinterleave(mla.qk_rope_head_dim) if interleaved else np.arange(mla.qk_rope_head_dim)
    q_perm = np.concatenate([np.arange(mla.qk_nope_head_dim), mla.qk_nope_head_dim + rope])
    kv_perm = np.concatenate([np.arange(mla.kv_lora_rank), mla.kv_lora_rank + rope])
    table = {k: WEIGHTS[k] for k in (
        "embed/embedding", "final_norm/scale", "head/kernel", "blocks/attn_norm/scale",
        "blocks/mlp_norm/scale", "blocks/mlp/gate/kernel", "blocks/mlp/up/kernel",
        "blocks/mlp/down/kernel")}
    table.update({
        "blocks/attn/q/kernel": (f"{att}.q_proj.weight", "T1", q_perm),
        "blocks/attn/q_a/kernel": (f"{att}.q_a_proj.weight", "T1"),
        "blocks/attn/q_a_norm/scale": (f"{att}.q_a_layernorm.weight", "same"),
        "blocks/attn/q_b/kernel": (f"{att}.q_b_proj.weight", "T1", q_perm),
        "blocks/attn/kv_a/kernel": (f"{att}.kv_a_proj_with_mqa.weight", "T1", kv_perm),
        "blocks/attn/kv_norm/scale": (f"{att}.kv_a_layernorm.weight", "same"),
        "blocks/attn/kv_b/kernel": (f"{att}.kv_b_proj.weight", "T1"),
        "blocks/attn/o/kernel": (f"{att}.o_proj.weight", "T2"),
        # an MoE layer: router, routed experts (one HF tensor each), shared experts
        "blocks/mlp/router": (f"{mlp}.gate.weight", "T1"),
        "blocks/mlp/gate": (f"{mlp}.experts.{{e}}.gate_proj.weight", "T1"),
        "blocks/mlp/up": (f"{mlp}.experts.{{e}}.up_proj.weight", "T1"),
        "blocks/mlp/down": (f"{mlp}.experts.{{e}}.down_proj.weight", "T1")})
    for p in ("gate", "up", "down"):
        table[f"blocks/mlp/shared/{p}/kernel"] = (f"{mlp}.shared_experts.{p}_proj.weight", "T1")
    if m.moe is not None and m.moe.router == "sigmoid":  # V3's selection bias
        table[f"blocks/mlp/{BIAS_KEY}"] = (f"{mlp}.gate.e_score_correction_bias", "same")
    return table


def _yarn_fits(mscale, mscale_all_dim) -> bool:
    """Whether transformers' YaRN magnitude is ours: it scales cos and sin by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when both are nonzero,
    else by mscale(factor, 1), where ours (and DeepSeek's reference) always takes the ratio."""
    return bool(mscale and mscale_all_dim) or (not mscale_all_dim and mscale in (None, 1))


def _rope(c: dict) -> tuple[float, dict | None]:
    """(rope_theta, our model.rope_scaling as a mapping): none or YaRN, as transformers
    computes it (absent beta_fast / beta_slow 32 / 1, absent factor
    max_position_embeddings / original_max_position_embeddings)."""
    theta, kind, p = rope_params(c)
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"config.json rope scaling type {kind!r} is not supported for "
                         f"DeepSeek; jaxllm reads 'default' and 'yarn'")
    if p.get("attention_factor") is not None:
        raise ValueError(f"config.json rope_scaling attention_factor="
                         f"{p['attention_factor']!r} is not supported; jaxllm derives the "
                         f"factor from mscale and mscale_all_dim (delete attention_factor)")
    require(p, "truncate", (True,), True)
    mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if not _yarn_fits(mscale, all_dim):
        raise ValueError(f"config.json rope_scaling mscale={mscale!r}, mscale_all_dim="
                         f"{all_dim!r} is not supported: transformers ignores mscale unless "
                         f"both are nonzero; jaxllm reads both nonzero, or mscale_all_dim "
                         f"0 with mscale 1")
    original = (c.get("original_max_position_embeddings")
                or p.get("original_max_position_embeddings") or c["max_position_embeddings"])
    factor = p.get("factor")
    return theta, {
        "rope_type": "yarn", "original_max_position_embeddings": int(original),
        "factor": float(c["max_position_embeddings"] / original if factor is None else factor),
        "beta_fast": float(p.get("beta_fast") or 32), "beta_slow": float(p.get("beta_slow") or 1),
        "mscale": float(mscale or 1), "mscale_all_dim": float(all_dim or 0)}


def model_section(c: dict, version: int) -> dict:
    """Our `model:` config section for a DeepSeek-V2/V3 config.json (ValueError if
    unsupported)."""
    v3 = version == 3
    require(c, "hidden_act", ("silu",), "silu")
    require(c, "attention_bias", (False,), False)  # biases on q_a, kv_a and o
    require(c, "mlp_bias", (False,), False)
    if c.get("quantization_config"):
        method = c["quantization_config"].get("quant_method", "?")
        raise ValueError(f"config.json quantization_config (quant_method={method!r}) is not "
                         f"supported: jaxllm reads unquantized weights; dequantize the "
                         f"checkpoint (to bfloat16, say) first")
    require(c, "moe_layer_freq", (1,), 1)  # keys of DeepSeek's own config.json
    require(c, "scoring_func", ("sigmoid",) if v3 else ("softmax",), "sigmoid" if v3 else "softmax")
    require(c, "topk_method", ("noaux_tc",) if v3 else ("greedy",), "noaux_tc" if v3 else "greedy")
    try:
        n_layers, n_heads = c["num_hidden_layers"], c["num_attention_heads"]
        if c.get("num_key_value_heads") not in (None, n_heads):
            raise ValueError(f"config.json num_key_value_heads={c['num_key_value_heads']} "
                             f"differs from num_attention_heads={n_heads}; MLA gives every "
                             f"head its own keys and values (set them equal)")
        mla = dict(q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c["kv_lora_rank"],
                   qk_nope_head_dim=c["qk_nope_head_dim"],
                   qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"])
        section = dict(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=n_layers,
                       n_heads=n_heads, n_kv_heads=n_heads, mlp_dim=c["intermediate_size"],
                       attention="mla", mla=mla)
        dense = c["first_k_dense_replace"]
        if dense < n_layers:  # else every layer is dense
            section["moe"] = _moe_section(c, v3, dense)
        section["mtp_depth"] = _mtp_fit(c) if v3 else 0
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from None
    theta, scaling = _rope(c)
    section.update(rope_theta=theta, rope_scaling=scaling,
                   norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                   max_seq_len=c.get("max_position_embeddings", 2048))
    return section


def _moe_section(c: dict, v3: bool, dense: int) -> dict:
    shared = c["n_shared_experts"]
    if not shared:
        raise ValueError(f"config.json n_shared_experts={shared!r} is not supported; "
                         f"jaxllm reads DeepSeekMoE with at least one shared expert")
    moe = dict(num_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"],
               expert_mlp_dim=c["moe_intermediate_size"], num_shared_experts=shared,
               routed_scaling=float(c["routed_scaling_factor"]), dense_layers=dense)
    if v3:  # fine-tuning keeps V3's aux-loss-free balancing
        return dict(moe, router="sigmoid", norm_topk_prob=bool(c["norm_topk_prob"]),
                    n_groups=c["n_group"], topk_groups=c["topk_group"], balance="bias")
    require(c, "norm_topk_prob", (False,), False)  # transformers' V2 never renormalises
    return dict(moe, router="softmax", norm_topk_prob=False, balance="aux_loss",
                aux_loss_weight=float(c.get("aux_loss_alpha", 0.001)))


def config_json(cfg: Config, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The HF config.json of an MLA model: DeepSeek-V2 with a softmax router, else V3."""
    m, mla, moe = cfg.model, cfg.model.mla, cfg.model.moe
    v2 = moe is not None and moe.router == "softmax"
    arch = "DeepseekV2ForCausalLM" if v2 else "DeepseekV3ForCausalLM"
    if m.rope_scaling is not None:
        s = m.rope_scaling
        if s.rope_type != "yarn" or not _yarn_fits(s.resolved("mscale"),
                                                   s.resolved("mscale_all_dim")):
            raise ValueError(f"model.rope_scaling ({s.rope_type}, mscale={s.mscale}, "
                             f"mscale_all_dim={s.mscale_all_dim}) has no counterpart in "
                             f"{arch}: use yarn with mscale and mscale_all_dim both nonzero, "
                             f"or mscale_all_dim 0 with mscale 1")
    rope = None if m.rope_scaling is None else {"rope_type": "yarn", **{
        k: m.rope_scaling.resolved(k) for k in ("factor", "original_max_position_embeddings",
                                                "beta_fast", "beta_slow", "mscale",
                                                "mscale_all_dim")}}
    c = {"architectures": [arch], "model_type": FAMILIES[arch].model_type,
         "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.mlp_dim,
         "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
         "num_key_value_heads": m.n_heads, "q_lora_rank": mla.q_lora_rank or None,
         "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
         "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
         "hidden_act": "silu", "max_position_embeddings": m.max_seq_len,
         "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": rope,
         "attention_bias": False, "tie_word_embeddings": m.tie_embeddings,
         "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": m.param_dtype,
         # layers from first_k_dense_replace on, the MTP layers too, are MoE layers
         "first_k_dense_replace": moe.dense_layers if moe else m.n_layers + m.mtp_depth}
    if not v2:  # rotary pairs interleaved, as DeepSeek's checkpoints; the MTP modules
        c.update(rope_interleave=True, num_nextn_predict_layers=m.mtp_depth)
    if moe is None:
        return c
    fields = {"moe.num_shared_experts": (moe.num_shared_experts, "1 or more",
                                         moe.num_shared_experts >= 1)}
    if v2:
        fields.update({"moe.norm_topk_prob": (moe.norm_topk_prob, "False", not moe.norm_topk_prob),
                       "moe.n_groups": (moe.n_groups, "1", moe.n_groups == 1)})
    off = {k: (ours, fix) for k, (ours, fix, fits) in fields.items() if not fits}
    if off:
        raise ValueError(", ".join(f"model.{k}={ours!r}" for k, (ours, _) in off.items())
                         + f": no Hugging Face counterpart in {arch} (V2: softmax router, "
                         f"greedy top k never renormalised; V3: sigmoid router); set "
                         + " and ".join(f"model.{k} to {fix}" for k, (_, fix) in off.items()))
    c.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
             moe_intermediate_size=moe.expert_mlp_dim, n_shared_experts=moe.num_shared_experts,
             routed_scaling_factor=moe.routed_scaling, norm_topk_prob=moe.norm_topk_prob,
             moe_layer_freq=1)
    if v2:
        return {**c, "topk_method": "greedy", "scoring_func": "softmax", "n_group": None,
                "topk_group": None,
                "aux_loss_alpha": moe.aux_loss_weight if moe.balance == "aux_loss" else 0.0}
    return {**c, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": moe.n_groups,
            "topk_group": moe.topk_groups}
