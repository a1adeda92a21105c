"""Per-kernel times: a step is the sum of the kernels it launches, each at its own ceiling,
plus a fixed cost per launch.

    t(step)   = sum over kernels of  launches x (kernel_s + max(FLOPs / rate, bytes / hbm_bw))

    rate      matmuls: the measured rate of that [m, k] x [k, n] shape where the ceilings
              have one (`Hardware.matmul_shapes`), else `flops`; flash attention: `attn_fwd`
              and `attn_bwd`; the experts' grouped matmul: `gmm_flops` (each else `flops`)
    bytes     what the kernel reads and writes in HBM; every elementwise, reduction, copy
              and gather kernel has FLOPs 0, so it takes its bytes at the HBM rate

The roofline (`roofline.py`) takes a whole step at the best of either ceiling; here the
memory-bound kernels add to the matmuls' time, and each launch costs `kernel_s`. The
kernels are counted by hand from the code that runs, a layer at a time (the notation:
T tokens, d model width, c / p bytes of the compute / parameter dtype, X = T d c):

Training (`train/trainer.py`: the model's forward through `lax.scan` over the stacked
layers, its backward, Adam):

    matmul      each projection one kernel forward (2 m k n FLOPs); backward two, the input's
                gradient [m, n] x [n, k] and the weight's [k, m] x [m, n]
    weights     the scan slices each f32 weight and casts it to the compute dtype before
                its matmul: read p + write c per element, forward and again backward
                (remat none: the forward's cast is kept, and copied out of the stack
                before the backward's matmul; dots / full: cast again); each weight's
                gradient cast to f32 and stored in the stacked gradient, read c + write p
    norm        RMSNorm forward: a row reduction (read X) and the normalisation (read X,
                write X); backward: a row reduction, the input's gradient (which also adds
                the residual stream's gradient) and the scale's column reduction, each
                reading x and the cotangents of its f consumers: 3 (1 + f) X + 2 X
    elementwise RoPE, SwiGLU, residual adds, concatenates and slices, each one kernel
                reading its inputs and writing its output; backward: its inputs and the
                output's cotangent read, the inputs' cotangents written (RoPE, linear: the
                cotangent alone; a residual add none, its cotangent flows on)
    attention   the flash kernel: 2 Hq S^2 (Dqk + Dv) B FLOPs (causal: halved) at
                `attn_fwd`, its backward 2.5x that at `attn_bwd`; the Triton kernel runs
                head dims padded to powers of two (MLA's 192 as 256: those FLOPs, and
                the pads of q and k, copies, forward and backward)
    stack       the scan keeps what the backward reads (remat none: every intermediate;
                "dots": the matmul outputs; "full": the block input) in stacked [L, ...]
                buffers, the bytes of `activations.saved_per_token` (and an MoE layer's
                `expert_bytes`), each copied in by its own kernel (read + write); the
                backward's fusions read the stack in place, but a tensor a library call
                (cuBLAS, cuDNN, Pallas) reads is first copied out (read + write)
    remat       "dots": every kernel but the matmuls runs again in the backward (attention
                included); "full": the whole block forward again
    MoE         the router matmul (f32 scores) and about ten [T, E] kernels of routing, the
                assignments' two sorts and the counts, the dispatch gather [T k, d], three
                grouped matmuls and the SwiGLU over T k rows, the gather back and the
                weighted sum; the routing statistics; the shared experts as a dense MLP;
                the backward of each (gathers, grouped matmuls for both operands)
    MLA         q_a, its norm, q_b, the rotary part of q and k, kv_a, the latent's norm,
                kv_b, the concatenated k and the sliced v, attention at Dqk / Dv, o
    outside     the embedding gather (f32 rows read) and its gradient's zeroing and
                scatter-add; the final norm; the head's matmul with f32 logits [T, V];
                the loss (a max pass and a sum-exp pass over the logits, and their
                gradient in the compute dtype); the optimizer: per parameter the clip's
                norm reads g, Adam reads g, m, v, w and writes m, v, w (8 p bytes), two
                kernels per parameter array

Prefill and decode (`inference/step.py`: a Python loop over per-layer weights, already in
the compute dtype, so no casts and no stacking): per dense layer the norm, one q/k/v
matmul, RoPE of q and k, the cache writes of k and v, attention (prefill: the flash kernel
over the prompt, after the v slice is made contiguous; decode: the decode kernel reading
the live K/V), o, the residual, the norm, gate/up, SwiGLU, down, the residual; prefill's
head runs over every prompt position (f32 logits). A step of one row over a contiguous
cache (`params.fused_rows`) runs each layer in five fused kernels (q/k/v with norm, RoPE
and cache write; attention; o with the residual; norm with gate/up and SwiGLU; down with
the residual), each reading its weights. MLA decoding runs the absorbed form over the
whole cache buffer (`LatentCache.attend`: scores, mask, softmax, the latent's value part
sliced out, the values), MoE decoding the routed experts of `expert_ffn` with the grouped
matmul reading the experts the batch's tokens choose. Each step adds the embedding, the
final norm, the head, the sampling and the decode loop's own bookkeeping (DECODE_STEP_KERNELS).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from jaxllm.config import Config, ModelConfig
from jaxllm.plan.activations import DTYPE_BYTES, resolved_attention_impl
from jaxllm.plan.hardware import Hardware

# Kernels a decode step launches outside the layers: the token's embedding gather, the
# final norm (2), the head, the sample (an argmax or the sampler), the emitted / done /
# position updates and the loop's counter and condition.
DECODE_STEP_KERNELS = 8
ROUTING_KERNELS = 10  # sigmoid / softmax, group top-2, group top-k, mask, top-k, weights...
SORT_KERNELS = 3  # one sort of a few hundred thousand keys (a radix sort's passes)


@dataclass(frozen=True)
class Kernel:
    """`launches` launches of one kernel, each of `flops` FLOPs and `bytes` HBM bytes."""
    what: str  # the category a profile would give it
    launches: float = 1.0
    flops: float = 0.0
    bytes: float = 0.0
    rate: str = "hbm"  # "matmul", "attn_fwd", "attn_bwd", "gmm" or "hbm" (no FLOPs)
    shape: tuple[int, int, int] | None = None  # a matmul's (m, k, n)

    def flop_rate(self, hw: Hardware) -> float:
        if self.rate == "matmul" and self.shape is not None:
            return hw.matmul_rate(*self.shape)
        return {"attn_fwd": hw.attn_fwd, "attn_bwd": hw.attn_bwd,
                "gmm": hw.gmm_flops}.get(self.rate) or hw.flops

    def seconds(self, hw: Hardware) -> float:
        busy = max(self.flops / self.flop_rate(hw) if self.flops else 0.0,
                   self.bytes / hw.hbm_bw)
        return self.launches * (hw.kernel_s + busy)


@dataclass(frozen=True)
class KernelTime:
    """The kernels of one workload (a train step, a prefill, a decode step) on one device."""
    name: str
    kernels: tuple[Kernel, ...]

    def seconds(self, hw: Hardware) -> float:
        return sum(k.seconds(hw) for k in self.kernels)

    @property
    def launches(self) -> float:
        return sum(k.launches for k in self.kernels)

    @property
    def flops(self) -> float:
        return sum(k.launches * k.flops for k in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.launches * k.bytes for k in self.kernels)

    def by_category(self, hw: Hardware) -> dict[str, tuple[float, float]]:
        """category -> (seconds, launches), the largest first."""
        out: dict[str, list[float]] = {}
        for k in self.kernels:
            s = out.setdefault(k.what, [0.0, 0.0])
            s[0] += k.seconds(hw)
            s[1] += k.launches
        return dict(sorted(((w, (s, n)) for w, (s, n) in out.items()), key=lambda kv: -kv[1][0]))


# -- training: one layer as ops, their forward, backward, stacking and recompute ------------

@dataclass(frozen=True)
class Op:
    """One step of a layer's forward pass. `out`: bytes of its output; `keep`: the remat
    policies under which the scan keeps that output for the backward; `lib_reads`: the
    ops whose outputs its backward hands to a library call ("self": its own)."""
    name: str
    kind: str  # "matmul", "gmm", "attention", "elementwise", "norm"
    out: float
    keep: tuple[str, ...] = ()
    lib_reads: tuple[str, ...] = ()
    mkn: tuple[int, int, int] = (0, 0, 0)  # matmul / gmm: [m, k] x [k, n]
    groups: int = 1  # gmm: experts (the weight is [groups, k, n])
    weight_rows: float = 0.0  # gmm: rows of the weight it reads, k n x this (default groups)
    read: float = 0.0  # elementwise / norm: bytes read
    launches: int = 1
    bwd: tuple[float, int] | None = (None, 0)  # elementwise: (bytes, launches); None: no backward
    flops: float = 0.0  # attention forward
    fan: int = 1  # norm: the matmuls reading its output
    what: str = "elementwise"

    @property
    def library(self) -> bool:
        return self.kind in ("matmul", "gmm", "attention")


def _matmul_kernels(op: Op, c: float) -> list[Kernel]:
    m, k, n = op.mkn
    return [Kernel("matmul", 1, 2 * m * k * n, c * (m * k + k * n) + op.out, "matmul", (m, k, n))]


def _forward(op: Op, c: float, p: float, casts: bool = True) -> list[Kernel]:
    m, k, n = op.mkn
    if op.kind == "matmul":
        cast = [Kernel("weights", 1, bytes=(p + c) * k * n)] if casts else []
        return cast + _matmul_kernels(op, c)
    if op.kind == "gmm":
        w = k * n * (op.weight_rows or op.groups)
        cast = [Kernel("weights", 1, bytes=(p + c) * k * n * op.groups)] if casts else []
        return cast + [Kernel("grouped matmul", 1, 2 * m * k * n, c * (m * k + w) + op.out,
                              "gmm")]
    if op.kind == "attention":
        return [Kernel("attention", 1, op.flops, op.read + op.out, "attn_fwd")]
    if op.kind == "norm":
        return [Kernel("norm", 1, bytes=op.read), Kernel("norm", 1, bytes=op.read + op.out)]
    return [Kernel(op.what, op.launches, bytes=(op.read + op.out) / op.launches)]


def _backward(op: Op, c: float, p: float, remat: str) -> list[Kernel]:
    m, k, n = op.mkn
    if op.kind in ("matmul", "gmm"):
        g = op.groups if op.kind == "gmm" else 1
        w = k * n * g
        rate, what = ("matmul", "matmul") if op.kind == "matmul" else ("gmm", "grouped matmul")
        out = [Kernel(what, 1, 2 * m * k * n, c * (m * n + w + m * k), rate,
                      (m, n, k) if op.kind == "matmul" else None),  # the input's gradient
               Kernel(what, 1, 2 * m * k * n, c * (m * k + m * n + w), rate,
                      (k, m, n) if op.kind == "matmul" else None),  # the weight's
               Kernel("weight grads", 1, bytes=(c + p) * w)]
        if remat == "none":  # the forward's cast, copied out of the stack for cuBLAS
            out.append(Kernel("copy", 1, bytes=2 * c * w))
        return out
    if op.kind == "attention":
        return [Kernel("attention", 1, 2.5 * op.flops, 2 * (op.read + op.out), "attn_bwd")]
    if op.kind == "norm":
        x, dy = op.read, op.fan * op.out
        return [Kernel("norm", 1, bytes=x + dy), Kernel("norm", 1, bytes=3 * x + dy),
                Kernel("norm", 1, bytes=x + dy)]
    if op.bwd is None:
        return []
    b, launches = op.bwd
    if b is None:  # inputs and the output's cotangent read, the inputs' cotangents written
        b = 2 * op.read + op.out
    return [Kernel(op.what, launches or op.launches, bytes=b / (launches or op.launches))]


def layer_train_kernels(ops: list[Op], c: float, p: float, remat: str,
                        saved: float) -> list[Kernel]:
    """One layer's kernels in a training step: forward, the stacking of its `saved` bytes
    (what the backward reads, `activations.py`), backward and the remat policy's
    recompute."""
    by_name = {o.name: o for o in ops}
    out = []
    for op in ops:
        out += _forward(op, c, p)
    kept = max(1, sum(remat in op.keep for op in ops))  # the scan's stacking: a copy each
    out.append(Kernel("stack", kept, bytes=2 * saved / kept))
    copied = set()
    for op in reversed(ops):
        out += _backward(op, c, p, remat)
        for name in op.lib_reads:
            src = op if name == "self" else by_name[name]
            if remat in src.keep and src.name not in copied:  # copied out for the library
                copied.add(src.name)
                out.append(Kernel("copy", 1, bytes=2 * src.out))
    if remat == "full":
        out += [k for op in ops for k in _forward(op, c, p)]
    elif remat == "dots":
        for op in ops:
            if op.kind == "matmul":  # the weight's cast runs again, the matmul does not
                out.append(_forward(op, c, p)[0])
            else:
                out += _forward(op, c, p)
    return out


def _heads(m: ModelConfig, tp: int) -> tuple[int, int, int]:
    """(query heads, kv heads, mlp width) per device."""
    hq = m.n_heads // tp if m.n_heads % tp == 0 else m.n_heads
    hkv = m.n_kv_heads // tp if m.n_kv_heads % tp == 0 else hq
    f = m.mlp_dim // tp if m.mlp_dim % tp == 0 else m.mlp_dim
    return hq, hkv, f


def _mlp_ops(T: int, d: int, f: int, c: float, prefix: str = "") -> list[Op]:
    """SwiGLU after a norm `prefix + norm2`: gate, up, silu(gate) * up, down, residual."""
    n = prefix + "norm2"
    X, Fm = T * d * c, T * f * c
    return [Op(prefix + "gate", "matmul", Fm, ("none", "dots"), (n,), (T, d, f)),
            Op(prefix + "up", "matmul", Fm, ("none", "dots"), (n,), (T, d, f)),
            Op(prefix + "swiglu", "elementwise", Fm, ("none",), read=2 * Fm),
            Op(prefix + "down", "matmul", X, (), (prefix + "swiglu",), (T, f, d)),
            Op(prefix + "residual2", "elementwise", X, ("none",), read=2 * X, bwd=None)]


def flash_impl(m: ModelConfig) -> str:
    """The flash kernel the model runs on a GPU: model.attention_impl, and for "auto" the
    Triton kernel where query-key and value dims differ (MLA: cuDNN and the Mosaic
    kernel take equal dims), else cuDNN (`kernels/registry.py`)."""
    dqk, dv = attention_head_dims(m)
    if m.attention_impl != "auto":
        return m.attention_impl
    return "pallas_triton" if dqk != dv else resolved_attention_impl(m, "gpu")


def attention_head_dims(m: ModelConfig, padded: bool = False) -> tuple[int, int]:
    """(query-key, value) dims per head; `padded`: as the Triton flash kernel runs them,
    each raised to a power of two (MLA's 192 to 256)."""
    dqk, dv = ((m.mla.qk_head_dim, m.mla.v_head_dim) if m.mla is not None
               else (m.resolved_head_dim, m.resolved_head_dim))
    if padded and flash_impl(m) == "pallas_triton":
        return 1 << (dqk - 1).bit_length(), 1 << (dv - 1).bit_length()
    return dqk, dv


def attention_flops_fwd(m: ModelConfig, batch: int, sq: int, skv: int, hq: int,
                        causal: bool = True) -> float:
    """Forward FLOPs of the flash kernel: 2 B Hq Sq Skv (Dqk + Dv), halved when causal, at
    the head dims the kernel runs (the Triton kernel's padded ones)."""
    dqk, dv = attention_head_dims(m, padded=True)
    if m.sliding_window is not None:
        skv = min(skv, m.sliding_window)
    f = 2 * batch * hq * sq * skv * (dqk + dv)
    return f / 2 if causal and sq == skv else f


def train_layer_ops(m: ModelConfig, rows: int, seq: int, tp: int = 1,
                    moe: bool = False) -> list[Op]:
    """The forward of one block (`model/block.py`) over rows x seq tokens on one device."""
    c = DTYPE_BYTES[m.dtype]
    T, d = rows * seq, m.d_model
    hq, hkv, f = _heads(m, tp)
    X = T * d * c
    att = attention_flops_fwd(m, rows, seq, seq, hq)
    ops = [Op("norm1", "norm", X, ("none",), read=X, fan=3 if m.mla is None else 2)]
    if m.mla is None:
        hd = m.resolved_head_dim
        Q, K = T * hq * hd * c, T * hkv * hd * c
        ops += [Op("q", "matmul", Q, ("dots",), ("norm1",), (T, d, hq * hd)),
                Op("k", "matmul", K, ("dots",), ("norm1",), (T, d, hkv * hd)),
                Op("v", "matmul", K, ("none", "dots"), ("norm1",), (T, d, hkv * hd)),
                Op("rope_q", "elementwise", Q, ("none",), read=Q, bwd=(2 * Q, 1), what="rope"),
                Op("rope_k", "elementwise", K, ("none",), read=K, bwd=(2 * K, 1), what="rope"),
                Op("attention", "attention", Q, ("none",), ("rope_q", "rope_k", "v", "self"),
                   read=Q + 2 * K, flops=att)]
        o_in = hq * hd
    else:
        a = m.mla
        nope, rope, dv, r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        Q, Kd, Vd = T * hq * a.qk_head_dim * c, T * hq * a.qk_head_dim * c, T * hq * dv * c
        KV = T * hq * (nope + dv) * c
        q_src = "norm1"
        if a.q_lora_rank:
            ql = T * a.q_lora_rank * c
            ops += [Op("q_a", "matmul", ql, (), ("norm1",), (T, d, a.q_lora_rank)),
                    Op("q_a_norm", "norm", ql, ("none",), read=ql)]
            q_src = "q_a_norm"
        q_in = a.q_lora_rank or d
        lat = T * (r + rope) * c
        ops += [Op("q_b", "matmul", Q, ("dots",), (q_src,), (T, q_in, hq * a.qk_head_dim)),
                Op("rope_q", "elementwise", Q, ("none",), read=Q, bwd=(2 * Q, 1), what="rope"),
                Op("kv_a", "matmul", lat, ("dots",), ("norm1",), (T, d, r + rope)),
                Op("kv_norm", "norm", T * r * c, ("none",), read=T * r * c),
                Op("rope_k", "elementwise", T * rope * c, ("none",), read=T * rope * c,
                   bwd=(2 * T * rope * c, 1), what="rope"),
                Op("kv_b", "matmul", KV, ("dots",), ("kv_norm",), (T, r, hq * (nope + dv))),
                Op("k_concat", "elementwise", Kd, ("none",), read=T * hq * nope * c
                   + T * rope * c, bwd=(2 * Kd, 2)),  # the nope part, the broadcast key
                Op("v_slice", "elementwise", Vd, ("none",), read=Vd, bwd=(2 * Vd, 1))]
        dqk_p = attention_head_dims(m, padded=True)[0]
        if dqk_p != a.qk_head_dim:  # the Triton kernel pads q and k (and slices dq, dk)
            Qp = Q * dqk_p / a.qk_head_dim
            ops.append(Op("attn_pad", "elementwise", 2 * Qp, read=2 * Q, launches=2,
                          bwd=(4 * (Q + Qp), 4), what="copy"))
        ops.append(Op("attention", "attention", Vd, ("none",),
                      ("rope_q", "k_concat", "v_slice", "self"), read=Q + Kd + Vd, flops=att))
        o_in = hq * dv
    ops += [Op("o", "matmul", X, (), ("attention",), (T, o_in, d)),
            Op("residual1", "elementwise", X, ("none",), read=2 * X, bwd=None),
            Op("norm2", "norm", X, ("none",), read=X,  # read by gate and up; the router,
               fan=2 if not moe else 2 + 2 * bool(m.moe.num_shared_experts))]  # the dispatch
    if not moe:
        return ops + _mlp_ops(T, d, f, c)
    e = m.moe
    k, fe = e.top_k, e.expert_mlp_dim // tp if e.expert_mlp_dim % tp == 0 else e.expert_mlp_dim
    R = T * k  # assignments
    RD, RF, TE = R * d * c, R * fe * c, T * e.num_experts * 4
    ops += [Op("router", "matmul", TE, ("none", "dots"), ("norm2",), (T, d, e.num_experts)),
            Op("route", "elementwise", TE, ("none",), read=ROUTING_KERNELS * TE,
               launches=ROUTING_KERNELS, bwd=(4 * TE, 3)),
            Op("stats", "elementwise", 0.0, read=3 * TE, launches=5, bwd=None),
            Op("sort", "elementwise", 2 * R * 4 * SORT_KERNELS, read=2 * R * 4 * SORT_KERNELS,
               launches=2 * SORT_KERNELS + 2, bwd=None),  # order, inverse, counts
            Op("dispatch", "elementwise", RD, ("none",), read=RD, bwd=(2 * RD + X, 2)),
            Op("e_gate", "gmm", RF, ("none",), ("dispatch",), (R, d, fe), e.num_experts),
            Op("e_up", "gmm", RF, ("none",), ("dispatch",), (R, d, fe), e.num_experts),
            Op("e_swiglu", "elementwise", RF, ("none",), read=2 * RF),
            Op("e_down", "gmm", RD, ("none",), ("e_swiglu",), (R, fe, d), e.num_experts),
            Op("combine", "elementwise", X, ("none",), read=2 * RD, launches=2,
               bwd=(4 * RD + 2 * X, 3))]  # the gather back, the weighted sum in f32
    if e.num_shared_experts:
        fs = e.num_shared_experts * fe
        ops += _mlp_ops(T, d, fs, c)[:-1]
        ops.append(Op("shared_add", "elementwise", X, ("none",), read=2 * X, bwd=None))
    ops.append(Op("residual2", "elementwise", X, ("none",), read=2 * X, bwd=None))
    return ops


def train_kernels(cfg: Config, rows: int, seq: int, sizes: dict[str, int] | None = None,
                  layers: int | None = None, param_count: int | None = None,
                  param_arrays: int | None = None) -> KernelTime:
    """The kernels of a training step of rows x seq tokens per device of a mesh of
    `sizes` (default one device; `layers`: of this device's stage; `param_count` /
    `param_arrays`: the parameters the optimizer updates)."""
    from jaxllm.plan.activations import expert_bytes, saved_per_token

    m = cfg.model
    sizes = sizes or {"pp": 1, "dp": 1, "fsdp": 1, "ep": 1, "cp": 1, "tp": 1}
    tp = sizes["tp"]
    c, p = DTYPE_BYTES[m.dtype], DTYPE_BYTES[m.param_dtype]
    remat = m.remat
    L = m.n_layers if layers is None else layers
    n_moe = 0 if m.moe is None else min(L, m.n_layers - m.moe.dense_layers)
    T, d = rows * seq, m.d_model
    V = m.vocab_size // tp if m.vocab_size % tp == 0 else m.vocab_size
    X = T * d * c
    ks: list[Kernel] = []
    impl = flash_impl(m)
    for moe, count in ((False, L - n_moe), (True, n_moe)):
        if count:
            saved = T * saved_per_token(m, sizes, seq, impl, remat,
                                        cfg.parallelism.sequence_parallel, moe)
            if moe and remat != "full":
                saved += expert_bytes(m, sizes, T, "gpu")[0]
            one = layer_train_kernels(train_layer_ops(m, rows, seq, tp, moe), c, p, remat,
                                      saved)
            ks += [Kernel(k.what, k.launches * count, k.flops, k.bytes, k.rate, k.shape)
                   for k in one]
    logits = T * V * 4
    head = Op("head", "matmul", logits, (), (), (T, d, V))
    ks += [Kernel("embedding", 1, bytes=T * d * (p + c)),  # gather f32 rows, cast
           Kernel("embedding", 1, bytes=m.vocab_size * d * p),  # its gradient zeroed
           Kernel("embedding", 1, bytes=T * d * (c + 2 * p)),  # and scatter-added
           *_forward(Op("final_norm", "norm", X, read=X), c, p),
           *_backward(Op("final_norm", "norm", X, read=X), c, p, "full"),
           *_forward(head, c, p), *_backward(head, c, p, "full"),
           Kernel("loss", 2, bytes=logits),  # the max pass, the sum-exp and target pass
           Kernel("loss", 1, bytes=logits + T * V * c)]  # softmax - one-hot, compute dtype
    n_params = m.num_params() if param_count is None else param_count
    arrays = (9 + 2 * bool(m.moe)) + 3 if param_arrays is None else param_arrays
    ks += [Kernel("optimizer", 2 * arrays, bytes=8 * p * n_params / (2 * arrays))]
    return KernelTime("train", tuple(ks))


# -- the decode program: prefill and decode steps ---------------------------------------------

def _gemm(m_rows: int, k: int, n: int, c: float, what: str = "matmul",
          out_bytes: float | None = None) -> Kernel:
    out = m_rows * n * c if out_bytes is None else out_bytes
    return Kernel(what, 1, 2 * m_rows * k * n, c * (m_rows * k + k * n) + out, "matmul",
                  (m_rows, k, n))


def _ew(what: str, nbytes: float, launches: int = 1) -> Kernel:
    return Kernel(what, launches, bytes=nbytes / launches)


def _norm(rows: int, dim: int, c: float) -> list[Kernel]:
    x = rows * dim * c
    return [Kernel("norm", 1, bytes=x), Kernel("norm", 1, bytes=2 * x)]


def touched_experts(m: ModelConfig, tokens: int) -> float:
    """Experts of one MoE layer that `tokens` tokens choose, on average (uniform routing)."""
    e, k = m.moe.num_experts, m.moe.top_k
    return e * (1 - (1 - k / e) ** tokens)


def _ffn_kernels(m: ModelConfig, T: int, c: float, tp: int, moe: bool) -> list[Kernel]:
    d = m.d_model
    X = T * d * c
    hq, hkv, f = _heads(m, tp)
    ks = _norm(T, d, c)
    if moe:
        e = m.moe
        fe, R = e.expert_mlp_dim, T * e.top_k
        TE = T * e.num_experts * 4
        g = touched_experts(m, T)
        w = g * d * fe  # the chosen experts' weights of one projection
        ks += [_gemm(T, d, e.num_experts, c, out_bytes=TE),
               _ew("routing", ROUTING_KERNELS * 2 * TE, ROUTING_KERNELS),
               _ew("sort", 2 * SORT_KERNELS * 2 * R * 4 + 2 * R * 4, 2 * SORT_KERNELS + 2),
               _ew("dispatch", 2 * R * d * c),
               Kernel("grouped matmul", 2, 2 * R * d * fe, c * (R * d + w + R * fe), "gmm"),
               _ew("elementwise", 3 * R * fe * c),
               Kernel("grouped matmul", 1, 2 * R * d * fe, c * (R * fe + w + R * d), "gmm"),
               _ew("dispatch", 2 * R * d * c + R * d * c + X, 2)]  # gather back, weighted sum
        f = e.num_shared_experts * fe
        if f:
            ks.append(_ew("elementwise", 3 * X))  # + the shared experts' output
    if f:
        ks += [_gemm(T, d, 2 * f, c), _ew("elementwise", 3 * T * f * c), _gemm(T, f, d, c)]
    return ks + [_ew("elementwise", 3 * X)]  # the residual


def _gqa_layer(m: ModelConfig, B: int, S: int, ctx: int, c: float, tp: int, prefill: bool,
               fused: bool, moe: bool) -> list[Kernel]:
    d, hd = m.d_model, m.resolved_head_dim
    hq, hkv, f = _heads(m, tp)
    T = B * S
    X, Q, K = T * d * c, T * hq * hd * c, T * hkv * hd * c
    kv_read = 2 * B * hkv * ctx * hd * c  # the live K/V of every row
    if fused:  # the five fused kernels, each reading its weights
        return [Kernel("matmul", 1, 2 * T * d * (hq + 2 * hkv) * hd,
                       X + c * d * (hq + 2 * hkv) * hd + Q + 2 * K, "hbm"),
                Kernel("attention", 1, bytes=kv_read + 2 * Q),
                Kernel("matmul", 1, 2 * T * hq * hd * d, Q + c * hq * hd * d + 2 * X, "hbm"),
                Kernel("matmul", 1, 2 * T * d * 2 * f, X + c * d * 2 * f + T * f * c, "hbm"),
                Kernel("matmul", 1, 2 * T * f * d, T * f * c + c * f * d + 2 * X, "hbm")]
    ks = _norm(T, d, c) + [_gemm(T, d, (hq + 2 * hkv) * hd, c), _ew("rope", 2 * (Q + K), 2),
                           _ew("cache write", 4 * K, 2)]
    if prefill:
        ks += [_ew("copy", 2 * K),  # v made contiguous for the kernel
               Kernel("attention", 1, attention_flops_fwd(m, B, S, S, hq), Q + 2 * K + Q,
                      "attn_fwd")]
    else:
        ks.append(Kernel("attention", 1, 4 * B * hq * S * ctx * hd, kv_read + 2 * Q))
    ks += [_gemm(T, hq * hd, d, c), _ew("elementwise", 3 * X)]
    return ks + _ffn_kernels(m, T, c, tp, moe)


def _mla_layer(m: ModelConfig, B: int, S: int, ctx: int, cache_len: int, c: float,
               prefill: bool, moe: bool) -> list[Kernel]:
    a, d, H = m.mla, m.d_model, m.n_heads
    nope, rope, dv, r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    T = B * S
    X, Q = T * d * c, T * H * a.qk_head_dim * c
    ks = _norm(T, d, c)
    q_in = d
    if a.q_lora_rank:
        ks += [_gemm(T, d, a.q_lora_rank, c), *_norm(T, a.q_lora_rank, c)]
        q_in = a.q_lora_rank
    ks += [_gemm(T, q_in, H * a.qk_head_dim, c), _ew("rope", 2 * T * H * rope * c),
           _gemm(T, d, r + rope, c), *_norm(T, r, c), _ew("rope", 2 * T * rope * c),
           _ew("cache write", 2 * T * (r + rope) * c)]
    if prefill:
        K = T * H * a.qk_head_dim * c
        Vb = T * H * dv * c
        ks += [_gemm(T, r, H * nope, c), _ew("elementwise", K + T * H * nope * c, 1),
               _gemm(T, r, H * dv, c), _ew("elementwise", 2 * Q)]  # k, v; q's concatenate
        dqk_p = attention_head_dims(m, padded=True)[0]
        if dqk_p != a.qk_head_dim:  # the Triton kernel's padded q and k
            ks.append(_ew("copy", 2 * (Q + K) * (1 + dqk_p / a.qk_head_dim) / 2, 2))
        ks.append(Kernel("attention", 1, attention_flops_fwd(m, B, S, S, H), 2 * Q + 2 * Vb,
                         "attn_fwd"))
    else:
        lat = B * cache_len * (r + rope) * c  # the whole buffer: the einsums read it all
        sc = B * H * S * cache_len * 4
        ks += [Kernel("matmul", 1, 2 * T * H * nope * r, c * (T * H * nope + H * nope * r
                                                              + T * H * r)),  # q into the latent
               _ew("elementwise", 2 * T * H * (r + rope) * c),  # [q_lat | q_rope]
               Kernel("attention", 1, 2 * T * H * cache_len * (r + rope), lat + sc),  # scores
               _ew("attention", 2 * sc),  # scale and mask
               _ew("attention", 3 * sc, 3),  # softmax: max, sum, normalise (compute dtype)
               _ew("copy", 2 * B * cache_len * r * c),  # the latent's value part
               Kernel("attention", 1, 2 * T * H * cache_len * r, B * cache_len * r * c + sc / 2),
               Kernel("matmul", 1, 2 * T * H * r * dv, c * (T * H * r + H * r * dv + T * H * dv))]
    ks += [_gemm(T, H * dv, d, c), _ew("elementwise", 3 * X)]
    return ks + _ffn_kernels(m, T, c, 1, moe)


def inference_kernels(cfg: Config, batch: int, new: int, ctx: int, *, prefill: bool,
                      tp: int = 1, fused: bool = False, cache_len: int | None = None
                      ) -> KernelTime:
    """The kernels of one call of `inference/step.py`'s `forward`: `batch` rows of `new`
    tokens over `ctx` cached ones (prefill: new = the prompt), plus, for a decode step,
    the sampling and the loop's bookkeeping."""
    m = cfg.model
    c = DTYPE_BYTES[m.dtype]
    d = m.d_model
    V = m.vocab_size // tp if m.vocab_size % tp == 0 else m.vocab_size
    T = batch * new
    n_moe = 0 if m.moe is None else m.n_layers - m.moe.dense_layers
    cache_len = cache_len or ctx
    ks: list[Kernel] = []
    for moe, count in ((False, m.n_layers - n_moe), (True, n_moe)):
        if not count:
            continue
        if m.mla is not None:
            one = _mla_layer(m, batch, new, ctx, cache_len, c, prefill, moe)
        else:
            one = _gqa_layer(m, batch, new, ctx, c, tp, prefill, fused and not moe, moe)
        ks += [Kernel(k.what, k.launches * count, k.flops, k.bytes, k.rate, k.shape) for k in one]
    ks += [_ew("embedding", 2 * T * d * c), *_norm(T, d, c),
           _gemm(T, d, V, c, out_bytes=T * V * 4)]
    if prefill:  # the cache's zeroing, the last position's logits and the sample
        per_layer = (cache_len * (m.mla.latent_dim if m.mla is not None
                                  else 2 * m.n_kv_heads * m.resolved_head_dim) * c)
        ks += [Kernel("cache write", m.n_layers * (1 if m.mla is not None else 2),
                      bytes=batch * per_layer / (1 if m.mla is not None else 2)),
               _ew("sampling", batch * V * 4, 2)]
    else:
        ks.append(Kernel("sampling", DECODE_STEP_KERNELS - 4, bytes=batch * V * 4
                         / (DECODE_STEP_KERNELS - 4)))
    return KernelTime("prefill" if prefill else f"decode B={batch}", tuple(ks))


# -- a config's three workloads ---------------------------------------------------------------

@dataclass(frozen=True)
class KernelPlan:
    train: KernelTime
    prefill: KernelTime
    decode: dict[int, KernelTime] = field(default_factory=dict)


def kernel_plan(cfg: Config, sizes: dict[str, int], batches, prompt: int, context: int,
                micro: int = 1) -> KernelPlan:
    """The per-kernel workloads of a plan: a training step on one device of the mesh
    `sizes` (its local rows x seq per microbatch, this stage's layers, its share of the
    parameters), prefill of one prompt of `prompt` tokens and decode steps at `context`."""
    from jaxllm.plan.memory import abstract_params, local_tokens, state_bytes
    from jaxllm.sharding.rules import Rules

    rows, seq = local_tokens(cfg, sizes, micro=micro)
    tp, pp = sizes["tp"], sizes["pp"]
    layers = math.ceil(cfg.model.n_layers / pp)
    rules = Rules(tuple(sizes.items()), cfg.train.zero_stage, cfg.parallelism.sequence_parallel)
    n_params = state_bytes(cfg, rules).params / DTYPE_BYTES[cfg.model.param_dtype]
    arrays = len(abstract_params(cfg.model))
    one = train_kernels(cfg, rows, seq, sizes, layers, n_params, arrays)
    if micro > 1:  # the optimizer once, the rest per microbatch
        ks = [Kernel(k.what, k.launches * (1 if k.what == "optimizer" else micro), k.flops,
                     k.bytes, k.rate, k.shape) for k in one.kernels]
        one = KernelTime("train", tuple(ks))
    inf = cfg.inference
    cache_len = -(-(prompt + inf.max_new_tokens + inf.decode_chunk) // 64) * 64
    from jaxllm.inference.params import FUSED_ROWS
    from jaxllm.model.layers import rope_magnitude
    mc = cfg.model  # the fused decode matmuls' conditions (`inference/params.py`)
    fusable = (mc.mla is None and mc.moe is None and not mc.qkv_bias and not mc.qk_norm
               and rope_magnitude(mc.rope_scaling) == 1.0 and inf.matmul_impl != "xla")
    return KernelPlan(
        one,
        inference_kernels(cfg, 1, prompt, prompt, prefill=True, tp=tp, cache_len=cache_len),
        {b: inference_kernels(cfg, b, 1, context, prefill=False, tp=tp,
                              fused=fusable and b <= FUSED_ROWS, cache_len=cache_len)
         for b in batches})

