"""Memory of the multi-token-prediction modules (`model/mtp.py`) in a training step.

The D modules run after the main stack, each a projection over [embedding; hidden], a
block of the model's kind, its own norm and the shared head with its logits and loss.
They run outside the layer stack's scan, so the model's remat policy does not reach
them: each keeps every intermediate of its block for its backward. What XLA's buffer
assignment holds for them on the CPU (`benchmarks/plan_check.py --cpu`):

    one device    the backward runs the modules last to first before the main stack's,
                  so the peak is either the main stack's backward (the modules'
                  gradients live beside it, and per depth one more head gradient and
                  one more embedding scatter-add, each the table's size in f32) or the
                  last module's SwiGLU backward: the main stack's saved activations and
                  gradient accumulators, every module's saved activations, per module a
                  copy of the head's table and its head gradient, and the last module's
                  working set (its weights' gradients and transposes, about its
                  parameter bytes, and three [T, mlp] cotangents)
    pipelines     the modules run on the last stage inside the head's `lax.cond`, which
                  a backward tick differentiates (1f1b, and gpipe's checkpointed head
                  recomputed per tick): per module its saved activations, its weights
                  as the cond's residuals, their gradients in the tick and those
                  reduced over the data axes (three times its parameter bytes beside
                  the accumulator), three tables (`head_tick`), and in an MoE model the
                  module's experts' backward buffers; the stage's own backward is not
                  running then

The saved activations per token: the block's every intermediate (`saved_per_token`
without remat; an MoE block's routed experts' rows with it) and the [embedding; hidden]
concatenation, 2d; inside a pipeline's head cond also the module's other [T, d] tensors
and its logits (`module_saved`).
"""
from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.plan.activations import DTYPE_BYTES, expert_bytes, local_vocab, saved_per_token


def module_saved(m: ModelConfig, sizes: dict[str, int], tokens: float, kv_len: int,
                 impl: str, sequence_parallel: bool, platform: str,
                 in_cond: bool = False) -> float:
    """Bytes one MTP module keeps from its forward to its backward on one device; with
    `in_cond` (a pipeline's head) also its embedding, its two input norms' and its final
    norm's outputs and its block's output (5d), and its logits in f32 with the targets'
    one-hot mask (5 V)."""
    moe = m.moe is not None
    c = DTYPE_BYTES[m.dtype]
    per_token = (saved_per_token(m, sizes, kv_len, impl, "none", sequence_parallel, moe)
                 + 2 * c * m.d_model)
    if in_cond:
        per_token += 5 * c * m.d_model + 5 * local_vocab(m, sizes)
    rows = expert_bytes(m, sizes, tokens, platform)[0] if moe else 0.0
    return tokens * per_token + rows


def main_backward_extra(m: ModelConfig, table: float) -> float:
    """Beside the main stack's backward, one device: per depth the head's gradient and the
    embedding's scatter-add, summed only at the end (the modules' own gradients are in
    `grads_live`)."""
    return m.mtp_depth * 2 * table


def last_module_backward(m: ModelConfig, sizes: dict[str, int], tokens: float,
                         saved: float, module_params: float, table: float) -> float:
    """One device at the last module's SwiGLU backward, beyond the main stack's saved
    activations and gradient accumulators: every module's `saved` activations, its copy
    of the head's table and its head gradient; the main head's table copy and gradient;
    the last module's working set (its parameters' bytes, three [T, mlp] cotangents)."""
    c, tp = DTYPE_BYTES[m.dtype], sizes["tp"]
    f = (m.moe.num_shared_experts * m.moe.expert_mlp_dim if m.moe else m.mlp_dim) / tp
    return (m.mtp_depth * (saved + 2 * table) + 2 * table + module_params
            + 3 * c * f * tokens)


def head_tick(m: ModelConfig, saved: float, module_params: float, table: float) -> float:
    """A pipeline's last stage while a backward tick differentiates the head's cond,
    beyond the gradient accumulators and the main logits: per module its saved
    activations (`module_saved(in_cond=True)`), its weights as the cond's residuals, their
    gradients and those reduced over the data axes, and three tables (its depth's head
    gradient, that reduced, its embedding's scatter-add); the head's table as the cond's
    residual, the main head's gradient and that reduced."""
    return m.mtp_depth * (saved + 3 * module_params + 3 * table) + 3 * table
