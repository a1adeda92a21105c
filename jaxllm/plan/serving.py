"""The planner's serving figures beside what a built engine holds: the lines
`python -m jaxllm.serve` prints at start-up.

    print(jaxllm.plan.describe_serving(cfg, engine))              # the detected GPU, or none
    print(jaxllm.plan.describe_serving(cfg, engine, hardware="h100"))

Memory is arithmetic on both sides, so planned / engine is 1 where the planner counts what
the engine allocates:

    KV cache per token   `memory.kv_bytes_per_token` (all layers: GQA's K and V, MLA's
                         latent and rotary key) against the page pool's bytes per token slot
    page pool            that times the engine's pages x page_size, against its arrays
    full contexts        the pool's tokens over max_model_len, against its pages over the
                         pages one full-length sequence takes
    weights              `memory.weight_bytes` against the arrays of `DecodeParams`
    compiled step        weights + pool against the arguments of the largest token bucket's
                         program (`memory_analysis()`), and against its peak; the step's
                         temporaries (activations, logits, sampling) are not planned

On a GPU the planner knows (detected from the device kind, or named), also the pool it
sizes for that GPU (memory_fraction of HBM less the weights, `memory.inference_memory`)
beside the engine's (memory_fraction of the free device memory, at most two full contexts
per sequence slot, or inference.engine.num_pages), and its predicted TTFT of one prompt of
max_num_batched_tokens and TPOT at max_num_seqs sequences (`report.plan`: the roofline and
the per-kernel model). The engine runs on one device, so the plan is of one device with no
model parallelism. On a CPU the times do not apply.
"""
from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass

from jaxllm.config import Config, EngineConfig, ModelConfig, ParallelismConfig
from jaxllm.plan.hardware import Hardware, detect_hardware, get_hardware
from jaxllm.plan.memory import (InferenceMemory, compiled_peak, inference_memory,
                                kv_bytes_per_token, weight_bytes)
from jaxllm.plan.report import GiB, _time, plan

__all__ = ["EngineFigures", "engine_figures", "describe_serving"]


@dataclass(frozen=True)
class EngineFigures:
    """What a built engine holds on its device."""
    model: ModelConfig
    engine: EngineConfig  # with the engine's own overrides applied
    num_pages: int
    max_pages_per_seq: int
    max_model_len: int
    pool_bytes: int
    weight_bytes: int
    pages_from: str  # how the pool was sized: "config", "free memory" or "cpu"
    platform: str
    device_kind: str
    bucket: int  # the largest token bucket
    program: str | None = None  # which of its programs `compiled` describes
    compiled: dict | None = None  # memory_analysis(): argument, output, alias, temp bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return self.pool_bytes / (self.num_pages * self.engine.page_size)

    @property
    def full_contexts(self) -> int:
        return self.num_pages // self.max_pages_per_seq


def engine_figures(engine) -> EngineFigures:
    """An `inference.engine.Engine`'s figures: its pool, its weights, and the compiled memory
    of its largest token bucket's step (of the greedy and sampling programs compiled, the
    one of the larger peak; none before a warm-up or a step compiles one)."""
    import jax

    runner = engine.runner
    device = jax.devices()[0]  # where the engine puts its pool and weights
    bucket = runner.buckets[-1]
    compiled, program = None, None
    for (kind, t, sampled), fn in sorted(runner.programs().items()):
        stats = fn.memory_analysis() if kind == "step" and t == bucket else None
        if stats is None:
            continue
        stats = {"argument": stats.argument_size_in_bytes,
                 "output": stats.output_size_in_bytes, "temp": stats.temp_size_in_bytes,
                 "alias": stats.alias_size_in_bytes}
        if compiled is None or compiled_peak(stats) > compiled_peak(compiled):
            compiled, program = stats, "sampling" if sampled else "greedy"
    if engine.config.num_pages:
        pages_from = "config"
    else:
        pages_from = "free memory" if "bytes_limit" in (device.memory_stats() or {}) else "cpu"
    return EngineFigures(
        engine.model_config, engine.config, engine.num_pages, engine.max_pages_per_seq,
        engine.max_model_len, runner.pool_bytes,
        sum(x.nbytes for x in jax.tree.leaves(engine.params)), pages_from, device.platform,
        device.device_kind, bucket, program, compiled)


def _ratio(planned: float, actual: float) -> str:
    if not actual:
        return "-"
    r = planned / actual
    return f"{r:.3f}" if r < 100 else f"{r:,.0f}"


def _kv_form(m: ModelConfig) -> str:
    if m.mla is not None:
        return f"MLA latent {m.mla.kv_lora_rank} + rotary key {m.mla.qk_rope_head_dim}"
    return f"GQA K and V, {m.n_kv_heads} heads x {m.resolved_head_dim}"


def _hardware(hardware: str | Hardware | None,
              fig: EngineFigures) -> tuple[Hardware | None, str]:
    """The GPU to plan for and, where there is none, why."""
    if hardware is not None:
        return get_hardware(hardware), ""
    if fig.platform != "gpu":
        return None, (f"the engine runs on a {fig.platform.upper()}; the planner's times and "
                      f"pool sizing are for GPUs (name one: --hardware h100)")
    key = detect_hardware(fig.device_kind)
    if key is None:
        return None, (f"the device {fig.device_kind!r} is not in the planner's table; name "
                      f"the nearest (--hardware h100)")
    return get_hardware(key), ""


def describe_serving(cfg: Config, engine, hardware: str | Hardware | None = None) -> str:
    """The planner's figures for `cfg` beside the engine's (an Engine or its
    `engine_figures`), planned / engine where both exist; `hardware`: the GPU whose pool
    sizing and times to predict (a name of `HARDWARE`, or a Hardware; default: the
    detected device, none on a CPU)."""
    fig = engine if isinstance(engine, EngineFigures) else engine_figures(engine)
    m, e = fig.model, fig.engine
    # the engine: one device, no model parallelism, its own sizes
    cfg = dataclasses.replace(cfg, model=m, parallelism=ParallelismConfig(),
                              inference=dataclasses.replace(cfg.inference, engine=e))
    hw, why_not = _hardware(hardware, fig)

    rows: list[tuple[str, str, str, str]] = []  # figure, planned, engine, planned / engine
    notes: list[str] = []
    kv = kv_bytes_per_token(m)
    rows.append((f"KV cache per token, {m.n_layers} layers ({_kv_form(m)})",
                 _kib(kv), _kib(fig.kv_bytes_per_token), _ratio(kv, fig.kv_bytes_per_token)))
    tokens = fig.num_pages * e.page_size
    pool = kv * tokens
    rows.append((f"page pool, {fig.num_pages:,} pages of {e.page_size} tokens", _size(pool),
                 _size(fig.pool_bytes), _ratio(pool, fig.pool_bytes)))
    contexts = InferenceMemory(0.0, kv, pool, fig.max_model_len).max_batch
    rows.append((f"  full contexts ({fig.max_model_len:,} tokens) it holds", f"{contexts:,}",
                 f"{fig.full_contexts:,}", _ratio(contexts, fig.full_contexts)))
    weights = weight_bytes(m)
    rows.append(("weights on the device", _size(weights), _size(fig.weight_bytes),
                 _ratio(weights, fig.weight_bytes)))
    what = f"step of {fig.bucket:,} tokens"
    if fig.compiled is None:
        notes.append(f"the compiled {what}: not compiled yet (the engine was built without "
                     f"its warm-up)")
    else:
        c = fig.compiled
        peak = compiled_peak(c)
        rows.append((f"compiled {what} ({fig.program}): arguments", _size(weights + pool),
                     _size(c["argument"]), _ratio(weights + pool, c["argument"])))
        rows.append(("  peak (arguments + temporaries + unaliased outputs)",
                     _size(weights + pool), _size(peak), _ratio(weights + pool, peak)))
        notes.append(f"planned step memory = weights + pool; the step's temporaries, "
                     f"{_size(c['temp'])} (activations, logits, sampling), are not planned")

    if hw is not None:
        im = inference_memory(cfg, hw.hbm, 1, fig.max_model_len)
        pages = im.max_tokens // e.page_size
        rows.append((f"pool for {hw.name} at memory_fraction {e.memory_fraction}: pages",
                     f"{pages:,}", f"{fig.num_pages:,}", _ratio(pages, fig.num_pages)))
        rows.append((f"  full contexts ({fig.max_model_len:,} tokens) it holds",
                     f"{im.max_batch:,}", f"{fig.full_contexts:,}",
                     _ratio(im.max_batch, fig.full_contexts)))
        notes.append(f"the planner's pool: memory_fraction of {hw.name}'s "
                     f"{hw.hbm / 1e9:.0f} GB less the weights; the engine's: "
                     + {"config": "inference.engine.num_pages",
                        "free memory": f"memory_fraction of the free device memory, at "
                                       f"most two full contexts per sequence slot "
                                       f"({2 * e.max_num_seqs * fig.max_pages_per_seq:,} "
                                       f"pages)",
                        "cpu": "max_num_seqs full contexts (no memory figures on a CPU)"}
                     [fig.pages_from])
        prompt = min(e.max_num_batched_tokens, fig.max_model_len)
        b = e.max_num_seqs
        p = plan(cfg, hw, 1, batches=(b,), prompt_len=prompt)
        rows.append((f"TTFT on {hw.name}, one prompt of {prompt:,} tokens",
                     f"{_time(p.ttft_s)} / {_time(p.kernel_ttft_s)}", "-", "-"))
        rows.append((f"  TPOT at {b} sequences, context {p.context:,}",
                     f"{_time(p.tpot_s[b])} / {_time(p.kernel_tpot_s[b])}", "-", "-"))
        notes.append("times: the roofline's / the per-kernel model's (docs/planning.md); the "
                     "engine's are measured by benchmarks/engine.py and served at /metrics")
    else:
        notes.append(f"no times predicted: {why_not}")

    width = max(len(r[0]) for r in rows)
    cols = [max(len(r[i]) for r in rows + [("", "planned", "engine", "")]) for i in (1, 2)]
    device = fig.device_kind if fig.device_kind != fig.platform else fig.platform.upper()
    head = (f"plan vs engine (python -m jaxllm.plan; the engine on one {device}; "
            f"{m.num_params() / 1e6:,.1f}M parameters in {m.dtype}):")
    lines = [head, f"  {'':<{width}}  {'planned':>{cols[0]}}  {'engine':>{cols[1]}}  "
                   f"planned/engine"]
    lines += [f"  {what:<{width}}  {planned:>{cols[0]}}  {actual:>{cols[1]}}  {ratio:>14}"
              for what, planned, actual, ratio in rows]
    lines += [textwrap.fill(n, 100, initial_indent="  ", subsequent_indent="    ")
              for n in notes]
    return "\n".join(lines)


def _kib(x: float) -> str:
    return f"{x / 1024:,.2f} KiB"


def _size(x: float) -> str:
    return f"{x / GiB:,.2f} GiB" if x >= GiB else f"{x / (1 << 20):,.2f} MiB"
