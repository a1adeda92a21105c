"""Memory per device: the model states by ZeRO stage and layout, activations by remat
policy, the logits and the loss's temporaries, and for inference the KV cache.

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
    activations  what the backward pass reads, per layer and token (`saved_per_token`):
                 "none" every intermediate, "dots" the matmul outputs, "full" the block's
                 input only; plus the working set of the layer being differentiated
                 (`BACKWARD_WORKING_SET`) and, with cp, the ring's blocks
    logits       f32 [T, V/tp] logits, their exponentials kept for the backward, and the
                 gradient of the logits

The buffers beyond the parameter and activation counts (the gradients' copies, the
working set) are what XLA's buffer assignment holds at the step's peak on the CPU;
`benchmarks/plan_check.py --cpu` sets the sum beside `memory_analysis()` for 23 layouts
and tests/test_plan.py checks three of them to 5%.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from jaxllm.config import Config, ModelConfig
from jaxllm.plan.flops import moe_layers
from jaxllm.sharding.rules import Rules

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# -- model states --------------------------------------------------------------------------

@lru_cache(maxsize=16)
def abstract_params(m: ModelConfig) -> tuple[tuple[tuple[int, ...], str, tuple], ...]:
    """(shape, dtype, logical axes) of every parameter, from the model traced abstractly."""
    import jax
    from flax import nnx

    from jaxllm.model import build_model
    from jaxllm.sharding.plan import logical_axes

    state = nnx.state(nnx.eval_shape(lambda: build_model(m, rngs=nnx.Rngs(0))))
    shapes = jax.tree.leaves(nnx.to_pure_dict(state))
    names = jax.tree.leaves(logical_axes(state), is_leaf=lambda x: isinstance(x, tuple))
    return tuple((tuple(a.shape), str(a.dtype), tuple(n)) for a, n in zip(shapes, names))


def _shard_elems(rules: Rules, shape, names, kind: str) -> float:
    spec = rules.param_spec(names, shape, kind)
    n = 1.0
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        n *= dim / math.prod(rules.size(a) for a in axes)
    return n


def pipeline_layer_fraction(cfg: Config, pp: int) -> float:
    """The share of the layer stack one pipeline stage holds (1 without pp)."""
    L = cfg.model.n_layers
    return math.ceil(L / pp) / L


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float  # in the ZeRO layout (what the optimizer reads)
    grads_live: float  # what the backward pass holds: see `state_bytes`
    grads_unstacked: float  # of the embedding, head and final norm, in the compute layout
    opt_state: float
    stack_compute: float = 0.0  # the layer stack's parameters in the compute layout
    stack_params: float = 0.0  # the layer stack's parameters in their own layout


def state_bytes(cfg: Config, rules: Rules) -> StateBytes:
    """Per-device bytes of each model state under `rules` (mesh sizes and ZeRO stage).

    `grads_live`: the layer stack's gradients are made inside the scanned backward pass
    layer by layer, each summed straight into its ZeRO layout; the embedding, the head and
    the final norm are made whole (their compute layout) and reduce-scattered after.
    """
    params = grads = live = opt = unstacked = stack = stack_params = 0.0
    layers = pipeline_layer_fraction(cfg, rules.size("pp"))
    for shape, dtype, names in abstract_params(cfg.model):
        itemsize = np.dtype(dtype).itemsize * (layers if "layers" in names else 1.0)
        shard = lambda kind: _shard_elems(rules, shape, names, kind) * itemsize
        params += shard("params")
        grads += shard("grads")
        live += shard("grads") if "layers" in names else shard("compute")
        unstacked += 0.0 if "layers" in names else shard("compute")
        stack += shard("compute") if "layers" in names else 0.0
        stack_params += shard("params") if "layers" in names else 0.0
        opt += 2 * shard("opt_state")
    return StateBytes(params, grads, live, unstacked, opt, stack, stack_params)


# -- activations -----------------------------------------------------------------------------

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


def _heads_split(n_heads: int, n_kv: int, tp: int) -> tuple[float, float]:
    """(query heads, key/value heads) per device: kv heads repeated when tp does not divide them."""
    hq = n_heads / tp if n_heads % tp == 0 else n_heads
    hkv = n_kv / tp if n_kv % tp == 0 else hq
    return hq, hkv


def attention_saved_per_token(m: ModelConfig, hq: float, hkv: float, kv_len: int,
                              impl: str) -> float:
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
    mla = getattr(m, "mla", None)
    if mla is None:
        hd = m.resolved_head_dim
        qkv = (hq + 2 * hkv) * hd
        # "none": k and v broadcast to the query heads and the attention output beside
        # q, k, v; "dots": the attention output and the output projection's input and output
        return qkv + (2 if remat == "none" else 3) * hq * hd
    # MLA: the query and key-value latents (whole over tp), per head q and k of
    # nope + rope dims, v and the attention output of v_head_dim
    dqk, dv = mla.qk_head_dim, mla.v_head_dim
    q_lora, kv_lora = mla.q_lora_rank or 0, mla.kv_lora_rank
    if remat == "none":  # each latent, normed and scaled (its RMSNorm); q, k, v, output
        return 3 * q_lora + 3 * kv_lora + 2 * hq * dqk + 2 * hq * dv
    # "dots": q_a, q_b, kv_a (latent and rotary key), kv_b, the attention output, o's input
    return (q_lora + hq * dqk + kv_lora + mla.qk_rope_head_dim
            + hq * (mla.qk_nope_head_dim + dv) + 2 * hq * dv)


def saved_per_token(m: ModelConfig, sizes: dict[str, int], kv_len: int, impl: str,
                    remat: str, sequence_parallel: bool = False, moe: bool = False) -> float:
    """Bytes per token and layer the backward pass reads under a remat policy (`moe`: of
    an MoE layer, whose dense SwiGLU is its shared experts; the routed experts' rows are
    `expert_bytes`')."""
    c = DTYPE_BYTES[m.dtype]
    tp = sizes["tp"]
    d = m.d_model / (tp if sequence_parallel else 1)  # the residual stream
    hq, hkv = _heads_split(m.n_heads, m.n_kv_heads, tp)
    f = (m.moe.num_shared_experts * m.moe.expert_mlp_dim if moe else m.mlp_dim) / tp
    if remat == "full":
        return c * d  # the block's input
    attn = attention_projections(m, hq, hkv, remat)
    if remat == "dots":  # matmul outputs: attention's (above), gate, up, down
        return c * (attn + d + 2 * f)
    # every intermediate: norm inputs, outputs and statistics (the matmuls' inputs are
    # whole over tp even with sequence parallelism), the attention's (above), the
    # SwiGLU's gate, up and their products
    whole = 2 * m.d_model if sequence_parallel else 4 * m.d_model
    split = 6 * m.d_model / tp - whole / tp if sequence_parallel else 2 * d
    stats = 4 * 4 * (2 if getattr(m, "mla", None) is not None and m.mla.q_lora_rank else
                     1.5 if getattr(m, "mla", None) is not None else 1)  # latents' norms too
    router = 4 * (2 * m.moe.num_experts + m.moe.top_k * m.d_model) if moe else 0.0
    return (c * (whole + split + attn + 6 * f) + stats + router
            + attention_saved_per_token(m, hq, hkv, kv_len, impl))


def expert_bytes(m: ModelConfig, sizes: dict[str, int], tokens: float,
                 platform: str) -> tuple[float, float]:
    """(saved, backward) bytes of one MoE layer's routed experts on one device.

    Dropless (`sharding/experts.py`): the local experts take R = ep x tokens x top_k rows
    (with ep > 1 the receive buffer holds every assignment the group could send). Saved
    for the backward: the rows sorted by expert and six [R, f] products (gate, up, the
    sigmoid, the SwiGLU, its product and the product masked to its expert), with ep > 1
    the dispatch's mask, and with several local experts their weights as the layer
    sliced them. While the backward runs the layer: the zeroed buffers of the gathers'
    transposes (one of R rows, one of the assignments) and the grouped matmuls'
    cotangents. On the CPU the grouped matmul is XLA's ragged dot, which expands its
    ragged operand per local expert into [G, R, K]: three such copies and a relayout of
    [R, d] at once (a kernel elsewhere reads the rows in place: G counts as 1)."""
    c, moe, d = DTYPE_BYTES[m.dtype], m.moe, m.d_model
    p = DTYPE_BYTES[m.param_dtype]
    ep, tp = sizes["ep"], sizes["tp"]
    f = moe.expert_mlp_dim / tp if moe.expert_mlp_dim % tp == 0 else moe.expert_mlp_dim
    assigned = tokens * moe.top_k
    rows = ep * assigned
    local = moe.num_experts / ep
    g = local if platform == "cpu" else 1
    saved = c * rows * (d + 6 * f) + (rows * d if ep > 1 else 0.0)
    if local > 1:
        saved += 3 * local * d * f * p
    backward = c * d * (rows + assigned) + c * g * rows * (4 * d + f)
    return saved, backward


# One layer's working set while the backward pass differentiates it, in units of its full
# intermediates: its cotangents ("none"), plus its recomputed intermediates ("full"), or
# only the non-matmul ones ("dots"). The figures are what XLA's buffer assignment holds at
# the step's peak (tests/test_plan.py checks them against the compiler).
BACKWARD_WORKING_SET = {"none": 0.59, "dots": 0.40, "full": 0.88}


def ring_saved_per_token(m: ModelConfig, sizes: dict[str, int]) -> float:
    """Context parallelism: each of the cp ring steps keeps the key/value block it received
    and its partial output and log-sum-exp, per local token and layer."""
    c, cp = DTYPE_BYTES[m.dtype], sizes["cp"]
    hq, hkv = _heads_split(m.n_heads, m.n_kv_heads, sizes["tp"])
    hd = m.resolved_head_dim
    return cp * (c * (2 * hkv * hd + hq * hd) + 4 * hq)


def mlp_width(m: ModelConfig) -> int:
    """The per-token feed-forward width the activations see (MoE: top_k experts + shared)."""
    moe = getattr(m, "moe", None)
    if moe is None:
        return m.mlp_dim
    return (moe.top_k + getattr(moe, "num_shared_experts", 0)) * moe.expert_mlp_dim


def resolved_attention_impl(m: ModelConfig, platform: str) -> str:
    """The attention the trainer runs: on the CPU "auto" is the reference; on a GPU a
    fused kernel."""
    if m.attention_impl != "auto":
        return m.attention_impl
    return "reference" if platform == "cpu" else "cudnn"


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
    microbatches, default `microbatches(cfg)`)."""
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
    sp = p.sequence_parallel
    layers = math.ceil(m.n_layers / sizes["pp"])
    n_moe = moe_layers(m)
    saved = lambda moe, policy=remat: tokens * saved_per_token(m, sizes, kv_len, impl,
                                                              policy, sp, moe)
    acts = (layers - n_moe) * saved(False) + (n_moe and n_moe * saved(True))
    # the layer being differentiated: its cotangents, and under remat its recomputed
    # intermediates, in units of one layer's full set
    working = BACKWARD_WORKING_SET[remat] * saved(False, "none")
    grads = states.grads_live + 3 * states.grads_unstacked
    moe_peak = 0.0
    if sizes["pp"] > 1:
        acts, grads = pipeline_activations(cfg, sizes["pp"], micro, remat, saved(False),
                                           saved(False, "none"), tokens, states)
    else:
        acts += working
    if n_moe:  # an MoE layer's experts: their rows saved, and the backward's buffers
        e_saved, e_backward = expert_bytes(m, sizes, tokens, platform)
        if remat != "full":
            acts += n_moe * e_saved
        moe_peak = ((layers - n_moe) * saved(False) + n_moe * saved(True)
                    + (n_moe if remat != "full" else 1) * e_saved + e_backward)
    if sizes["cp"] > 1:  # the ring's key/value blocks and partial outputs of every step
        acts += layers * tokens * ring_saved_per_token(m, sizes)
    vocab = m.vocab_size / (sizes["tp"] if m.vocab_size % sizes["tp"] == 0 else 1)
    logits = 3 * 4 * tokens * vocab
    batch_bytes = 2 * 4 * rows * seq * micro
    if moe_peak + states.grads_live > acts + logits + grads:
        acts, logits, grads = moe_peak, 0.0, states.grads_live
    return TrainMemory(states.params, states.opt_state, grads, acts, logits,
                       batch_bytes)


def pipeline_activations(cfg: Config, pp: int, micro: int, remat: str, saved: float,
                         saved_none: float, tokens: float, states: StateBytes
                         ) -> tuple[float, float]:
    """(activations, gradients) of a pipeline stage (`sharding/pipeline.py`) beyond the
    layer being differentiated; `saved` / `saved_none`: one layer's saved bytes for one
    microbatch under the remat policy / without remat.

    gpipe, circular: autodiff of the scan over the v m + p - 1 forward ticks (bubble
    ticks included) keeps every tick's residuals: the stage's saved activations (its
    input alone under remat, which recomputes the stage in the backward) and the head's
    input; with v > 1 stages per device also the stage's weights as the tick sliced them.
    1f1b: each backward tick recomputes its stage from the saved input (`jax.vjp`), so a
    device keeps the input and cotangent slots of the schedule and one stage's
    activations; its gradients are the accumulators carried through the ticks."""
    from jaxllm.sharding.pipeline import schedule_of
    from jaxllm.sharding.pipeline_schedule import slots

    m, p = cfg.model, cfg.parallelism
    v = p.pp_repeats
    stage_layers = m.n_layers / (pp * v)
    stage_in = DTYPE_BYTES[m.dtype] * m.d_model * tokens  # [rows, seq, d] of one microbatch
    stage = stage_layers * saved
    if p.pp_schedule == "1f1b":
        # a backward tick runs its stage's forward and backward at once: remat saves it
        # nothing but the recomputed layer's set beside the layer inputs
        k_act, k_cot = slots(schedule_of(cfg))
        stage = stage_layers * saved + (saved_none if remat != "none" else 0.0)
        gathered = (states.stack_compute - states.stack_params) / stage_layers
        working = BACKWARD_WORKING_SET["none"] * saved_none
        return ((k_act + k_cot) * stage_in + stage + working,
                states.grads + gathered)
    ticks = v * micro + pp - 1
    per_tick = (stage if remat == "none" else stage_in) + stage_in
    if v > 1:
        per_tick += states.stack_compute / v
    acts = (ticks * per_tick + (stage if remat != "none" else 0.0)
            + BACKWARD_WORKING_SET[remat] * saved_none)
    return acts, states.grads_live + 3 * states.grads_unstacked


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
