"""Training memory of a step whose layer loop is unrolled (`model.unroll_layers`).

The rolled scan (`memory.py`) carries what the backward pass reads as stacks: each saved
intermediate is written into an [L, ...] buffer by the forward loop and read back by the
backward one, each layer's gradient is summed into the stacked gradient in its ZeRO
layout inside the loop, and remat bounds what is live to the saved stack plus one layer's
recomputation. Unrolled, there is no loop to order the layers, and XLA's buffer
assignment on the CPU holds at the step's peak (the first layers' backward):

    gradients    every layer's whole in the compute layout (the reduce-scatter into the
                 ZeRO layout is scheduled after the backward pass, not per layer), and the
                 embedding's and head's once, not four times
    activations  every layer's intermediates, as without remat, under every remat policy:
                 the recomputation that remat inserts depends only on the layer's saved
                 input, so the scheduler runs every layer's early in the backward pass and
                 their intermediates wait for their layer's turn. Of the rolled "none"
                 count (`saved_per_token`), about 0.9 of the layer's intermediates and
                 half its attention scores are kept (XLA fuses the cheap elementwise
                 ones into their readers instead of storing them), 0.82 under remat
                 (the recomputation keeps fewer); beside them a working set of 0.21 (0.23
                 under remat) of one layer's full set; with cp the ring's blocks of every
                 layer; with MoE layers every layer's experts' rows and, about 0.85 of
                 them, the experts' backward buffers (`expert_bytes`)
    logits       as rolled: f32 [T, V/tp] logits, their exponentials and their gradient
                 (LOGITS_COPIES)

Weights are read as static slices of the stack, so no per-layer copy is made. The figures
are fitted to `memory_analysis()` of the compiled steps (`benchmarks/plan_check.py --cpu`,
the `*_unroll` layouts); pipelines (pp > 1) and MTP modules are not modelled here and
keep the rolled count.

XLA's GPU compiler keeps far less (`plan_check.py --gpu-memory`: the one-GPU configs at 4,
16 and 20 layers on an H100): each layer keeps what its remat policy saves, as the rolled
scan does (the layer's input under "full", about 0.65 of the rolled count under "dots",
0.55 of it without remat: its fusions recompute the cheap elementwise intermediates instead
of storing them), no working set of the layer in the backward beyond that, no experts'
buffers past the dots count, and one float32 copy of the logits, not three.
"""
from __future__ import annotations

from jaxllm.config import Config
from jaxllm.plan.activations import (LOGITS_COPIES, attention_scores, expert_bytes,
                                     heads_split, ring_saved_per_token, saved_per_token)

# Of a layer's intermediates without remat (`saved_per_token(..., "none")`), the share
# XLA keeps per layer at the unrolled step's peak, by remat policy; its attention scores
# count half of that.
UNROLLED_KEPT = {"none": 0.90, "dots": 0.82, "full": 0.82}
# The working set of the layer being differentiated, in units of its full intermediates.
UNROLLED_WORKING_SET = {"none": 0.21, "dots": 0.23, "full": 0.23}
# The share of the experts' backward buffers (`expert_bytes`) live beside them.
UNROLLED_EXPERT_BACKWARD = 0.85
# On a GPU: of a layer's saved bytes under its own remat policy
# (`saved_per_token(..., remat)`), the share kept per layer at the peak; and the copies of
# the float32 logits live there (the CPU: 3, as rolled).
GPU_UNROLLED_KEPT = {"none": 0.55, "dots": 0.65, "full": 1.0}
GPU_LOGITS_COPIES = 1


def modelled(cfg: Config, sizes: dict[str, int]) -> bool:
    """Whether the unrolled step's memory is modelled for this layout: an unrolled layer
    loop outside a pipeline, without MTP modules."""
    return cfg.model.unroll_layers and sizes["pp"] == 1 and not cfg.model.mtp_depth


def unrolled_memory(cfg: Config, sizes: dict[str, int], states, tokens: float,
                    layers: int, n_moe: int, impl: str, remat: str,
                    platform: str) -> tuple[float, float, int]:
    """(gradients bytes, activations bytes, copies of the f32 logits) per device at the
    unrolled step's peak (`states`: `memory.state_bytes`; `layers` / `n_moe`: the device's
    layers / MoE ones)."""
    m, t, p = cfg.model, cfg.train, cfg.parallelism

    def per_layer(moe: bool, policy: str) -> float:  # one layer's saved bytes per token
        return saved_per_token(m, sizes, t.seq_len, impl, policy, p.sequence_parallel, moe)

    def layers_of(f) -> float:  # f(moe) over the device's dense and MoE layers
        return (layers - n_moe) * f(False) + (n_moe * f(True) if n_moe else 0.0)

    grads = states.stack_compute + states.grads_unstacked
    ring = layers * tokens * ring_saved_per_token(m, sizes) if sizes["cp"] > 1 else 0.0
    if platform != "cpu":
        kept = GPU_UNROLLED_KEPT[remat] * tokens * layers_of(lambda moe: per_layer(moe, remat))
        return grads, kept + ring, GPU_LOGITS_COPIES

    hq, _ = heads_split(m.n_heads, m.n_kv_heads, sizes["tp"])
    scores = attention_scores(hq, t.seq_len, impl)
    kept = UNROLLED_KEPT[remat] * tokens * layers_of(
        lambda moe: per_layer(moe, "none") - scores / 2)
    acts = kept + UNROLLED_WORKING_SET[remat] * tokens * per_layer(bool(n_moe), "none") + ring
    if n_moe:
        e_saved, e_backward = expert_bytes(m, sizes, tokens, platform)
        acts += n_moe * e_saved + UNROLLED_EXPERT_BACKWARD * e_backward
    return grads, acts, LOGITS_COPIES
