"""Per-kernel times: a step is the sum of the kernels it launches, each at its own ceiling,
plus a fixed cost per launch.

    t(step)   = sum over kernels of  launches x (kernel_s + max(FLOPs / rate, bytes / hbm_bw))

    rate      matmuls: the measured rate of that [m, k] x [k, n] shape where the ceilings
              have one (`Hardware.matmul_shapes`), else `flops`; flash attention: `attn_fwd`
              and `attn_bwd`; the experts' grouped matmul: its measured forward rate at
              that shape (`Hardware.gmm_shapes`: prefill and decode), else `gmm_flops`;
              the fused one-row decode products (`decode_gemv`): their measured rate at
              that shape (`Hardware.gemv_shapes`); each else `flops`
    bytes     what the kernel reads and writes in HBM; every elementwise, reduction, copy
              and gather kernel has FLOPs 0, so it takes its bytes at the HBM rate

The roofline (`roofline.py`) takes a whole step at the best of either ceiling; here the
memory-bound kernels add to the matmuls' time, and each launch costs `kernel_s`. The
kernels are counted by hand from the code that runs, a layer at a time: `kernel_train.py`
for the training step, `kernel_infer.py` for prefill and decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.config import Config, ModelConfig
from jaxllm.kernels.registry import auto_order
from jaxllm.plan.activations import DTYPE_BYTES, heads_split
from jaxllm.plan.flops import stage_layers
from jaxllm.plan.hardware import Hardware

ROUTING_KERNELS = 10  # sigmoid / softmax, group top-2, group top-k, mask, top-k, weights...
SORT_KERNELS = 3  # one sort of a few hundred thousand keys (a radix sort's passes)


@dataclass(frozen=True)
class Kernel:
    """`launches` launches of one kernel, each of `flops` FLOPs and `bytes` HBM bytes."""
    what: str  # the category a profile would give it
    launches: float = 1.0
    flops: float = 0.0
    bytes: float = 0.0
    rate: str = "hbm"  # "matmul", "gemv", "attn_fwd", "attn_bwd", "gmm" or "hbm" (no FLOPs)
    # a matmul's (m, k, n); a prefill or decode grouped matmul's (m, k, n, groups)
    shape: tuple[int, ...] | None = None

    def flop_rate(self, hw: Hardware) -> float:
        by_shape = {"matmul": hw.matmul_rate, "gmm": hw.gmm_rate, "gemv": hw.gemv_rate}
        if self.shape is not None and self.rate in by_shape:
            return by_shape[self.rate](*self.shape)
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


def repeated(kernels: list[Kernel], count: float) -> list[Kernel]:
    """`kernels` launched `count` times as often (one layer's, over `count` layers)."""
    return [Kernel(k.what, k.launches * count, k.flops, k.bytes, k.rate, k.shape)
            for k in kernels]


def split(n: int, tp: int) -> int:
    """n (heads, a width, the vocabulary) per device: n / tp, or all of n where tp does not
    divide it (the rules' fallback: replicated)."""
    return n // tp if n % tp == 0 else n


def heads(m: ModelConfig, tp: int) -> tuple[int, int, int]:
    """(query heads, kv heads, mlp width) per device (`activations.heads_split`)."""
    hq, hkv = heads_split(m.n_heads, m.n_kv_heads, tp)
    return int(hq), int(hkv), split(m.mlp_dim, tp)



def flash_impl(m: ModelConfig) -> str:
    """The flash kernel the model runs on a (Hopper) GPU: model.attention_impl, and for
    "auto" the first of the registry's auto order for its query-key head dim (the Mosaic
    kernel at 128 and MLA's 192, cuDNN at 64 and 256)."""
    if m.attention_impl != "auto":
        return m.attention_impl
    return auto_order("flash", "gpu", attention_head_dims(m)[0])[0]


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
    from jaxllm.inference.params import FUSED_ROWS
    from jaxllm.model.layers import rope_magnitude
    from jaxllm.plan.kernel_infer import inference_kernels
    from jaxllm.plan.kernel_train import train_kernels
    from jaxllm.plan.memory import abstract_params, local_tokens, state_bytes
    from jaxllm.sharding.rules import Rules

    rows, seq = local_tokens(cfg, sizes, micro=micro)
    tp, pp = sizes["tp"], sizes["pp"]
    layers = stage_layers(cfg.model, pp)
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
    mc = cfg.model  # the fused decode matmuls' conditions (`inference/params.py`)
    fusable = (mc.mla is None and mc.moe is None and not mc.qkv_bias and not mc.qk_norm
               and rope_magnitude(mc.rope_scaling) == 1.0 and inf.matmul_impl != "xla")
    return KernelPlan(
        one,
        inference_kernels(cfg, 1, prompt, prompt, prefill=True, tp=tp, cache_len=cache_len),
        {b: inference_kernels(cfg, b, 1, context, prefill=False, tp=tp,
                              fused=fusable and b <= FUSED_ROWS, cache_len=cache_len)
         for b in batches})


