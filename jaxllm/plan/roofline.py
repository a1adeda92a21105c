"""Roofline times: a step takes max(FLOPs / peak, HBM bytes / bandwidth), plus what the
network adds; the larger term names what bounds it.

Arithmetic intensity is FLOPs per HBM byte; above the ridge point (peak / bandwidth) a
workload is compute-bound, below it memory-bound. HBM bytes counted:

    train step  the compute copy of the device's weights (its share over tp, pp and ep)
                read three times per microbatch (forward, the two backward matmuls), the
                optimizer's pass over its shards (read params, grads, m, v; write params,
                m, v) and the saved activations written once and read once
    prefill     the weights once and the new K/V written
    decode      the weights once (of the routed experts, those the batch's tokens choose)
                and every live K/V byte read, per step

Communication overlaps computation at best (`step_s` takes the larger) and not at all at
worst (`step_exposed_s` adds them); pipeline stages idle for the schedule's bubble,
(pp - 1) / (microbatches x repeats) of the work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxllm.config import Config
from jaxllm.plan.flops import decode_flops, pipeline_of, prefill_flops, train_flops
from jaxllm.plan.hardware import Hardware
from jaxllm.plan.memory import DTYPE_BYTES, TrainMemory, inference_memory, state_bytes
from jaxllm.sharding.rules import Rules


@dataclass(frozen=True)
class Point:
    """One workload on the roofline, per device."""
    name: str
    flops: float
    bytes: float
    comm_s: float = 0.0

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def compute_s(self, hw: Hardware) -> float:
        return self.flops / hw.flops

    def memory_s(self, hw: Hardware) -> float:
        return self.bytes / hw.hbm_bw

    def seconds(self, hw: Hardware) -> float:
        return max(self.compute_s(hw), self.memory_s(hw), self.comm_s)

    def bound(self, hw: Hardware) -> str:
        terms = {"compute": self.compute_s(hw), "memory": self.memory_s(hw),
                 "communication": self.comm_s}
        return max(terms, key=terms.get)


def bubble_fraction(cfg: Config, pp: int, micro: int) -> float:
    if pp == 1:
        return 0.0
    return (pp - 1) / (micro * getattr(cfg.parallelism, "pp_repeats", 1))


def train_point(cfg: Config, sizes: dict[str, int], mem: TrainMemory, comm_s: float,
                micro: int = 1) -> Point:
    """The training step on one device."""
    m, t = cfg.model, cfg.train
    n = math.prod(sizes.values())
    fl = train_flops(m, t.batch_size, t.seq_len, pipeline=pipeline_of(cfg, sizes))
    flops = fl.hardware_per_step / n * (1 + bubble_fraction(cfg, sizes["pp"], micro))
    # the weights in their compute layout (the layer stack's, and the embedding's, head's
    # and final norm's and the MTP modules' as their gradients are made), in the compute dtype
    states = state_bytes(cfg, Rules(tuple(sizes.items()), t.zero_stage,
                                    cfg.parallelism.sequence_parallel))
    compute = ((states.stack_compute + states.grads_unstacked + states.mtp)
               / DTYPE_BYTES[m.param_dtype])
    weights = 3 * micro * compute * DTYPE_BYTES[m.dtype]
    optimizer = 2 * mem.params + mem.grads + 2 * mem.opt_state  # read all; write p, m, v
    acts = 2 * mem.activations
    return Point("train", flops, weights + optimizer + acts, comm_s)


def prefill_point(cfg: Config, batch: int, prompt: int, tp: int) -> Point:
    m = cfg.model
    mem = inference_memory(cfg, float("inf"), tp, prompt)
    return Point(f"prefill B={batch}", prefill_flops(m, batch, prompt) / tp,
                 mem.weights + batch * prompt * mem.kv_per_token)


def untouched_expert_bytes(m, batch: int) -> float:
    """Routed-expert weights a decode step of `batch` tokens does not read: with E experts
    of which each token takes k, a step reads E (1 - (1 - k/E)^batch) of them per MoE
    layer on average (routing taken as uniform, as balancing makes it)."""
    moe = m.moe
    if moe is None:
        return 0.0
    e, k = moe.num_experts, moe.top_k
    touched = e * (1 - (1 - k / e) ** batch)
    per_expert = 3 * m.d_model * moe.expert_mlp_dim * DTYPE_BYTES[m.dtype]
    return (m.n_layers - moe.dense_layers) * (e - touched) * per_expert


def decode_point(cfg: Config, batch: int, context: int, tp: int) -> Point:
    m = cfg.model
    mem = inference_memory(cfg, float("inf"), tp, context)
    weights = mem.weights - untouched_expert_bytes(m, batch) / tp
    return Point(f"decode B={batch}", decode_flops(m, batch, context) / tp,
                 weights + batch * context * mem.kv_per_token)
