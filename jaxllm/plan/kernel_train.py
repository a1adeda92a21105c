"""The kernels of a training step (the model's forward through `lax.scan` over the stacked
layers in `train/trainer.py`, its backward, Adam), for `kernel_time.py`. The notation:
T tokens, d model width, c / p bytes of the compute / parameter dtype, X = T d c.

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
    stack       the rolled scan keeps what the backward reads (remat none: every intermediate;
                "dots": the matmul outputs; "full": the block input) in stacked [L, ...]
                buffers, the bytes of `activations.saved_per_token` (and without remat
                an MoE layer's `expert_bytes`), each copied in by its own kernel (read +
                write); the backward's fusions read the stack in place, but a tensor a
                library call (cuBLAS, cuDNN, Pallas) reads is first copied out (read +
                write); unrolled (model.unroll_layers) neither: each layer's own buffers
    remat       "dots": every kernel but the matmuls runs again in the backward (attention
                and an MoE layer's grouped matmuls included: they are no dot_general);
                "full": the whole block forward again
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
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config import Config, ModelConfig
from jaxllm.plan.activations import DTYPE_BYTES
from jaxllm.plan.flops import stage_moe_layers
from jaxllm.plan.kernel_time import (ROUTING_KERNELS, SORT_KERNELS, Kernel, KernelTime,
                                     attention_flops_fwd, attention_head_dims, flash_impl,
                                     heads, repeated, split)


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


def _backward(op: Op, c: float, p: float, remat: str, rolled: bool = True) -> list[Kernel]:
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
        if remat == "none" and rolled:  # the forward's cast, copied out of the stack
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
                        saved: float, rolled: bool = True) -> list[Kernel]:
    """One layer's kernels in a training step: forward, the stacking of its `saved` bytes
    (what the backward reads, `activations.py`), backward and the remat policy's
    recompute. Unrolled (`rolled` False: model.unroll_layers) nothing is stacked or copied
    out of a stack: each layer's saved tensors are its own buffers."""
    by_name = {o.name: o for o in ops}
    out = []
    for op in ops:
        out += _forward(op, c, p)
    kept = max(1, sum(remat in op.keep for op in ops))  # the scan's stacking: a copy each
    if rolled:
        out.append(Kernel("stack", kept, bytes=2 * saved / kept))
    copied = set()
    for op in reversed(ops):
        out += _backward(op, c, p, remat, rolled)
        for name in op.lib_reads if rolled else ():
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


def _mlp_ops(T: int, d: int, f: int, c: float, prefix: str = "") -> list[Op]:
    """SwiGLU after a norm `prefix + norm2`: gate, up, silu(gate) * up, down, residual."""
    n = prefix + "norm2"
    X, Fm = T * d * c, T * f * c
    return [Op(prefix + "gate", "matmul", Fm, ("none", "dots"), (n,), (T, d, f)),
            Op(prefix + "up", "matmul", Fm, ("none", "dots"), (n,), (T, d, f)),
            Op(prefix + "swiglu", "elementwise", Fm, ("none",), read=2 * Fm),
            Op(prefix + "down", "matmul", X, (), (prefix + "swiglu",), (T, f, d)),
            Op(prefix + "residual2", "elementwise", X, ("none",), read=2 * X, bwd=None)]



def train_layer_ops(m: ModelConfig, rows: int, seq: int, tp: int = 1,
                    moe: bool = False, ep: int = 1) -> list[Op]:
    """The forward of one block (`model/block.py`) over rows x seq tokens on one device
    (`ep`: an MoE layer's experts split over it; the grouped matmuls' rows stay the
    device's tokens' assignments, the mean a device receives)."""
    c = DTYPE_BYTES[m.dtype]
    T, d = rows * seq, m.d_model
    hq, hkv, f = heads(m, tp)
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
    k, fe = e.top_k, split(e.expert_mlp_dim, tp)
    R = T * k  # assignments
    RD, RF, TE = R * d * c, R * fe * c, T * e.num_experts * 4
    local = e.num_experts // ep  # the experts whose weights the device holds
    ops += [Op("router", "matmul", TE, ("none", "dots"), ("norm2",), (T, d, e.num_experts)),
            Op("route", "elementwise", TE, ("none",), read=ROUTING_KERNELS * TE,
               launches=ROUTING_KERNELS, bwd=(4 * TE, 3)),
            Op("stats", "elementwise", 0.0, read=3 * TE, launches=5, bwd=None),
            Op("sort", "elementwise", 2 * R * 4 * SORT_KERNELS, read=2 * R * 4 * SORT_KERNELS,
               launches=2 * SORT_KERNELS + 2, bwd=None),  # order, inverse, counts
            Op("dispatch", "elementwise", RD, ("none",), read=RD, bwd=(2 * RD + X, 2)),
            Op("e_gate", "gmm", RF, ("none",), ("dispatch",), (R, d, fe), local),
            Op("e_up", "gmm", RF, ("none",), ("dispatch",), (R, d, fe), local),
            Op("e_swiglu", "elementwise", RF, ("none",), read=2 * RF),
            Op("e_down", "gmm", RD, ("none",), ("e_swiglu",), (R, fe, d), local),
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
    from jaxllm.plan.activations import expert_bytes, experts_saved, saved_per_token

    m = cfg.model
    sizes = sizes or {"pp": 1, "dp": 1, "fsdp": 1, "ep": 1, "cp": 1, "tp": 1}
    tp = sizes["tp"]
    c, p = DTYPE_BYTES[m.dtype], DTYPE_BYTES[m.param_dtype]
    remat = m.remat
    L = m.n_layers if layers is None else layers
    n_moe = 0 if m.moe is None else min(L, stage_moe_layers(m, sizes["pp"]))
    T, d = rows * seq, m.d_model
    V = split(m.vocab_size, tp)
    X = T * d * c
    ks: list[Kernel] = []
    impl = flash_impl(m)
    for moe, count in ((False, L - n_moe), (True, n_moe)):
        if count:
            saved = T * saved_per_token(m, sizes, seq, impl, remat,
                                        cfg.parallelism.sequence_parallel, moe)
            if moe and experts_saved(remat):
                saved += expert_bytes(m, sizes, T, "gpu")[0]
            ops = train_layer_ops(m, rows, seq, tp, moe, sizes["ep"])
            one = layer_train_kernels(ops, c, p, remat, saved, not m.unroll_layers)
            ks += repeated(one, count)
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
