"""Memory per device: the model states by ZeRO stage and layout, activations by remat
policy and pipeline schedule, the logits and the loss's temporaries, and for inference
the KV cache.

Model states come from the model itself: its abstract parameter tree (shapes and logical
axes, no arrays) laid out by `sharding.rules` for the config's mesh sizes, so every
parameter's split is the one training uses (a dimension the mesh does not divide stays
whole), and a new layer kind (MoE experts over `ep`, MLA's latents) is counted as soon as
the model has it. `sharding/memory.py` holds the ZeRO formula these shards follow.

Training, per device, with local tokens T = (B / (dp·fsdp·ep) / microbatches) x S / cp:

    arguments    params + Adam m, v (param dtype) + the batch; outputs alias them (donated)
    gradients    the layer stack's in their ZeRO layout (the scanned backward pass sums
                 each layer's straight into it); the embedding's, head's and final norm's
                 whole in the compute layout, about four copies of them at the peak
    activations  what the backward pass reads, per layer and token (`activations.py`):
                 "none" every intermediate, "dots" the matmul outputs, "full" the block's
                 input only; plus the working set of the layer being differentiated
                 (`BACKWARD_WORKING_SET`), with cp the ring's blocks, with MoE layers the
                 experts' rows (every layer's without remat, the differentiated layer's
                 under "dots" and "full"), with pp what the schedule keeps
                 (`pipeline_activations`; an MoE model under gpipe or circular,
                 `mirrored_moe_activations`)
    logits       f32 [T, V/tp] logits, their exponentials kept for the backward, and the
                 gradient of the logits

With model.unroll_layers (outside a pipeline, without MTP modules) XLA holds the step
otherwise: `unrolled.py` counts it.

The buffers beyond the parameter and activation counts (the gradients' copies, the
working set) are what XLA's buffer assignment holds at the step's peak on the CPU;
`benchmarks/plan_check.py --cpu` sets the sum beside `memory_analysis()` for every layout
of its sweep and tests/test_plan.py checks a few of them to 5%.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from jaxllm.config import Config, ModelConfig
from jaxllm.plan.activations import (BACKWARD_WORKING_SET, DTYPE_BYTES, LOGITS_COPIES,
                                     expert_bytes, expert_weight_slices, experts_saved,
                                     local_vocab, resolved_attention_impl,
                                     ring_saved_per_token, saved_per_token)
from jaxllm.plan import mtp, unrolled
from jaxllm.plan.flops import stage_layers, stage_moe_layers
from jaxllm.sharding.rules import Rules

__all__ = ["DTYPE_BYTES", "StateBytes", "TrainMemory", "InferenceMemory", "state_bytes",
           "train_memory", "inference_memory", "kv_bytes_per_token", "weight_bytes",
           "local_tokens", "microbatches", "compiled_peak", "describe_vs_compiled"]


# -- model states --------------------------------------------------------------------------

@lru_cache(maxsize=16)
def _abstract_state(m: ModelConfig):
    """The model's parameters traced abstractly (shapes, no arrays), once per config."""
    from flax import nnx

    from jaxllm.model import build_model

    return nnx.state(nnx.eval_shape(lambda: build_model(m, rngs=nnx.Rngs(0))))


@lru_cache(maxsize=16)
def abstract_params(m: ModelConfig) -> tuple[tuple[tuple[int, ...], str, tuple], ...]:
    """(shape, dtype, logical axes) of every parameter, from the model traced abstractly."""
    import jax
    from flax import nnx

    from jaxllm.sharding.plan import logical_axes

    state = _abstract_state(m)
    shapes = jax.tree.leaves(nnx.to_pure_dict(state))
    names = jax.tree.leaves(logical_axes(state), is_leaf=lambda x: isinstance(x, tuple))
    return tuple((tuple(a.shape), str(a.dtype), tuple(n)) for a, n in zip(shapes, names))


@lru_cache(maxsize=16)
def _top_keys(m: ModelConfig) -> tuple[str, ...]:
    """The top-level module of every parameter of `abstract_params` (same order)."""
    import jax
    from flax import nnx

    paths = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(_abstract_state(m)))[0]
    return tuple(str(getattr(p[0], "key", "")) for p, _ in paths)


@lru_cache(maxsize=16)
def in_pipelined_stack(m: ModelConfig) -> tuple[bool, ...]:
    """For each parameter of `abstract_params` (same order): whether it is a layer of the
    stack that pp splits into stages (`sharding/pipeline.py`'s, the MoE stack of an MoE
    model); the other stacks (an MoE model's dense layers) stay whole on every stage."""
    from jaxllm.sharding.pipeline import STACK

    return tuple(k == STACK for k in _top_keys(m))


def _shard_elems(rules: Rules, shape, names, kind: str) -> float:
    spec = rules.param_spec(names, shape, kind)
    n = 1.0
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        n *= dim / math.prod(rules.size(a) for a in axes)
    return n


def pipeline_layer_fraction(layers: int, pp: int) -> float:
    """The share of a pipelined stack of `layers` that one stage holds (1 without pp)."""
    return math.ceil(layers / pp) / layers


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float  # in the ZeRO layout (what the optimizer reads)
    grads_live: float  # what the backward pass holds: see `state_bytes`
    grads_unstacked: float  # of the embedding, head and final norm, in the compute layout
    opt_state: float
    stack_compute: float = 0.0  # the layer stack's parameters in the compute layout
    stack_params: float = 0.0  # the layer stack's parameters in their own layout
    unpipelined_stack: float = 0.0  # in the compute layout, of the stacks pp leaves whole
    mtp: float = 0.0  # the MTP modules' parameters in the compute layout (not in unstacked)
    table: float = 0.0  # the embedding table in the compute layout


def state_bytes(cfg: Config, rules: Rules) -> StateBytes:
    """Per-device bytes of each model state under `rules` (mesh sizes and ZeRO stage).

    `grads_live`: the layer stack's gradients are made inside the scanned backward pass
    layer by layer, each summed straight into its ZeRO layout; the embedding, the head and
    the final norm are made whole (their compute layout) and reduce-scattered after; so
    are the MTP modules' (`mtp`, in `grads_live` but not in `grads_unstacked`).
    """
    params = grads = live = opt = unstacked = stack = stack_params = whole = mtp = table = 0.0
    pp = rules.size("pp")
    for (shape, dtype, names), split, top in zip(abstract_params(cfg.model),
                                                 in_pipelined_stack(cfg.model),
                                                 _top_keys(cfg.model)):
        share = pipeline_layer_fraction(shape[0], pp) if split and "layers" in names else 1.0
        itemsize = np.dtype(dtype).itemsize * share
        shard = lambda kind: _shard_elems(rules, shape, names, kind) * itemsize
        params += shard("params")
        grads += shard("grads")
        live += shard("grads") if "layers" in names else shard("compute")
        mtp += shard("compute") if top == "mtp" else 0.0
        table += shard("compute") if top == "embed" else 0.0
        unstacked += 0.0 if "layers" in names or top == "mtp" else shard("compute")
        stack += shard("compute") if "layers" in names else 0.0
        stack_params += shard("params") if "layers" in names else 0.0
        whole += shard("compute") if "layers" in names and not split else 0.0
        opt += 2 * shard("opt_state")
    return StateBytes(params, grads, live, unstacked, opt, stack, stack_params, whole,
                      mtp, table)


# -- training -------------------------------------------------------------------------------

def microbatches(cfg: Config, override: int | None = None) -> int:
    """Microbatches per step: `override`, else train.microbatches (pipeline parallelism),
    else 1."""
    return max(1, override if override is not None else getattr(cfg.train, "microbatches", 1))


def local_tokens(cfg: Config, sizes: dict[str, int], batch: int | None = None,
                 micro: int = 1) -> tuple[int, int]:
    """(rows, seq) of one microbatch on one device."""
    t = cfg.train
    batch = batch or t.batch_size
    rows = batch / (sizes["dp"] * sizes["fsdp"] * sizes["ep"]) / micro
    return max(1, int(rows)), t.seq_len // sizes["cp"]


@dataclass(frozen=True)
class TrainMemory:
    """Per-device bytes of one training step."""
    params: float
    opt_state: float
    grads: float
    activations: float
    logits: float
    batch: float

    @property
    def total(self) -> float:
        return (self.params + self.opt_state + self.grads + self.activations + self.logits
                + self.batch)

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "optimizer": self.opt_state, "gradients": self.grads,
                "activations": self.activations, "logits": self.logits, "batch": self.batch,
                "total": self.total}


def train_memory(cfg: Config, sizes: dict[str, int], *, platform: str = "gpu",
                 zero_stage: int | None = None, remat: str | None = None,
                 batch: int | None = None, micro: int | None = None) -> TrainMemory:
    """Per-device memory of a training step of `cfg` on a mesh of `sizes` (`micro`:
    microbatches, default `microbatches(cfg)`): the larger of two moments, the backward
    pass at a dense layer and, with MoE layers, at the last one's experts."""
    m, t, p = cfg.model, cfg.train, cfg.parallelism
    micro = microbatches(cfg, micro)
    zero_stage = t.zero_stage if zero_stage is None else zero_stage
    remat = remat or m.remat
    rules = Rules(tuple(sizes.items()), zero_stage, p.sequence_parallel)
    states = state_bytes(cfg, rules)
    rows, seq = local_tokens(cfg, sizes, batch, micro)
    tokens = rows * seq
    impl = resolved_attention_impl(m, platform)
    kv_len = t.seq_len  # ring / all-gather attention sees every key block

    def saved(moe: bool, policy: str = remat) -> float:  # one layer, all local tokens
        return tokens * saved_per_token(m, sizes, kv_len, impl, policy,
                                        p.sequence_parallel, moe)

    def module_saved() -> float:  # one MTP module, all local tokens
        return mtp.module_saved(m, sizes, tokens, kv_len, impl, p.sequence_parallel, platform,
                                in_cond=sizes["pp"] > 1)

    layers = stage_layers(m, sizes["pp"])  # with pp: the busiest stage's
    n_moe = stage_moe_layers(m, sizes["pp"])
    stacked = (layers - n_moe) * saved(False) + (n_moe * saved(True) if n_moe else 0.0)
    batch_bytes = 2 * 4 * rows * seq * micro
    logits_copy = 4 * tokens * local_vocab(m, sizes)  # f32 [T, V/tp]
    logits = LOGITS_COPIES * logits_copy
    if unrolled.modelled(cfg, sizes):
        grads, acts, copies = unrolled.unrolled_memory(cfg, sizes, states, tokens, layers,
                                                       n_moe, impl, remat, platform)
        return TrainMemory(states.params, states.opt_state, grads, acts,
                           copies * logits_copy, batch_bytes)
    if sizes["pp"] > 1 and n_moe and p.pp_schedule != "1f1b":
        # its peak is the backward at the experts, the logits gone
        acts = mirrored_moe_activations(cfg, sizes, micro, remat, tokens, states, saved,
                                        platform)
        if m.mtp_depth:  # the head's tick, not checked against a compile
            acts += mtp.head_tick(m, module_saved(), states.mtp / m.mtp_depth, states.table)
        return TrainMemory(states.params, states.opt_state, states.grads_live, acts, 0.0,
                           batch_bytes)
    if sizes["pp"] > 1:
        acts, grads = pipeline_activations(cfg, sizes["pp"], micro, remat, stacked / layers,
                                           saved(bool(n_moe), "none"), tokens, states)
        working = BACKWARD_WORKING_SET["none" if p.pp_schedule == "1f1b" else remat]
        # with MTP modules, the last stage's backward tick at the head: the stage's own
        # backward (its working set) not running yet, the modules' bytes beside
        at_mtp = (acts - working * saved(bool(n_moe), "none")
                  + mtp.head_tick(m, module_saved(), states.mtp / max(m.mtp_depth, 1),
                                  states.table)
                  + (expert_bytes(m, sizes, tokens, platform)[1] if m.moe else 0.0)
                  ) if m.mtp_depth else 0.0
    else:
        # the layer being differentiated: its cotangents, and under remat its recomputed
        # intermediates, in units of one layer's full set
        acts = stacked + BACKWARD_WORKING_SET[remat] * saved(False, "none")
        # the embedding's and head's gradients are made whole four times over: the
        # head's matmul, the embedding's scatter-add, their sum when tied or their
        # transposes
        grads = states.grads_live + 3 * states.grads_unstacked
        # with MTP modules, the last one's backward (before the main stack's), and its
        # depths' head and embedding gradients beside the main stack's backward
        at_mtp = (stacked + states.grads_live - states.grads_unstacked - states.mtp
                  + mtp.last_module_backward(m, sizes, tokens, module_saved(),
                                             states.mtp / max(m.mtp_depth, 1), states.table)
                  ) if m.mtp_depth else 0.0
        grads += mtp.main_backward_extra(m, states.table)
    if sizes["cp"] > 1:  # the ring's key/value blocks and partial outputs of every step
        acts += layers * tokens * ring_saved_per_token(m, sizes)
    if n_moe:
        e_saved, e_backward = expert_bytes(m, sizes, tokens, platform)
        kept = experts_saved(remat)
        if kept:
            acts += n_moe * e_saved
        # The backward pass at the last MoE layer's experts: every layer's saved
        # activations and, without remat, experts' rows (under remat that layer's,
        # recomputed), the experts' backward buffers, and unless under full remat the
        # layer's own working set as a dense layer's; the gradients are the layer
        # stack's, the logits are gone.
        at_experts = (stacked + (n_moe if kept else 1) * e_saved + e_backward
                      + (BACKWARD_WORKING_SET[remat] * saved(True, "none")
                         if remat != "full" else 0.0))
        if at_experts + states.grads_live > acts + logits + grads:
            acts, logits, grads = at_experts, 0.0, states.grads_live
    if m.mtp_depth and sizes["pp"] == 1 and at_mtp > acts + logits + grads:
        acts, logits, grads = at_mtp, 0.0, 0.0  # at_mtp holds the gradients
    elif m.mtp_depth and sizes["pp"] > 1 and at_mtp > acts:
        acts = at_mtp
    return TrainMemory(states.params, states.opt_state, grads, acts, logits, batch_bytes)


def pipeline_activations(cfg: Config, pp: int, micro: int, remat: str, saved: float,
                         saved_none: float, tokens: float, states: StateBytes
                         ) -> tuple[float, float]:
    """(activations, gradients) of a pipeline stage (`sharding/pipeline.py`); `saved` /
    `saved_none`: one layer's saved bytes for one microbatch under the remat policy (the
    stage's mean) / without remat (an MoE stage's routed experts' rows are the caller's).

    gpipe, circular: autodiff of the scan over the v m + p - 1 forward ticks (the
    bubble's included) keeps every tick's residuals: the stage's saved activations (its
    input alone under remat, which recomputes the stage in the backward) and the head's
    input, and with v > 1 stages per device the stage's weights as the tick sliced them.
    1f1b: each backward tick runs its stage's forward again and at once its backward
    (`jax.vjp`), so a device keeps the schedule's input and cotangent slots and one
    stage's activations, which remat does not shrink but by the layers' inputs (the
    recomputed layer's set is live beside them); the gradients are the accumulators
    carried through the ticks (the parameters' layout), the layer's weights gathered
    for its backward, and with a stage of several layers (a scan) the tick's own
    stacked gradients of the stage and the layer's weights the scan sliced."""
    from jaxllm.sharding.pipeline_schedule import build, slots

    m, p = cfg.model, cfg.parallelism
    v = p.pp_repeats
    layers = stage_layers(m, pp, v)
    stage_in = DTYPE_BYTES[m.dtype] * m.d_model * tokens  # [rows, seq, d] of one microbatch
    stage = layers * saved
    if p.pp_schedule == "1f1b":
        k_act, k_cot = slots(build("1f1b", pp, micro))
        if remat != "none":
            stage += saved_none
        scanned = stage_moe_layers(m, pp, v) or layers  # the pipelined stack's, a stage
        layer = states.stack_compute / scanned  # one layer's weights, whole
        if scanned > 1:  # the scan's slice of them, its stacked gradients
            tick = layer + states.grads_live - states.grads_unstacked - states.mtp
        else:  # the layer's weights gathered over the ZeRO axes
            tick = layer - states.stack_params
        return ((k_act + k_cot) * stage_in + stage
                + BACKWARD_WORKING_SET["none"] * saved_none, states.grads + tick)
    ticks = v * micro + pp - 1
    per_tick = (stage if remat == "none" else stage_in) + stage_in
    if v > 1:
        per_tick += states.stack_compute / v
    acts = (ticks * per_tick + (stage if remat != "none" else 0.0)
            + BACKWARD_WORKING_SET[remat] * saved_none)
    return acts, states.grads_live + 3 * states.grads_unstacked


def mirrored_moe_activations(cfg: Config, sizes: dict[str, int], micro: int, remat: str,
                             tokens: float, states: StateBytes, saved: Callable,
                             platform: str) -> float:
    """Activations of an MoE model's gpipe or circular stage at its peak, the first
    backward tick at the last MoE layer's experts (`saved(moe, policy)`: one layer's
    saved bytes for one microbatch).

    Autodiff of the scan over the v m + p - 1 forward ticks keeps per tick the stage's
    input and output and, without remat, its MoE layers' activations and experts' rows.
    The first stage embeds and runs the dense layers under `lax.cond`, whose residuals are
    those of its taken branch on every device and tick: the dense layers' activations
    under the model's remat and their weights as the dense stack's scan sliced them (the
    MoE stack's weights are the ticks' loop invariant, taken once). Beside the ticks: the
    local experts' weight slices, the experts' backward buffers, the layer's working set,
    and the dense layers' backward under the cond, their weights' gradients twice (the
    branch's and the cond's) and their working set."""
    m, v = cfg.model, cfg.parallelism.pp_repeats
    n_moe = stage_moe_layers(m, sizes["pp"], v)
    n_dense = stage_layers(m, sizes["pp"], v) - n_moe
    ticks = v * micro + sizes["pp"] - 1
    stage_in = DTYPE_BYTES[m.dtype] * m.d_model * tokens
    e_saved, e_backward = expert_bytes(m, sizes, tokens, platform)
    slices = expert_weight_slices(m, sizes)
    dense_w = states.unpipelined_stack
    per_tick = 2 * stage_in + n_dense * saved(False, remat) + dense_w
    if remat == "none":
        per_tick += n_moe * (saved(True, "none") + e_saved - slices)
    if v > 1:  # each tick slices its stage of the MoE stack
        per_tick += (states.stack_compute - dense_w) / v
    at_experts = e_backward + BACKWARD_WORKING_SET["none"] * saved(True, "none")
    if remat == "none":
        at_experts += n_moe * slices
    else:  # the stage recomputed, its last MoE layer's experts among it
        at_experts += n_moe * saved(True, remat) + e_saved
    dense_backward = (2 * dense_w
                      + n_dense * BACKWARD_WORKING_SET["none"] * saved(False, "none"))
    return ticks * per_tick + at_experts + dense_backward


# -- inference ---------------------------------------------------------------------------------

def kv_bytes_per_token(m: ModelConfig) -> float:
    """KV cache bytes per token over all layers: GQA 2 x layers x kv_heads x head_dim;
    MLA (`model.mla`) caches its latent and one RoPE key per layer."""
    c = DTYPE_BYTES[m.dtype]
    mla = getattr(m, "mla", None)
    if mla is not None:
        return m.n_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * c
    return 2 * m.n_layers * m.n_kv_heads * m.resolved_head_dim * c


def weight_bytes(m: ModelConfig) -> float:
    """Decoding weights: every parameter cast to the compute dtype (`DecodeParams`)."""
    return m.num_params() * DTYPE_BYTES[m.dtype]


@dataclass(frozen=True)
class InferenceMemory:
    weights: float  # per device (split over tp)
    kv_per_token: float  # per device
    free: float  # HBM left for the cache after the weights, at the engine's memory fraction
    context: int

    @property
    def max_tokens(self) -> int:
        return max(0, int(self.free // self.kv_per_token))

    @property
    def max_batch(self) -> int:
        """Sequences of `context` tokens whose cache fits beside the weights."""
        return self.max_tokens // self.context


def inference_memory(cfg: Config, hbm: float, tp: int, context: int) -> InferenceMemory:
    m = cfg.model
    weights = weight_bytes(m) / tp
    mla = getattr(m, "mla", None) is not None  # one latent for all heads: not split
    kv_split = tp if not mla and m.n_kv_heads % tp == 0 else 1
    kv = kv_bytes_per_token(m) / kv_split
    free = hbm * cfg.inference.engine.memory_fraction - weights
    return InferenceMemory(weights, kv, free, context)


def compiled_peak(stats: dict) -> float:
    """Peak bytes per device of a compiled step from `sharding.memory.step_memory`'s figures:
    arguments + temporaries + the outputs that do not reuse a donated argument."""
    return stats["argument"] + stats["temp"] + stats["output"] - stats["alias"]


def describe_vs_compiled(cfg: Config, stats: dict, n_devices: int, platform: str) -> str:
    """The planner's figures beside the compiled step's (the dry run's last lines)."""
    from jaxllm.sharding.mesh import mesh_shape

    mem = train_memory(cfg, mesh_shape(cfg.parallelism, n_devices), platform=platform)
    MB = 1 << 20
    parts = ", ".join(f"{k} {v / MB:.2f}" for k, v in mem.as_dict().items() if k != "total")
    peak = compiled_peak(stats)
    return (f"planner (python -m jaxllm.plan): {mem.total / MB:.2f} MB per device ({parts}); "
            f"compiled peak {peak / MB:.2f} MB (arguments + temporaries + unaliased outputs); "
            f"planned / compiled {mem.total / peak:.3f}")
