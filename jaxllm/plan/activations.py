"""Activation bytes per token and layer: what the backward pass reads, by layer kind.

`memory.py` adds these up over a device's layers and tokens. Each count follows the code
that makes the tensors (model/block.py, attention.py, mla.py, moe.py, sharding/experts.py)
and is checked against what XLA's buffer assignment holds on the CPU
(`benchmarks/plan_check.py --cpu`):

    dense block   norms, q/k/v and the attention output, the SwiGLU's gate, up and
                  products; the attention's scores when it is the reference einsum
    MLA           the query and key-value latents (whole over tp) and their norms, q and
                  k of nope + rope dims, v and the output of v_head_dim per head
    MoE layer     its block as above with the shared experts as the SwiGLU, the router,
                  and without remat the routed experts' rows (`expert_bytes`): dropless,
                  the local experts take ep x tokens x top_k rows

Remat "dots" keeps the outputs of `dot_general`s without batch dimensions
(`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`): the projections, an MoE
layer's router logits and its shared experts' gate and up. The routed experts are no such
dot: the grouped matmul is XLA's ragged dot (the CPU) or a Pallas kernel (a GPU), the
dispatch and combine are gathers, and the combine's weighted sum is a batched einsum, so
their rows are recomputed in the layer's backward as under "full" (`experts_saved`).
"""
from __future__ import annotations

from jaxllm.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# One layer's working set while the backward pass differentiates it, in units of its full
# intermediates: its cotangents ("none"), plus its recomputed intermediates ("full"), or
# only the non-matmul ones ("dots"). The figures are what XLA's buffer assignment holds at
# the step's peak (tests/test_plan.py checks them against the compiler).
BACKWARD_WORKING_SET = {"none": 0.59, "dots": 0.40, "full": 0.88}


def resolved_attention_impl(m: ModelConfig, platform: str) -> str:
    """The attention the trainer runs: on the CPU "auto" is the reference; on a GPU a
    fused kernel."""
    if m.attention_impl != "auto":
        return m.attention_impl
    return "reference" if platform == "cpu" else "cudnn"


def heads_split(n_heads: int, n_kv: int, tp: int) -> tuple[float, float]:
    """(query heads, key/value heads) per device: kv heads repeated when tp does not divide them."""
    hq = n_heads / tp if n_heads % tp == 0 else n_heads
    hkv = n_kv / tp if n_kv % tp == 0 else hq
    return hq, hkv


def attention_scores(hq: float, kv_len: int, impl: str) -> float:
    """Bytes per token and layer that attention itself keeps for its backward pass.

    A fused kernel (flash, cuDNN) keeps its output's log-sum-exp; the reference / XLA
    einsum attention materialises the scores: f32 probabilities, their exponentials and
    the masked scores [Hq, S] per query, and the boolean mask.
    """
    if impl in ("reference", "xla"):
        return hq * kv_len * (3 * 4 + 1) + 3 * 4 * hq
    return 4 * hq


def attention_projections(m: ModelConfig, hq: float, hkv: float, remat: str) -> float:
    """Elements per token and layer of the attention's projections that the backward
    reads ("none": every intermediate; "dots": the matmul outputs), its heads split."""
    mla = m.mla if m.attention == "mla" else None
    if mla is None:
        hd = m.resolved_head_dim
        qkv = (hq + 2 * hkv) * hd
        # "none": k and v broadcast to the query heads and the attention output beside
        # q, k, v; "dots": the attention output and the output projection's input and output
        return qkv + (2 if remat == "none" else 3) * hq * hd
    dqk, dv = mla.qk_head_dim, mla.v_head_dim
    q_lora, kv_lora = mla.q_lora_rank or 0, mla.kv_lora_rank
    if remat == "none":  # each latent, normed and scaled (its RMSNorm); q, k, v, output
        return 3 * q_lora + 3 * kv_lora + 2 * hq * dqk + 2 * hq * dv
    # "dots": q_a, q_b, kv_a (latent and rotary key), kv_b, the attention output, o's input
    return (q_lora + hq * dqk + kv_lora + mla.qk_rope_head_dim
            + hq * (mla.qk_nope_head_dim + dv) + 2 * hq * dv)


def norms(m: ModelConfig) -> int:
    """RMSNorms per block: its two, and MLA's latent ones (key-value; query with q_lora_rank)."""
    if m.attention != "mla":
        return 2
    return 3 + bool(m.mla.q_lora_rank)


def saved_per_token(m: ModelConfig, sizes: dict[str, int], kv_len: int, impl: str,
                    remat: str, sequence_parallel: bool = False, moe: bool = False) -> float:
    """Bytes per token and layer the backward pass reads under a remat policy (`moe`: of
    an MoE layer, whose SwiGLU is its shared experts; its routed experts' rows are
    `expert_bytes`')."""
    c = DTYPE_BYTES[m.dtype]
    tp = sizes["tp"]
    d = m.d_model / (tp if sequence_parallel else 1)  # the residual stream
    hq, hkv = heads_split(m.n_heads, m.n_kv_heads, tp)
    f = (m.moe.num_shared_experts * m.moe.expert_mlp_dim if moe else m.mlp_dim) / tp
    if remat == "full":
        return c * d  # the block's input
    attn = attention_projections(m, hq, hkv, remat)
    if remat == "dots":  # matmul outputs: attention's (above), gate, up, down; the
        # router's f32 logits
        return c * (attn + d + 2 * f) + (4 * m.moe.num_experts if moe else 0.0)
    # every intermediate: norm inputs, outputs and statistics (the matmuls' inputs are
    # whole over tp even with sequence parallelism), the attention's (above), the
    # SwiGLU's gate, up and their products
    whole = 2 * m.d_model if sequence_parallel else 4 * m.d_model
    split = 6 * m.d_model / tp - whole / tp if sequence_parallel else 2 * d
    stats = 2 * 4 * norms(m)  # each norm's f32 rsqrt and scaled input statistics
    # an MoE layer's router (f32 logits and scores) and, in f32, its experts' outputs per
    # assignment and their weighted sum
    router = 4 * (2 * m.moe.num_experts + (m.moe.top_k + 1) * m.d_model) if moe else 0.0
    return (c * (whole + split + attn + 6 * f) + stats + router
            + attention_scores(hq, kv_len, impl))


# Copies of the f32 logits [T, V/tp] at the step's peak: the logits, their exponentials
# kept for the backward and their gradient (the CPU's buffer assignment, rolled or not).
LOGITS_COPIES = 3


def local_vocab(m: ModelConfig, sizes: dict[str, int]) -> float:
    """The output head's columns on a device: the vocabulary split over tp where it divides."""
    return m.vocab_size / (sizes["tp"] if m.vocab_size % sizes["tp"] == 0 else 1)


def experts_saved(remat: str) -> bool:
    """Whether each MoE layer's routed experts' rows (`expert_bytes`' saved) stay until its
    backward: only without remat. Under "dots" and "full" the layer being differentiated
    recomputes them, so one layer's are live at a time."""
    return remat == "none"


def _expert_width(m: ModelConfig, tp: int) -> float:
    """One routed expert's hidden width on a device: split over tp where it divides."""
    f = m.moe.expert_mlp_dim
    return f / tp if f % tp == 0 else f


def expert_weight_slices(m: ModelConfig, sizes: dict[str, int]) -> float:
    """Bytes of one MoE layer's local experts' weights as the layer's scan sliced them,
    which its backward keeps when a device holds several experts (part of `expert_bytes`'
    saved); none with one local expert."""
    local = m.moe.num_experts / sizes["ep"]
    if local <= 1:
        return 0.0
    return 3 * local * m.d_model * _expert_width(m, sizes["tp"]) * DTYPE_BYTES[m.param_dtype]


def expert_bytes(m: ModelConfig, sizes: dict[str, int], tokens: float,
                 platform: str) -> tuple[float, float]:
    """(saved, backward) bytes of one MoE layer's routed experts on one device.

    Dropless (`sharding/experts.py`): the local experts take R = ep x tokens x top_k rows
    (with ep > 1 the receive buffer holds every assignment its group could send, for a
    tokens x top_k of real ones). Saved for the backward: the rows sorted by expert and
    six [R, f] products (gate, up, the sigmoid, the SwiGLU, its product and the product
    masked to its expert); with several local experts their weights as the layer's scan
    sliced them; on the CPU the padded exchange's mask. While the backward runs the
    layer: the zeroed buffers of the gathers' transposes and a scatter in flight (two of
    R rows, one of the assignments) and the grouped matmuls' cotangents. On the CPU the
    grouped matmul is XLA's ragged dot, which expands its ragged operand per local expert
    into [G, R, K]: three such copies and a relayout of [R, d] at once; a kernel reads
    the rows in place (G counts as 1)."""
    c, moe, d = DTYPE_BYTES[m.dtype], m.moe, m.d_model
    ep = sizes["ep"]
    f = _expert_width(m, sizes["tp"])
    assigned = tokens * moe.top_k
    rows = ep * assigned
    local = moe.num_experts / ep
    g = local if platform == "cpu" else 1
    saved = c * rows * (d + 6 * f) + expert_weight_slices(m, sizes)
    if ep > 1 and platform == "cpu":
        saved += rows * d
    backward = c * d * (2 * rows + assigned) + c * g * rows * (4 * d + f)
    return saved, backward


def ring_saved_per_token(m: ModelConfig, sizes: dict[str, int]) -> float:
    """Context parallelism: each of the cp ring steps keeps the key/value block it received
    and its partial output and log-sum-exp, per local token and layer."""
    c, cp = DTYPE_BYTES[m.dtype], sizes["cp"]
    hq, hkv = heads_split(m.n_heads, m.n_kv_heads, sizes["tp"])
    hd = m.resolved_head_dim
    return cp * (c * (2 * hkv * hd + hq * hd) + 4 * hq)
