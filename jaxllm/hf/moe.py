"""The mixture-of-experts parts of the Llama-layout MoE families, Mixtral and Qwen3-MoE.

Both route as model/moe.py's softmax router does: softmax of the router logits in
float32, the top k, renormalised to sum to 1 (Mixtral always, Qwen3-MoE with
norm_topk_prob). Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) are our
moe.dense_layers when they come before all MoE layers, the form its checkpoints take.
"""
from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.hf.common import require


def expert_weights(fam, table: dict) -> dict:
    """`table` with the family's MoE layer: router ours [d, E], HF [E, d]; each expert's
    slice of our stacked gate / up [E, d, f] and down [E, f, d] one HF linear weight."""
    if fam.experts is None:
        return table
    module, projections = fam.experts
    layer = f"model.layers.{{i}}.{module}"
    table = {**table, "blocks/mlp/router": (f"{layer}.gate.weight", "T1")}
    for ours, theirs in zip(("gate", "up", "down"), projections):
        table[f"blocks/mlp/{ours}"] = (f"{layer}.experts.{{e}}.{theirs}.weight", "T1")
    return table


def moe_section(c: dict, fam, n_layers: int) -> dict:
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
        require(c, "router_jitter_noise", (0.0,), 0.0)
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


def moe_json(m: ModelConfig, arch: str) -> dict:
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
            + f": no Hugging Face counterpart in {arch}; jaxllm exports grouped-query MoE "
            f"models as Mixtral (softmax router, renormalised top k, no shared experts or "
            f"dense layers) or, with model.qk_norm, Qwen3-MoE (dense first layers allowed, "
            f"norm_topk_prob either way), and MLA ones as DeepSeek; set "
            + " and ".join(f"model.{k}={theirs!r}" for k, (_, theirs) in off.items()))
    c = {"num_experts_per_tok": moe.top_k, "output_router_logits": False,
         "router_aux_loss_coef": moe.aux_loss_weight if moe.balance == "aux_loss" else 0.0}
    if arch == "MixtralForCausalLM":
        return {**c, "num_local_experts": moe.num_experts,
                "intermediate_size": moe.expert_mlp_dim, "router_jitter_noise": 0.0}
    return {**c, "num_experts": moe.num_experts, "moe_intermediate_size": moe.expert_mlp_dim,
            "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.dense_layers))}
