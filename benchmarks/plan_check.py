"""The planner against what runs: compiled memory on CPU meshes, times on a GPU.

    PYTHONPATH=. python benchmarks/plan_check.py --cpu [--configs NAME ...]   # memory sweep
    PYTHONPATH=. python benchmarks/plan_check.py --gpu [--config configs/llama_1b.yaml]
        [--batches 1 32 64] [--prompt-len 1024] [--new-tokens 128] [--hlo-dir DIR] [--quick]
    PYTHONPATH=. python benchmarks/plan_check.py --gpu-memory [--configs NAME ...]

--cpu compiles the train step of tiny models (dense, MoE, MLA) on 8 simulated CPU devices
for every layout of CONFIGS (dp, fsdp, ZeRO 0-3, tp, sequence parallel, cp, ep, pp with
each schedule; remat none / full / dots, MoE under each; MTP modules; a few batch sizes;
the layer loop unrolled, `*_unroll`)
and prints the planner's peak bytes per device beside the compiler's (`memory_analysis`:
arguments + temporaries + outputs not aliased to donated arguments), their ratio, and how
many are within 5%.
It sets the devices and XLA's fast-compile flag itself.

--gpu-memory compiles (does not run) the train steps of GPU_LAYOUTS on one GPU (the
one-GPU configs at four layers, unrolled and rolled, under each remat policy) and prints
the same comparison against the planner's GPU count.

--gpu first measures this device's ceilings into measured.yaml (a bf16 8192^3 matmul; an
HBM copy, read + write bytes; the fixed cost of a kernel; the config's flash attention
forward and backward at its training shape; with MoE the grouped matmul at its experts'
shape and, forward, at each of its prefill and decode shapes; every matmul shape of the
per-kernel model taking at least 2 us at the peak or the HBM rate (the weights laid out as
its program holds them) and every fused one-row decode product (`decode_gemv`), each rate
its FLOPs over its time past the fixed cost, the operands read from HBM (`_extra_time`);
once the model is built, the host's time for a
call over its decode parameters), then sets the planner's predictions under those
ceilings, the roofline's and the per-kernel model's (`jaxllm/plan/kernel_time.py`),
beside the measured figures for --config on one GPU: the train step's peak memory (its
`memory_analysis()`) and time (the trainer's jitted step on random tokens), TTFT for one
--prompt-len prompt (with batch 1) and TPOT at batches 1, 32, 64
(`jaxllm.inference.generate.generate_ids`, greedy, --new-tokens tokens, decode chunks of
32; the median of TIMED_RUNS generations after a warm one), with the ratios measured /
kernel model and measured / roofline, and the kernels the model counts beside those of
the compiled prefill and decode step (printed by kind; their text into --hlo-dir, if
given).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time

# tiny models, laid out every way; each entry is a list of config overrides, after a
# config file when it is not configs/tiny.yaml
BASE = ["model.n_layers=2", "train.seq_len=64", "train.batch_size=16"]
MOE, MLA = "configs/tiny_moe.yaml", "configs/tiny_mla.yaml"
MOE3 = "model.n_layers=3"  # 1 dense + 2 MoE layers (a scanned stack, as a real model's)
FLUSH_BYTES = 256 << 20  # more than any GPU's L2 cache (50 MiB on an H100)
# two fused one-row products (`decode_gemv`, (m, k, n)) whose time past their bytes at the
# HBM rate is the fixed cost of a kernel (`_kernel_cost`)
KERNEL_COST_SHAPES = ((1, 2048, 2048), (1, 2048, 4096))
TIMED_RUNS = 5  # generations timed per batch on the GPU (--gpu); their median is reported
PP = ["parallelism.pp=2", "train.microbatches=4"]  # 2 stages of one layer, 4 microbatches
CONFIGS = {
    "dp8": ["parallelism.dp=8"],
    "dp8_z1": ["parallelism.dp=8", "train.zero_stage=1"],
    "dp8_z2": ["parallelism.dp=8", "train.zero_stage=2"],
    "dp8_z3": ["parallelism.dp=8", "train.zero_stage=3"],
    "fsdp8": ["parallelism.dp=1", "parallelism.fsdp=8"],
    "dp4_fsdp2": ["parallelism.dp=4", "parallelism.fsdp=2"],
    "dp4_tp2": ["parallelism.dp=4", "parallelism.tp=2"],
    "dp4_tp2_sp": ["parallelism.dp=4", "parallelism.tp=2", "parallelism.sequence_parallel=true"],
    "dp2_fsdp2_tp2_z1": ["parallelism.dp=2", "parallelism.fsdp=2", "parallelism.tp=2",
                         "train.zero_stage=1"],
    "dp4_cp2": ["parallelism.dp=4", "parallelism.cp=2"],
    "dp4_cp2_full": ["parallelism.dp=4", "parallelism.cp=2", "model.remat=full"],
    "dp8_full": ["parallelism.dp=8", "model.remat=full"],
    "dp8_dots": ["parallelism.dp=8", "model.remat=dots"],
    "fsdp8_full": ["parallelism.dp=1", "parallelism.fsdp=8", "model.remat=full"],
    "dp4_tp2_full": ["parallelism.dp=4", "parallelism.tp=2", "model.remat=full"],
    "dp8_b8": ["parallelism.dp=8", "train.batch_size=8"],
    "dp8_b32": ["parallelism.dp=8", "train.batch_size=32"],
    "dp8_b64": ["parallelism.dp=8", "train.batch_size=64"],
    "dp8_s128": ["parallelism.dp=8", "train.seq_len=128"],
    "dp8_z2_full": ["parallelism.dp=8", "train.zero_stage=2", "model.remat=full"],
    # mixture of experts: every expert on each device, over ep (all-to-all), with fsdp,
    # tp and dp
    "moe_dp8": [MOE, MOE3, "parallelism.dp=8"],
    "moe_dp4_tp2": [MOE, MOE3, "parallelism.dp=4", "parallelism.tp=2"],
    "moe_ep8": [MOE, MOE3, "parallelism.dp=1", "parallelism.ep=8"],
    "moe_ep4_dp2": [MOE, MOE3, "parallelism.dp=2", "parallelism.ep=4"],
    "moe_ep4_fsdp2": [MOE, MOE3, "parallelism.dp=1", "parallelism.ep=4", "parallelism.fsdp=2"],
    "moe_dp2_ep2_tp2": [MOE, MOE3, "parallelism.dp=2", "parallelism.ep=2", "parallelism.tp=2"],
    "moe_ep8_full": [MOE, MOE3, "parallelism.dp=1", "parallelism.ep=8", "model.remat=full"],
    "moe_ep4_fsdp2_dots": [MOE, MOE3, "parallelism.dp=1", "parallelism.ep=4",
                           "parallelism.fsdp=2", "model.remat=dots"],
    "moe_dp4_tp2_dots": [MOE, MOE3, "parallelism.dp=4", "parallelism.tp=2", "model.remat=dots"],
    # multi-head latent attention
    "mla_dp8": [MLA, "parallelism.dp=8"],
    "mla_fsdp8": [MLA, "parallelism.dp=1", "parallelism.fsdp=8"],
    "mla_dp4_tp2": [MLA, "parallelism.dp=4", "parallelism.tp=2"],
    "mla_dp8_full": [MLA, "parallelism.dp=8", "model.remat=full"],
    "mla_dp8_dots": [MLA, "parallelism.dp=8", "model.remat=dots"],
    # pipelines: 1f1b (the default), gpipe, circular (2 stages per device)
    "pp2_1f1b": PP + ["parallelism.dp=4", "parallelism.pp_schedule=1f1b"],
    "pp2_gpipe": PP + ["parallelism.dp=4", "parallelism.pp_schedule=gpipe"],
    "pp2_dp4_z1": PP + ["parallelism.dp=4", "train.zero_stage=1"],
    "pp2_fsdp4": PP + ["parallelism.dp=1", "parallelism.fsdp=4"],
    "pp2_dp2_tp2": PP + ["parallelism.dp=2", "parallelism.tp=2"],
    "pp2_1f1b_full": PP + ["parallelism.dp=4", "model.remat=full"],
    "pp2_m8_l4": ["parallelism.pp=2", "train.microbatches=8", "parallelism.dp=4",
                  "train.batch_size=32", "model.n_layers=4"],  # stages of 2 layers
    "pp4_m8_l4": ["parallelism.pp=4", "train.microbatches=8", "parallelism.dp=2",
                  "model.n_layers=4"],
    "pp2_circular": PP + ["parallelism.dp=4", "parallelism.pp_schedule=circular",
                          "parallelism.pp_repeats=2", "model.n_layers=4"],
    # outside 5% (docs/experiments.md): kv heads repeated over tp=4, cp=4, dots at T=512,
    # gpipe under full remat (its peak is the gradients' reduction at the step's end),
    # 1f1b stages of two layers over fsdp or tp
    "dp2_tp4": ["parallelism.dp=2", "parallelism.tp=4"],
    "dp2_cp4": ["parallelism.dp=2", "parallelism.cp=4"],
    "fsdp8_b32_dots": ["parallelism.dp=1", "parallelism.fsdp=8", "train.batch_size=32",
                       "model.remat=dots"],
    "pp2_gpipe_full": PP + ["parallelism.dp=4", "parallelism.pp_schedule=gpipe",
                            "model.remat=full"],
    "pp2_fsdp4_l4": PP + ["parallelism.dp=1", "parallelism.fsdp=4", "model.n_layers=4"],
    "pp2_dp2_tp2_l4": PP + ["parallelism.dp=2", "parallelism.tp=2", "model.n_layers=4"],
    # MoE under dots remat with eight local experts, whose ragged dots' per-expert copies
    # (the CPU's) of the recomputed forward live beside the backward's, and over ep 8
    # mixture of experts under pp: the dense layer in the first stage (under gpipe its
    # lax.cond keeps the layer's weights and activations per tick), one MoE layer a stage
    "moe_pp2_1f1b": [MOE, MOE3] + PP + ["parallelism.dp=4"],
    "moe_pp2_gpipe_ep2": [MOE, MOE3] + PP + ["parallelism.dp=2", "parallelism.ep=2",
                                             "parallelism.pp_schedule=gpipe"],
    "moe_pp2_gpipe": [MOE, MOE3] + PP + ["parallelism.dp=4", "parallelism.pp_schedule=gpipe"],
    "moe_pp2_1f1b_ep2": [MOE, MOE3] + PP + ["parallelism.dp=2", "parallelism.ep=2"],
    "moe_dp8_dots": [MOE, MOE3, "parallelism.dp=8", "model.remat=dots"],
    "moe_ep8_dots": [MOE, MOE3, "parallelism.dp=1", "parallelism.ep=8", "model.remat=dots"],
    # MTP modules (two; one in the MoE model): on one stage, and on the last of a pipeline
    "mtp_dp8": ["parallelism.dp=8", "model.mtp_depth=2"],
    "mtp_pp2_1f1b": PP + ["parallelism.dp=4", "model.mtp_depth=2"],
    "mtp_pp2_gpipe": PP + ["parallelism.dp=4", "parallelism.pp_schedule=gpipe",
                           "model.mtp_depth=2"],
    "moe_mtp_pp2_1f1b": [MOE, MOE3] + PP + ["parallelism.dp=4", "model.mtp_depth=1"],
}
# the layer loop unrolled (model.unroll_layers, `jaxllm/plan/unrolled.py`): a layout above
# of the same name without "_unroll"
UNROLLED = ["dp8", "dp8_z2", "fsdp8", "dp4_fsdp2", "dp4_tp2", "dp4_tp2_sp", "dp4_cp2",
            "dp8_full", "dp8_dots", "fsdp8_full", "dp8_z2_full", "dp8_b64", "dp8_s128",
            "moe_dp8", "moe_ep8", "moe_ep4_dp2", "moe_dp4_tp2", "moe_ep8_full",
            "moe_ep4_fsdp2_dots", "mla_dp8", "mla_dp4_tp2", "mla_dp8_full", "mla_dp8_dots",
            # outside 5% (docs/planning.md): tp under full remat, MoE over ep x tp, MoE
            # under dots over dp, MoE over ep x fsdp
            "dp4_tp2_full", "moe_dp2_ep2_tp2", "moe_dp8_dots", "moe_ep4_fsdp2"]
CONFIGS.update({f"{name}_unroll": CONFIGS[name] + ["model.unroll_layers=true"]
                for name in UNROLLED})
# --gpu-memory: the one-GPU configs at four layers (the shares are a layer's), unrolled as
# the configs are and rolled, under each remat policy; a config path, then overrides
ONE_GPU = {"1b": "configs/llama_1b.yaml", "mla": "configs/deepseek_mla_1gpu.yaml",
           "moe": "configs/deepseek_moe_1gpu.yaml"}
GPU_LAYOUTS = {
    f"{model}_{remat}_b{batch}{'_rolled' if rolled else ''}":
        [ONE_GPU[model], "model.n_layers=4", f"model.remat={remat}",
         f"train.batch_size={batch}"] + (["model.unroll_layers=false"] if rolled else [])
    for model, remat, batch, rolled in [
        ("1b", "none", 8, False), ("1b", "none", 16, False), ("1b", "dots", 8, False),
        ("1b", "full", 8, False), ("1b", "none", 8, True), ("1b", "full", 8, True),
        ("mla", "none", 8, False), ("mla", "none", 8, True), ("moe", "dots", 8, False),
        ("moe", "dots", 8, True)]}
KNOWN_MISSES = ("dp2_tp4", "dp2_cp4", "fsdp8_b32_dots", "pp2_gpipe_full", "pp2_fsdp4_l4",
                "pp2_dp2_tp2_l4", "moe_dp8_dots", "moe_ep8_dots", "pp2_dp2_tp2",
                "dp4_tp2_full_unroll", "moe_dp2_ep2_tp2_unroll", "moe_dp8_dots_unroll",
                "moe_ep4_fsdp2_unroll")


def load(name: str):
    """The config of a CONFIGS entry."""
    from jaxllm.config import load_config

    overrides = CONFIGS[name]
    path = overrides[0] if overrides[0].endswith(".yaml") else "configs/tiny.yaml"
    return load_config(path, BASE + [o for o in overrides if not o.endswith(".yaml")])


def load_gpu(name: str):
    """The config of a GPU_LAYOUTS entry, on one device."""
    from jaxllm.config import load_config

    path, *overrides = GPU_LAYOUTS[name]
    return load_config(path, ["parallelism.dp=1", "checkpoint.enabled=false", *overrides])


def cpu_sweep(names: list[str], gpu: bool = False) -> list[dict]:
    """Planned against compiled peak memory per device for each layout: CONFIGS on the 8
    CPU devices, or with `gpu` GPU_LAYOUTS on one GPU (compiled, not run)."""
    import jax

    from benchmarks.common import print_table
    from jaxllm.plan.memory import compiled_peak, train_memory
    from jaxllm.sharding.memory import step_memory
    from jaxllm.sharding.mesh import mesh_shape
    from jaxllm.train.trainer import make_train_fns, sharding_plan

    rows = []
    for name in names:
        cfg = load_gpu(name) if gpu else load(name)
        t = time.perf_counter()
        plan = sharding_plan(cfg, devices=jax.devices()[:1] if gpu else None)
        fns = make_train_fns(cfg, plan.graphdef, plan)
        peak = compiled_peak(step_memory(fns.step, plan, fns.tx))
        mem = train_memory(cfg, mesh_shape(cfg.parallelism, 1 if gpu else jax.device_count()),
                           platform="gpu" if gpu else "cpu")
        rows.append({"config": name, "planned MB": mem.total / 2**20,
                     "compiled MB": peak / 2**20, "ratio": f"{mem.total / peak:.3f}",
                     "compile s": time.perf_counter() - t})
        print(rows[-1], flush=True)
    print_table(rows, title="peak memory per device: planner vs compiler ("
                            + ("one GPU" if gpu else "8 CPU devices") + ")")
    out = [r["config"] for r in rows if abs(float(r["ratio"]) - 1) >= 0.05]
    print(f"{len(rows) - len(out)} of {len(rows)} within 5%; outside: {', '.join(out) or '-'}"
          + ("" if gpu else "".join(f"; {c} is not a known miss" for c in out
                                    if c not in KNOWN_MISSES)))
    return rows


def _busy_s(k, hw) -> float:
    """A kernel's time at the datasheet's peak and HBM rate, its fixed cost left out."""
    return max(k.flops / hw.flops, k.bytes / hw.hbm_bw)


def _matmul_shapes(kernel_plan, hw, min_s: float = 2e-6) -> list[tuple[int, int, int, bool]]:
    """The (m, k, n, out_major) of the plan's matmuls that take at least `min_s` at the
    peak FLOP/s or HBM rate: those whose rate the kernel model reads from a measurement (a
    decode step's few-row products among them, which read their weights below the HBM
    rate; the smaller are mostly their fixed cost). out_major: the weights [n, k], as the
    decode program holds them (`inference/params.py`) for its prefill and decode steps;
    training's are [k, n]. A shape in both takes the decode program's layout."""
    def shapes(kts):
        return {k.shape for kt in kts for k in kt.kernels
                if k.rate == "matmul" and k.shape and _busy_s(k, hw) >= min_s}
    infer = shapes([kernel_plan.prefill, *kernel_plan.decode.values()])
    train = shapes([kernel_plan.train]) - infer
    return sorted([(*s, True) for s in infer] + [(*s, False) for s in train])


def _gmm_shapes(kernel_plan, hw, min_s: float = 2e-6) -> dict[tuple[int, ...], float]:
    """{(m, k, n, groups): planned FLOPs} of the prefill's and decode steps' grouped
    matmuls that take at least `min_s` at the peak FLOP/s or HBM rate (training's run at
    `gmm_flops`)."""
    kts = [kernel_plan.prefill, *kernel_plan.decode.values()]
    return {k.shape: k.flops for kt in kts for k in kt.kernels
            if k.rate == "gmm" and k.shape and _busy_s(k, hw) >= min_s}


def _gemv_shapes(kernel_plan) -> list[tuple[int, int, int]]:
    """The (m, k, n) of the decode steps' fused one-row products (`decode_gemv`), all of
    them (a layer's four)."""
    return sorted({k.shape for kt in kernel_plan.decode.values() for k in kt.kernels
                   if k.rate == "gemv" and k.shape})


def measure_ceilings(path: str, base: str, cfg=None, shapes=(), n: int = 8192,
                     copy_bytes: int = 4 << 30, cost_shapes=KERNEL_COST_SHAPES,
                     chain: tuple[int, int] = (64, 320), gmm_shapes: dict | None = None,
                     gemv_shapes=()) -> dict:
    """This device's ceilings into `path` (device 0): a bf16 n^3 matmul's FLOP/s, an HBM
    copy's bytes/s (read + write), the fixed cost of a kernel (`kernel_s`, `_kernel_cost`
    over `cost_shapes`), the host's time to launch one (`launch_s`, `_launch_cost` over
    `chain`), and with `cfg` the flash attention kernel's forward and backward FLOP/s at
    its training shape (the config's attention_impl), the grouped matmul's (forward +
    backward) at its experts' shape, and the FLOP/s of each matmul of `shapes` ((m, k, n,
    out_major)), of each grouped matmul shape of `gmm_shapes` ({(m, k, n, groups): the
    FLOPs the plan counts}) and of each fused decode product's of `gemv_shapes`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import time_fn
    from jaxllm.plan.hardware import save_measured

    a = jnp.ones((n, n), jnp.bfloat16)
    mm = time_fn(jax.jit(lambda x, y: x @ y), a, a)
    x = jnp.ones((copy_bytes // 4,), jnp.float32)
    cp = time_fn(jax.jit(lambda v: v + 1), x)
    out = {"flops": 2 * n**3 / mm, "hbm_bw": 2 * x.nbytes / cp}
    del a, x
    out["kernel_s"] = _kernel_cost(out["hbm_bw"], cost_shapes)
    out["launch_s"] = _launch_cost(chain)
    if cfg is not None:
        out.update(_attention_rates(cfg))
        if cfg.model.moe is not None:
            out["gmm_flops"] = _gmm_rate(cfg)
    fixed = out["kernel_s"]  # in each product's measured time, which the model adds apart
    rates = {f"{m}x{k}x{nn}": _matmul_rate(m, k, nn, fixed_s=fixed, out_major=major)
             for m, k, nn, major in shapes}
    if rates:
        out["matmul_shapes"] = rates
    grouped = {"x".join(map(str, shape)): _gmm_shape_rate(*shape, flops, fixed_s=fixed)
               for shape, flops in (gmm_shapes or {}).items()}
    if grouped:
        out["gmm_shapes"] = grouped
    fused = {f"{m}x{k}x{nn}": _gemv_rate(m, k, nn, fixed_s=fixed) for m, k, nn in gemv_shapes}
    if fused:
        out["gemv_shapes"] = fused
    save_measured(path, base, **out)
    print(f"measured ceilings -> {path}: {out['flops'] / 1e12:.0f} TFLOP/s, "
          f"{out['hbm_bw'] / 1e12:.2f} TB/s, {out['kernel_s'] * 1e6:.2f} us a kernel, "
          f"{out['launch_s'] * 1e6:.2f} us a launch"
          + "".join(f", {k} {out[k] / 1e12:.0f} TFLOP/s"
                    for k in ("attn_fwd", "attn_bwd", "gmm_flops") if k in out)
          + (f"; {len(rates)} matmul shapes, {min(rates.values()) / 1e12:.0f}-"
             f"{max(rates.values()) / 1e12:.0f} TFLOP/s" if rates else "")
          + "".join(f"; grouped {k} {v / 1e12:.0f} TFLOP/s" for k, v in grouped.items())
          + "".join(f"; fused decode {k} {v / 1e12:.1f} TFLOP/s" for k, v in fused.items()))
    return out


NOT_KERNELS = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")


def _kernels_of(compiled_text: str) -> int:
    """Kernels a compiled program launches, about: the instructions of its entry
    computation that are not parameters, constants, tuples or bitcasts (fusions, library
    calls, copies, ...); a while loop counts its condition's and body's kernels once (one
    iteration's), a call or conditional those of the computations it calls."""
    return sum(_kernel_kinds(compiled_text).values())


def _kernel_kinds(compiled_text: str) -> collections.Counter:
    """The kernels `_kernels_of` counts, by kind: a fusion's kind (loop, input: a
    reduction, output, or a custom fusion's own kind, e.g. a library matmul), a custom
    call's target, else the instruction's name (copy, dynamic-update-slice, ...)."""
    comps = {}  # computation name -> its text
    for block in re.split(r"\n(?=\S)", compiled_text):
        head = re.match(r"(ENTRY )?%?([\w.-]+)", block)
        if head and "{" in block:
            comps["ENTRY" if head.group(1) else head.group(2)] = block

    def kinds(name: str) -> collections.Counter:
        out = collections.Counter()
        for line in comps.get(name, "").splitlines():
            # the first "name(" after "= ": a tuple shape's parentheses follow no name
            op = re.search(r"= .*? ([a-z][\w-]*)\(", line)
            if op is None or op.group(1) in NOT_KERNELS:
                continue
            if op.group(1) in ("while", "call", "conditional"):
                called = re.findall(r"(?:condition|body|to_apply|branch_computations|"
                                    r"true_computation|false_computation)=\{?%?([\w.-]+)"
                                    r"(?:, %([\w.-]+))*", line)
                for c in (c for group in called for c in group if c):
                    out.update(kinds(c))
                continue
            kind = op.group(1)
            if kind == "fusion":
                fusion = re.search(r"kind=k(\w+)", line)
                custom = re.search(r'"kind":"([^"]+)"', line)
                kind = (custom.group(1) if custom and fusion and fusion.group(1) == "Custom"
                        else f"{fusion.group(1).lower()} fusion" if fusion else kind)
            elif kind == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                kind = target.group(1) if target else kind
            out[kind] += 1
        return out
    return kinds("ENTRY")


def _kernel_cost(hbm_bw: float, shapes=KERNEL_COST_SHAPES) -> float:
    """The fixed cost of a kernel in a stream of memory-bound kernels, the part of a
    kernel's time the model adds to its bytes at the HBM rate: for each (m, k, n) of
    `shapes`, the `_extra_time` of one more fused one-row product (`decode_gemv`, weights
    [n, k]) past its bytes at `hbm_bw`; the median. The products run behind the flush, so
    the host is ahead of the device as in a model's step. A chain of tiny dependent kernels
    (the way this was measured before) runs at the host's launch rate instead: it read
    1.6-1.8 us on one H100 and 2.6-3.2 us on another whose decode steps ran as fast."""
    from jaxllm.kernels.pallas.gemv_triton import decode_gemv

    costs = []
    for m, k, n in shapes:
        t = _extra_time(decode_gemv, ((m, k), (n, k)))
        costs.append(t - 2 * (m * k + n * k + m * n) / hbm_bw)
    return max(statistics.median(costs), 1e-8)


def _launch_cost(chain: tuple[int, int], repeats: int = 3) -> float:
    """The host's time to launch a kernel: two chains of tiny dependent steps (a sum, then
    a scale by it, on 4 KiB), called back to back, the longer one's extra time over its
    extra kernels (counted in the compiled programs); the median of `repeats` pairs. The
    device runs such a step in about 1 us, so the calls go at the host's pace where its
    launches take longer (it read 1.6-1.8 us a kernel on one H100 host, 2.6-3.2 on
    another)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import time_fn

    def program(steps):
        def f(v):
            for _ in range(steps):
                v = v * (1.0 + 1e-9 * jnp.sum(v))
            return v
        return jax.jit(f)
    v = jnp.ones((1024,), jnp.float32)
    fns = [program(steps) for steps in chain]
    kernels = [_kernels_of(fn.lower(v).compile().as_text()) for fn in fns]
    costs = []
    for _ in range(repeats):
        times = [time_fn(fn, v, target_s=0.2) for fn in fns]
        costs.append((times[1] - times[0]) / max(kernels[1] - kernels[0], 1))
    return max(statistics.median(costs), 1e-8)


def _compiled_kernels(dparams, batch: int, prompt_len: int, new_tokens: int, chunk: int,
                      hlo_dir: str | None = None) -> tuple[int | None, int]:
    """Kernels of the compiled prefill of `batch` prompts of `prompt_len` tokens (batch 1
    only, else None) and of one decode step (`decode_chunk` of one step, greedy) after it,
    as `generate_ids` runs them, each printed by kind; with `hlo_dir`, the compiled
    programs' text is written there (prefill_1.hlo, decode_B.hlo) to take apart off the
    GPU."""
    import jax
    import jax.numpy as jnp

    from jaxllm.inference.generate import decode_chunk, prefill
    from jaxllm.inference.step import round_up

    cache_len = round_up(prompt_len + new_tokens + chunk, 64)  # as generate_ids sizes it
    opts = dict(temperature=0.0, top_k=0, top_p=1.0)
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    lowered = prefill.lower(dparams, tokens, lengths, key, cache_len=cache_len, **opts)
    cache, token = lowered.out_info  # the decode step's inputs, as shapes
    step = decode_chunk.lower(dparams, cache, token, lengths, jax.ShapeDtypeStruct(
        (batch,), jnp.bool_), key, steps=1, eos_id=None, **opts)
    texts = {"decode": step.compile().as_text()}
    if batch == 1:
        texts["prefill"] = lowered.compile().as_text()
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        for name, text in texts.items():
            with open(os.path.join(hlo_dir, f"{name}_{batch}.hlo"), "w") as f:
                f.write(text)
    counts = {}
    for name, text in texts.items():
        kinds = _kernel_kinds(text)
        counts[name] = sum(kinds.values())
        print(f"compiled {name}, batch {batch}: {counts[name]} kernels: "
              + ", ".join(f"{k} {n}" for k, n in kinds.most_common()), flush=True)
    return counts.get("prefill"), counts["decode"]


def _call_cost(params, tokens, calls: int = 50) -> float:
    """The host's time for one call of a compiled program taking the model's decode
    parameters (every array passed, none pruned) and a prompt, to its first result read
    back: the median of `calls` calls of a program that adds one to a token."""
    import jax
    import numpy as np

    fn = jax.jit(lambda p, t: t[:1, :1] + 1, keep_unused=True)
    np.asarray(fn(params, tokens))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        np.asarray(fn(params, tokens))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _extra_time(product, shapes, reps: tuple[int, int] = (2, 10)) -> float:
    """Seconds one more `product(*operands)` adds to a compiled program of several, each on
    bf16 operands of `shapes` of its own (as a model's are: none shared for XLA to merge
    them by), so that a call's dispatch does not count. Each program also adds one to an
    array of FLUSH_BYTES: the products read their operands from HBM, not from the L2 cache
    the previous call left them in, and both programs run longer than their dispatch."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import time_fn

    n = len(shapes)

    flush = jnp.ones((FLUSH_BYTES // 4,), jnp.float32)

    def program(count):
        args = [jnp.full(shape, 1.0 + i, jnp.bfloat16) for i in range(count) for shape in shapes]
        f = jax.jit(lambda fl, *a: [fl + 1] + [product(*a[i:i + n])
                                              for i in range(0, len(a), n)])
        return time_fn(f, flush, *args, target_s=0.1)
    short, long_ = (program(r) for r in reps)
    return (long_ - short) / (reps[1] - reps[0])


def _matmul_rate(m: int, k: int, n: int, fixed_s: float = 0.0, out_major: bool = False
                 ) -> float:
    """FLOP/s of a bf16 [m, k] x [k, n] matmul, the weights held [n, k] where `out_major`.
    Above 1 TFLOP a call timed alone; below, its `_extra_time` less `fixed_s`, the fixed
    cost a kernel the model adds to it."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import time_fn

    flops = 2 * m * k * n

    def product(a, b):
        return a @ b.T if out_major else a @ b
    rhs = (n, k) if out_major else (k, n)
    if flops > 1e12:
        lhs, w = jnp.ones((m, k), jnp.bfloat16), jnp.ones(rhs, jnp.bfloat16)
        return flops / time_fn(jax.jit(product), lhs, w)
    return flops / max(_extra_time(product, ((m, k), rhs)) - fixed_s, 1e-9)


def _gmm_shape_rate(m: int, k: int, n: int, groups: int, flops: float,
                    fixed_s: float = 0.0) -> float:
    """The grouped matmul's forward ([m, k] x [groups, k, n], bf16, the kernel the model's
    prefill and decode pick), its rows spread over the groups as uniform routing spreads
    them (seeded): `flops` (the FLOPs the plan counts for it) over its `_extra_time` less
    `fixed_s`."""
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.kernels import grouped_matmul

    rows = np.random.default_rng(0).integers(0, groups, m)
    sizes = jnp.asarray(np.bincount(rows, minlength=groups), jnp.int32)
    t = _extra_time(lambda a, b: grouped_matmul(a, b, sizes), ((m, k), (groups, k, n)))
    return flops / max(t - fixed_s, 1e-9)


def _gemv_rate(m: int, k: int, n: int, fixed_s: float = 0.0) -> float:
    """FLOP/s of the fused decode product (`decode_gemv`, plain epilogue) of x [m, k] with
    weights [n, k], bf16: 2 m k n over its `_extra_time` less `fixed_s`."""
    from jaxllm.kernels.pallas.gemv_triton import decode_gemv

    t = _extra_time(decode_gemv, ((m, k), (n, k)))
    return 2 * m * k * n / max(t - fixed_s, 1e-9)


def _attention_rates(cfg) -> dict:
    """The flash kernel (model.attention_impl) at the training shape: forward FLOP/s, and
    the backward's 2.5x-forward FLOPs over the time fwd+bwd takes beyond the forward."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import time_fn
    from jaxllm.kernels import flash_attention
    from jaxllm.plan.kernel_time import attention_flops_fwd

    m, t = cfg.model, cfg.train
    dqk, dv = ((m.mla.qk_head_dim, m.mla.v_head_dim) if m.mla is not None
               else (m.resolved_head_dim, m.resolved_head_dim))
    hkv = m.n_heads if m.mla is not None else m.n_kv_heads
    keys = jax.random.split(jax.random.key(0), 3)
    b, s = t.batch_size, t.seq_len
    q = jax.random.normal(keys[0], (b, s, m.n_heads, dqk), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, dqk), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, dv), jnp.bfloat16)
    attn = lambda q, k, v: flash_attention(q, k, v, causal=True, impl=m.attention_impl)
    fwd = time_fn(jax.jit(attn), q, k, v)
    loss = lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum()
    both = time_fn(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)
    f = attention_flops_fwd(m, b, s, s, m.n_heads)
    return {"attn_fwd": f / fwd, "attn_bwd": 2.5 * f / max(both - fwd, 1e-9)}


def _gmm_rate(cfg) -> float:
    """The grouped matmul at an MoE layer's shape (its tokens x top_k rows in balanced
    groups, d x expert width): FLOP/s of forward + backward (3x the forward's FLOPs). The
    program returns the output with both gradients: the gradient of a sum of the output
    does not need the output, and XLA drops the forward product from it."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import time_fn
    from jaxllm.kernels import grouped_matmul

    m, t = cfg.model, cfg.train
    e = m.moe
    rows = t.batch_size * t.seq_len * e.top_k
    rows -= rows % e.num_experts
    lhs = jax.random.normal(jax.random.key(0), (rows, m.d_model), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(1), (e.num_experts, m.d_model, e.expert_mlp_dim),
                            jnp.bfloat16)
    sizes = jnp.full((e.num_experts,), rows // e.num_experts, jnp.int32)
    dout = jax.random.normal(jax.random.key(2), (rows, e.expert_mlp_dim), jnp.bfloat16)

    def fwd_bwd(a, w, dout):
        out, vjp = jax.vjp(lambda a, w: grouped_matmul(a, w, sizes), a, w)
        return out, vjp(dout)
    sec = time_fn(jax.jit(fwd_bwd), lhs, rhs, dout)
    return 3 * 2 * rows * m.d_model * e.expert_mlp_dim / sec


COLUMNS = ["what", "roofline", "kernel model", "measured", "measured / kernel",
           "measured / roofline", "bound", "kernels: model / compiled"]


def _row(what: str, roofline: float, kernel: float, measured: float, bound: str,
         kernels: tuple[float, int] | None = None) -> dict:
    row = {"what": what, "roofline": roofline, "kernel model": kernel, "measured": measured,
           "measured / kernel": measured / kernel, "measured / roofline": measured / roofline,
           "bound": bound}
    if kernels is not None:
        row["kernels: model / compiled"] = f"{kernels[0]:.0f} / {kernels[1]}"
    return row


def gpu_check(args) -> list[dict]:
    import jax
    import numpy as np
    from flax import nnx

    from benchmarks.common import print_table, time_fn
    from jaxllm import build_model, load_config
    from jaxllm.inference.generate import generate_ids
    from jaxllm.inference.params import decode_params
    from jaxllm.plan import get_hardware, plan
    from jaxllm.plan.hardware import save_measured
    from jaxllm.plan.memory import compiled_peak
    from jaxllm.sharding.memory import step_memory
    from jaxllm.train.trainer import init_state, sharding_plan

    if args.quick:  # a smoke test of the script on any device
        args.config, args.batches, args.prompt_len, args.new_tokens = (
            "configs/tiny.yaml", [1, 2], 32, 16)
        args.overrides = ["model.n_layers=2", "train.batch_size=4", "train.seq_len=64",
                          *args.overrides]
    chunk = 32  # the decode chunk generate_ids runs below
    cfg = load_config(args.config, ["parallelism.dp=1", "checkpoint.enabled=false",
                                    f"inference.max_new_tokens={args.new_tokens}",
                                    f"inference.decode_chunk={chunk}", *args.overrides])
    platform = jax.devices()[0].platform
    plan_args = dict(batches=args.batches, prompt_len=args.prompt_len, platform=platform)
    kernels, hw = plan(cfg, args.hardware, 1, **plan_args).kernels, get_hardware(args.hardware)
    ceilings = measure_ceilings(args.measured, args.hardware, cfg, _matmul_shapes(kernels, hw),
                                **(dict(n=512, copy_bytes=1 << 24, chain=(4, 8),
                                        cost_shapes=((1, 128, 128), (1, 128, 256)))
                                   if args.quick else {}),
                                gmm_shapes=_gmm_shapes(kernels, hw),
                                gemv_shapes=_gemv_shapes(kernels))
    p = plan(cfg, args.hardware, 1, measured=args.measured, **plan_args)
    rows = []

    # the train step, as the trainer runs it, on random tokens
    splan = sharding_plan(cfg, devices=jax.devices()[:1])
    _, params, opt_state, fns = init_state(cfg, splan)
    peak = compiled_peak(step_memory(fns.step, splan, fns.tx))
    rows.append({"what": "train step peak memory (GiB)",
                 "roofline": p.train_memory.total / 2**30, "measured": peak / 2**30,
                 "measured / roofline": peak / p.train_memory.total})
    rng = np.random.default_rng(0)
    t = cfg.train
    tok = rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1))
    batch = splan.place_batch({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    state = [params, opt_state]

    def step():
        state[0], state[1], metrics = fns.step(state[0], state[1], batch)
        return metrics["loss"]
    measured_step = time_fn(step, target_s=0.5, batches=3)
    rows.append(_row("train step (ms)", 1e3 * p.step_s, 1e3 * p.kernel_step_s,
                     1e3 * measured_step, p.bound))
    state.clear()  # the train state's buffers freed before the decode runs
    del params, opt_state

    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    dparams = decode_params(model, cfg)
    call_s = _call_cost(dparams, jax.numpy.zeros((1, p.prompt_len), jax.numpy.int32))
    save_measured(args.measured, args.hardware, **ceilings, call_s=call_s)
    print(f"measured call_s {1e3 * call_s:.3f} ms -> {args.measured}", flush=True)
    p = plan(cfg, args.hardware, 1, measured=args.measured, **plan_args)
    opts = dict(max_new_tokens=args.new_tokens, temperature=0.0, eos_id=None, chunk=chunk)
    for b in args.batches:
        prompts = rng.integers(0, min(256, cfg.model.vocab_size), (b, p.prompt_len)).tolist()
        generate_ids(dparams, prompts, warmup=True, **opts)
        # the median of TIMED_RUNS generations: the first after the warm-up one runs its
        # prefill slower (5.7 against 3.9 ms for the 1B's on an H100)
        runs = [generate_ids(dparams, prompts, warmup=False, **opts)[1]
                for _ in range(TIMED_RUNS)]
        timings = {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "tpot_s")}
        n_prefill, n_step = _compiled_kernels(dparams, b, p.prompt_len, args.new_tokens, chunk,
                                              args.hlo_dir)
        if b == 1:  # the planner's TTFT is one prompt's
            rows.append(_row(f"TTFT (ms) B={b}, prompt {p.prompt_len}", 1e3 * p.ttft_s,
                             1e3 * p.kernel_ttft_s, 1e3 * timings["ttft_s"],
                             p.prefill.bound(p.hardware),
                             (p.kernels.prefill.launches, n_prefill)))
        rows.append(_row(f"TPOT (ms) B={b}, context {p.context}", 1e3 * p.tpot_s[b],
                         1e3 * p.kernel_tpot_s[b], 1e3 * timings["tpot_s"],
                         p.decode[b].bound(p.hardware),
                         (p.kernels.decode[b].launches, n_step)))
        print(rows[-1], flush=True)
    print_table(rows, COLUMNS, title=f"planner ({p.hardware.name}): roofline and per-kernel "
                                     f"model vs measured: {args.config}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="memory sweep on 8 CPU devices")
    mode.add_argument("--gpu", action="store_true", help="times on this GPU")
    mode.add_argument("--gpu-memory", action="store_true",
                      help="compiled memory of GPU_LAYOUTS on this GPU")
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"--cpu: of {list(CONFIGS)}; --gpu-memory: of {list(GPU_LAYOUTS)}")
    ap.add_argument("--config", default="configs/llama_1b.yaml")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--measured", default="measured.yaml")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="--gpu on a tiny model (smoke test)")
    ap.add_argument("--hlo-dir", help="--gpu: write the compiled prefill and decode step there")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_sweep(args.configs or list(CONFIGS))
    if args.gpu_memory:
        return cpu_sweep(args.configs or list(GPU_LAYOUTS), gpu=True)
    return gpu_check(args)


if __name__ == "__main__":
    if "--cpu" in sys.argv:  # before jax starts: 8 devices, fast compiles
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   "platform_device_count=8 --xla_backend_optimization_level=0")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
