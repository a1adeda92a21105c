"""`plan(cfg, hardware, devices)`: the planner's figures in one frozen dataclass, and the
text report `python -m jaxllm.plan` prints.

    p = jaxllm.plan(cfg, hardware="h200", devices=8)
    p.train_memory.total, p.step_s, p.bound, p.ttft_s, p.tpot_s[32], p.max_batch
    p.kernel_step_s, p.kernel_ttft_s, p.kernel_tpot_s[32]   # the per-kernel model

The roofline times (`roofline.py`) are lower bounds; the kernel times (`kernel_time.py`)
sum the kernels each workload launches, each at its own ceiling plus a fixed cost.

Training uses the config's `parallelism:` layout over `devices`; inference a model replica
over `parallelism.tp` devices, decoding `batches` sequences at the mean context of a
request: the prompt plus half of `inference.max_new_tokens`.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field

from jaxllm.config import Config, ConfigError
from jaxllm.plan import unrolled
from jaxllm.plan.comm import Collective, train_collectives
from jaxllm.plan.flops import TrainFlops, pipeline_of, train_flops
from jaxllm.plan.hardware import Hardware, get_hardware
from jaxllm.plan.kernel_time import KernelPlan, kernel_plan
from jaxllm.plan.memory import (InferenceMemory, TrainMemory, inference_memory,
                                kv_bytes_per_token, state_bytes, train_memory)
from jaxllm.plan.memory import microbatches as resolve_microbatches
from jaxllm.plan.roofline import (Point, bubble_fraction, decode_point, prefill_point,
                                  train_point)
from jaxllm.sharding.mesh import mesh_shape
from jaxllm.sharding.rules import Rules

GiB = 1 << 30
DEFAULT_BATCHES = (1, 32, 64)


@dataclass(frozen=True)
class Plan:
    cfg: Config
    hardware: Hardware
    devices: int
    sizes: dict[str, int]
    train_memory: TrainMemory
    train_flops: TrainFlops
    collectives: tuple[Collective, ...]
    train: Point
    prompt_len: int
    context: int
    prefill: Point
    decode: dict[int, Point]
    inference_memory: InferenceMemory
    batches: tuple[int, ...] = field(default=DEFAULT_BATCHES)
    microbatches: int = 1
    kernels: KernelPlan | None = None

    # -- training ----------------------------------------------------------------------
    @property
    def fits(self) -> bool:
        return self.train_memory.total <= self.hardware.hbm

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def step_s(self) -> float:
        """The step with communication overlapped (a lower bound)."""
        return self.train.seconds(self.hardware)

    @property
    def step_exposed_s(self) -> float:
        """The step with no overlap: compute or memory time plus communication."""
        hw = self.hardware
        return max(self.train.compute_s(hw), self.train.memory_s(hw)) + self.comm_s

    @property
    def bound(self) -> str:
        return self.train.bound(self.hardware)

    @property
    def mfu(self) -> float:
        """Model FLOPs over the devices' peak in `step_s` (overlapped). The model count
        takes causal attention whole (the MFU convention), so a step at the roofline can
        show more than 100% where attention is a large share."""
        return self.train_flops.model_per_step / (self.step_s * self.devices
                                                  * self.hardware.flops)

    @property
    def tokens_per_s(self) -> float:
        return self.train_flops.tokens_per_step / self.step_s

    # -- inference ---------------------------------------------------------------------
    @property
    def ttft_s(self) -> float:
        return self.prefill.seconds(self.hardware)

    @property
    def tpot_s(self) -> dict[int, float]:
        return {b: p.seconds(self.hardware) for b, p in self.decode.items()}

    # -- the per-kernel model ------------------------------------------------------------
    @property
    def kernel_step_s(self) -> float:
        """The train step as the sum of its kernels (times the pipeline's bubble), with
        communication overlapped: the larger of the two."""
        bubble = 1 + bubble_fraction(self.cfg, self.sizes["pp"], self.microbatches)
        return max(self.kernels.train.seconds(self.hardware) * bubble, self.comm_s)

    @property
    def kernel_ttft_s(self) -> float:
        """The prefill's kernels and the host's time for its call: `Hardware.call_s`
        and `launch_s` for each kernel (from an idle device, before the device's time)."""
        hw, prefill = self.hardware, self.kernels.prefill
        return prefill.seconds(hw) + hw.call_s + prefill.launches * hw.launch_s

    @property
    def kernel_tpot_s(self) -> dict[int, float]:
        return {b: k.seconds(self.hardware) for b, k in self.kernels.decode.items()}

    @property
    def max_batch(self) -> int:
        return self.inference_memory.max_batch

    @property
    def ridge(self) -> float:
        return self.hardware.ridge


def plan(cfg: Config, hardware: str | Hardware = "h200", devices: int = 8, *,
         measured: str | None = None, batches=DEFAULT_BATCHES, prompt_len: int | None = None,
         platform: str = "gpu", microbatches: int | None = None) -> Plan:
    """Memory, FLOPs, roofline times and communication of `cfg` on `devices` GPUs of
    `hardware` (a name of `HARDWARE`, or a Hardware; `measured`: a ceilings file;
    `microbatches`: per step, default train.microbatches where the config has it, else 1)."""
    if devices <= 0:
        raise ValueError(f"devices={devices} must be positive")
    hw = get_hardware(hardware, measured)
    sizes = mesh_shape(cfg.parallelism, devices)
    t, m = cfg.train, cfg.model
    n_data = sizes["dp"] * sizes["fsdp"] * sizes["ep"]
    if t.batch_size % n_data:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by the "
                          f"data-parallel size dp x fsdp x ep = {n_data}")
    micro = resolve_microbatches(cfg, microbatches)
    if t.batch_size % (n_data * micro):
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by the "
                          f"data-parallel size {n_data} x {micro} microbatches")
    mem = train_memory(cfg, sizes, platform=platform, micro=micro)
    rules = Rules(tuple(sizes.items()), t.zero_stage, cfg.parallelism.sequence_parallel)
    states = state_bytes(cfg, rules)
    psi_tp = _model_parallel_bytes(cfg, sizes)
    colls = tuple(train_collectives(cfg, sizes, hw, states, psi_tp, micro))
    point = train_point(cfg, sizes, mem, sum(c.seconds for c in colls), micro)
    tp = sizes["tp"]
    prompt = prompt_len or t.seq_len
    context = prompt + cfg.inference.max_new_tokens // 2  # the mean context while decoding
    batches = tuple(sorted(set(int(b) for b in batches)))
    if not batches or batches[0] <= 0:
        raise ValueError(f"batches={batches} must be positive decode batch sizes")
    flops = train_flops(m, t.batch_size, t.seq_len, pipeline=pipeline_of(cfg, sizes))
    return Plan(cfg, hw, devices, sizes, mem, flops, colls,
                point, prompt, context, prefill_point(cfg, 1, prompt, tp),
                {b: decode_point(cfg, b, context, tp) for b in batches},
                inference_memory(cfg, hw.hbm, tp, context), batches, micro,
                kernel_plan(cfg, sizes, batches, prompt, context, micro))


def _model_parallel_bytes(cfg: Config, sizes: dict[str, int]) -> float:
    """Parameter bytes per device split over the model-parallel axes only (no ZeRO)."""
    compute = Rules(tuple(sizes.items()), 0, False)
    return state_bytes(cfg, compute).params


# -- the text report ------------------------------------------------------------------------

def _gib(x: float) -> str:
    return f"{x / GiB:,.2f} GiB" if x >= GiB / 100 else f"{x / (1 << 20):,.2f} MiB"


def _time(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def render(p: Plan, width: int = 110) -> str:
    """The report as text (rich tables)."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    m, t, hw = p.cfg.model, p.cfg.train, p.hardware
    mesh = " x ".join(f"{a}={n}" for a, n in p.sizes.items() if n > 1) or "1 device"
    con.print(f"{m.num_params() / 1e9:,.3f}B parameters ({m.n_layers} layers, d {m.d_model}) "
              f"on {p.devices} x {hw.name}{' (measured ceilings)' if hw.measured else ''}: "
              f"{mesh}; ZeRO-{t.zero_stage}, remat {m.remat}, batch {t.batch_size} x "
              f"{t.seq_len}")
    con.print(f"peaks per GPU: {hw.flops / 1e12:,.0f} TFLOP/s, HBM {hw.hbm_bw / 1e12:.2f} TB/s "
              f"({hw.hbm / 1e9:.0f} GB), NVLink {hw.nvlink_bw / 1e9:.0f} GB/s, network "
              f"{hw.ib_bw / 1e9:.0f} GB/s; ridge point {hw.ridge:,.0f} FLOP/byte")

    tab = Table(title="training memory per device")
    tab.add_column("component")
    tab.add_column("bytes", justify="right")
    for k, v in p.train_memory.as_dict().items():
        tab.add_row(k, _gib(v))
    tab.add_row("HBM", _gib(hw.hbm) + ("" if p.fits else "  (does not fit)"))
    con.print(tab)
    if m.unroll_layers and not unrolled.modelled(p.cfg, p.sizes):
        con.print("memory as the rolled layer loop holds it: the unrolled step's is modelled "
                  "only outside a pipeline and without MTP modules (docs/planning.md)")

    tab = Table(title="training step per device")
    tab.add_column("figure")
    tab.add_column("value", justify="right")
    tr, fl = p.train, p.train_flops
    for k, v in [("FLOPs per token (model: 6N + 12LHDS)", f"{fl.model_per_token:.4g}"),
                 ("FLOPs per token (executed: causal, remat)", f"{fl.hardware_per_token:.4g}"),
                 ("FLOPs per step per device", f"{tr.flops:.4g}"),
                 ("HBM bytes per step per device", _gib(tr.bytes)),
                 ("arithmetic intensity (FLOP/byte)", f"{tr.intensity:,.0f}"),
                 ("compute time", _time(tr.compute_s(hw))),
                 ("HBM time", _time(tr.memory_s(hw))),
                 ("communication time", _time(tr.comm_s)),
                 ("step (overlapped / not)", f"{_time(p.step_s)} / {_time(p.step_exposed_s)}"),
                 ("step, per-kernel model", f"{_time(p.kernel_step_s)} "
                  f"({p.kernels.train.launches:,.0f} kernels)"),
                 ("bound", p.bound),
                 ("MFU at this step time (model FLOPs)", f"{100 * p.mfu:.1f}%"),
                 ("tokens/s", f"{p.tokens_per_s:,.0f}")]:
        tab.add_row(k, v)
    con.print(tab)

    if p.collectives:
        tab = Table(title="communication per step")
        for col in ("axis", "op", "what", "MB per call", "calls", "group", "link", "time"):
            tab.add_column(col, justify="right" if col in ("MB per call", "calls", "group",
                                                          "time") else "left")
        for c in p.collectives:
            tab.add_row(c.axis, c.op, c.what, f"{c.bytes / 1e6:,.2f}", f"{c.count:g}",
                        str(c.group), c.link, _time(c.seconds))
        con.print(tab)

    tp = p.sizes["tp"]
    im = p.inference_memory
    con.print(f"inference (a replica on tp={tp} device{'s' if tp > 1 else ''}): weights "
              f"{_gib(im.weights)} per device; KV cache {kv_bytes_per_token(m) / 1024:,.1f} KiB "
              f"per token ({_gib(im.kv_per_token * p.context)} per sequence of {p.context}); "
              f"at most {im.max_batch} such sequences fit")
    tab = Table(title=f"inference roofline (prompt {p.prompt_len}, context {p.context})")
    for col in ("workload", "FLOPs", "bytes", "intensity", "time", "bound", "kernel model",
                "kernels", "tokens/s"):
        tab.add_column(col, justify="right" if col != "workload" else "left")
    rows = [("prefill (TTFT)", p.prefill, p.prompt_len, p.kernels.prefill, p.kernel_ttft_s)]
    rows += [(f"decode B={b} (TPOT)", pt, b, p.kernels.decode[b], p.kernel_tpot_s[b])
             for b, pt in p.decode.items()]
    for name, pt, tokens, kt, ks in rows:
        s = pt.seconds(hw)
        tab.add_row(name, f"{pt.flops:.3g}", _gib(pt.bytes), f"{pt.intensity:,.1f}", _time(s),
                    pt.bound(hw), _time(ks), f"{kt.launches:,.0f}", f"{tokens / ks:,.0f}")
    con.print(tab)

    tab = Table(title=f"train step by kernel category (per-kernel model; fixed cost "
                      f"{hw.kernel_s * 1e6:.1f} us a kernel)")
    for col in ("category", "time", "kernels"):
        tab.add_column(col, justify="right" if col != "category" else "left")
    for what, (sec, n) in p.kernels.train.by_category(hw).items():
        tab.add_row(what, _time(sec), f"{n:,.0f}")
    con.print(tab)
    return buf.getvalue()
