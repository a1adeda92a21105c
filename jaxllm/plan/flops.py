"""FLOPs of training, prefill and decode, counted from the config (dense now; hooks for MoE).

Conventions (DESIGN.md): a matmul of m x k by k x n is 2mkn FLOPs; the backward pass is
twice the forward, so training is 3x; attention is 4·Hq·Sq·Skv·D forward per sequence and
layer, halved for causal masks. Two training counts are kept apart:

    model FLOPs     6·N_active + attention without the causal halving: the MFU convention
                    (`ModelConfig.flops_per_token`), comparable across codebases
    hardware FLOPs  what the step executes: attention halved for causal, plus the forward
                    the remat policy recomputes ("full": every block again, "dots": the
                    non-matmul work, which costs no matmul FLOPs, attention, and an MoE
                    layer's routed experts, whose grouped matmuls the policy does not
                    save) and the one the 1f1b pipeline schedule runs again

N_active counts the parameters one token passes through: every dense layer, and with a
`model.moe` section only its routed experts (top_k of them) and the shared ones. Training
adds the `model.mtp_depth` MTP modules (a block, a projection and a head matmul each; not
rematerialised) to both counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxllm.config import Config, ModelConfig


# -- the terms that MoE and MLA change ----------------------------------------------------

def active_params(m: ModelConfig, *, embeddings: bool = False) -> int:
    """Parameters one token passes through: `ModelConfig.num_params`, with `model.moe` its
    active count (top_k routed experts of each MoE layer)."""
    if getattr(m, "moe", None) is None:
        return m.num_params(embeddings=embeddings)
    return m.num_params(embeddings=embeddings, active=True)


def head_params(m: ModelConfig) -> int:
    """The output projection (a matmul per token, tied or not)."""
    return m.vocab_size * m.d_model


def attention_dims(m: ModelConfig) -> tuple[int, int]:
    """(query-key dim, value dim) per head: head_dim twice, or MLA's (`model.mla`)."""
    mla = getattr(m, "mla", None)
    if mla is None:
        return m.resolved_head_dim, m.resolved_head_dim
    return mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim


def moe_layers(m: ModelConfig) -> int:
    """Layers whose feed-forward is a mixture of experts (0 without `model.moe`)."""
    moe = getattr(m, "moe", None)
    return 0 if moe is None else m.n_layers - getattr(moe, "dense_layers", 0)


def stage_moe_layers(m: ModelConfig, pp: int, v: int = 1) -> int:
    """MoE layers of one pipeline stage (of pp x v; all of them without pp): the pipeline
    splits the MoE stack evenly and runs the dense layers in the first stage
    (`sharding/pipeline.py`)."""
    n = moe_layers(m)
    return n if pp * v == 1 else math.ceil(n / (pp * v))


def stage_layers(m: ModelConfig, pp: int, v: int = 1) -> int:
    """Layers of the busiest pipeline stage (of pp x v): an MoE model's first stage holds
    its dense layers beside its share of the MoE stack; a dense model's stages are even."""
    n = moe_layers(m)
    if n == 0 or pp * v == 1:
        return math.ceil(m.n_layers / (pp * v))
    return m.n_layers - n + stage_moe_layers(m, pp, v)


def routed_expert_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of the routed experts of every MoE layer: top_k SwiGLUs
    (gate, up, down) of expert_mlp_dim each."""
    moe = getattr(m, "moe", None)
    if moe is None:
        return 0.0
    return moe_layers(m) * moe.top_k * 2 * 3 * m.d_model * moe.expert_mlp_dim


# -- FLOPs ----------------------------------------------------------------------------------

def attention_flops(m: ModelConfig, sq: int, skv: int, *, causal: bool = True) -> float:
    """Forward attention FLOPs of one sequence over all layers: QK^T and PV."""
    dqk, dv = attention_dims(m)
    window = getattr(m, "sliding_window", None)
    if window is not None:
        skv = min(skv, window)
    f = 2 * m.n_heads * sq * skv * (dqk + dv) * m.n_layers
    if causal and sq == skv:
        f /= 2
    return f


@dataclass(frozen=True)
class TrainFlops:
    model_per_token: float  # the MFU convention
    hardware_per_token: float  # what the step executes (causal attention, remat recompute)
    tokens_per_step: int

    @property
    def model_per_step(self) -> float:
        return self.model_per_token * self.tokens_per_step

    @property
    def hardware_per_step(self) -> float:
        return self.hardware_per_token * self.tokens_per_step


def pipeline_of(cfg: Config, sizes: dict[str, int]) -> str | None:
    """The pipeline schedule a config runs on a mesh of `sizes` (None without pp)."""
    return cfg.parallelism.pp_schedule if sizes["pp"] > 1 else None


def train_flops(m: ModelConfig, batch: int, seq: int, remat: str | None = None, *,
                pipeline: str | None = None) -> TrainFlops:
    """Training FLOPs per token and per step of `batch` sequences of `seq` tokens
    (`pipeline`: the schedule with pp > 1; 1f1b runs every stage's forward once more, in
    its backward tick, before the remat policy's recompute)."""
    remat = remat or m.remat
    n = active_params(m) + head_params(m)
    dqk, dv = attention_dims(m)
    depth = getattr(m, "mtp_depth", 0)  # MTP modules: a block, a projection and a head each
    mtp = m.mtp_params(active=True) + depth * head_params(m) if depth else 0
    layers = m.n_layers + depth
    model = 6 * (n + mtp) + 6 * layers * m.n_heads * (dqk + dv) * seq  # 12·L·H·D·S, dqk = dv
    attn_fwd = attention_flops(m, seq, seq) / seq  # per token, the main layers'
    matmul_fwd = 2 * (n - head_params(m))  # the blocks' matmuls (the head is not rematted)
    recompute = {"none": 0.0, "dots": attn_fwd + routed_expert_flops(m),
                 "full": matmul_fwd + attn_fwd}[remat]  # the main stack's (MTP: not rematted)
    if pipeline == "1f1b":
        recompute += matmul_fwd + attn_fwd
    hardware = 6 * (n + mtp) + 3 * attn_fwd * layers / m.n_layers + recompute
    return TrainFlops(model, hardware, batch * seq)


def prefill_flops(m: ModelConfig, batch: int, prompt: int) -> float:
    """Prefill of `batch` prompts of `prompt` tokens (logits of the last position only)."""
    n = active_params(m)
    return batch * (2 * n * prompt + 2 * head_params(m) + attention_flops(m, prompt, prompt))


def decode_flops(m: ModelConfig, batch: int, context: int) -> float:
    """One decode step: `batch` new tokens, each attending to `context` cached ones."""
    n = active_params(m) + head_params(m)
    return batch * (2 * n + attention_flops(m, 1, context, causal=False))
