"""Where a decode step's time goes: GPU kernels per step, their time, and the idle gaps.

    PYTHONPATH=. python benchmarks/decode_profile.py [--config configs/llama_1b.yaml]
        [--batch 1] [--prompt-len 1024] [--chunk 32] [--top 25] [--tuned JSON]
        [--timeline N]

Builds the model from the config (random weights: speed does not depend on them), prefills
a random prompt, compiles `decode.decode_chunk` (as `generate_ids` runs it), then traces one chunk of `--chunk` decode
steps with `jax.profiler` and reads the trace back (`jax.profiler.ProfileData`). Printed:
wall time per step, the summed kernel time per step (GPU busy time), kernel launches per
step, the kernels that take the most time, grouped by HLO op or kernel name, and the idle
gaps between kernels (by size, the largest with their neighbours; --timeline N lists N
kernels in order). A step whose busy time is far below its wall time is bound by
launches and gaps, not by HBM.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import load_config
from jaxllm.inference.decode import decode_steps, inference_params
from jaxllm.model import build_model


def kernel_events(trace_dir: str):
    """[(line name, event name, start ns, duration ns)] of the GPU planes in the trace."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit(f"no trace written under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(paths[0])
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                out.append((line.name, ev.name, ev.start_ns, ev.duration_ns))
    return out


def busy_ns(events) -> int:
    """Length of the union of [start, start + duration) intervals."""
    total, end = 0, -1
    for start, dur in sorted((s, d) for _, _, s, d in events):
        stop = start + dur
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/llama_1b.yaml")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeline", type=int, default=0,
                    help="also print this many consecutive kernels with their gaps")
    ap.add_argument("--stacked", action="store_true", help="keep the scanned layer stack")
    ap.add_argument("--no-fuse", action="store_true", help="keep q/k/v and gate/up separate")
    ap.add_argument("--tuned", default=None,
                    help='launch settings of the fused decode kernels as JSON, e.g. '
                         '\'{"split_counters": false}\' (gemv_triton.TUNED)')
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.tuned:
        from benchmarks.decode_matmul import apply_tuned
        apply_tuned(json.loads(args.tuned))
    cfg = load_config(args.config, args.overrides)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; batch {args.batch}, "
          f"prompt {args.prompt_len}, chunk {args.chunk}, "
          f"{'stacked' if args.stacked else 'per-layer'} weights"
          f"{'' if args.stacked or args.no_fuse else ', q/k/v and gate/up fused'}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = inference_params(model, cfg, unstack=not args.stacked,
                                        fuse=not args.no_fuse)
    del model
    rng = np.random.default_rng(0)
    b, plen = args.batch, args.prompt_len
    tokens = jnp.asarray(rng.integers(0, 256, (b, plen)), jnp.int32)
    lengths = jnp.full((b,), plen, jnp.int32)
    cache_len = -(-(plen + 4 * args.chunk) // 64) * 64
    opts = dict(temperature=0.0, top_k=0, top_p=1.0)
    prefill, decode_chunk = decode_steps(graphdef)
    cache, tok = prefill(params, tokens, lengths, jax.random.key(0), cache_len=cache_len,
                         **opts)
    state = (cache, tok, lengths, jnp.zeros(b, bool), jax.random.key(1))
    step_opts = dict(opts, eos_id=None, steps=args.chunk)
    for _ in range(2):  # compile, then one warm chunk
        state = decode_chunk(params, *state, **step_opts)[:5]
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = decode_chunk(params, *state, **step_opts)[:5]
    jax.block_until_ready(state)
    wall = (time.perf_counter() - t0) / args.chunk

    hlo = decode_chunk.lower(params, *state, **step_opts).compile().as_text()
    trace_dir = tempfile.mkdtemp(prefix="decode_trace_")
    with jax.profiler.trace(trace_dir):
        state = decode_chunk(params, *state, **step_opts)[:5]
        jax.block_until_ready(state)
    events = kernel_events(trace_dir)
    lines = collections.Counter(line for line, *_ in events)
    print("trace lines (events):", dict(lines), flush=True)
    # kernel lines are the CUDA streams; "XLA Ops"/"XLA Modules" lines annotate them
    kernels = [e for e in events if not e[0].startswith("XLA") and "Memcpy" not in e[1]]
    ops = [e for e in events if e[0] == "XLA Ops"]
    n = args.chunk
    busy = busy_ns(kernels) / n / 1e3
    print(f"\nwall per step {1e6 * wall:.1f} us; GPU busy per step {busy:.1f} us "
          f"({100 * busy / (1e6 * wall):.0f}%); kernels per step {len(kernels) / n:.1f}")
    by_layer = cfg.model.n_layers
    print(f"per layer: {1e6 * wall / by_layer:.1f} us wall, {busy / by_layer:.1f} us busy, "
          f"{len(kernels) / n / by_layer:.1f} kernels")
    for title, evs in (("HLO ops", ops), ("kernels", kernels)):
        agg = collections.defaultdict(lambda: [0, 0])
        for _, name, _, dur in evs:
            key = name.split(".")[0] if title == "HLO ops" else name[:70]
            agg[key][0] += 1
            agg[key][1] += dur
        rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[:args.top]
        print(f"\n| {title} (top {args.top}) | calls/step | us/step | us/call |")
        print("| --- | --- | --- | --- |")
        for name, (count, dur) in rows:
            print(f"| {name} | {count / n:.1f} | {dur / n / 1e3:.2f} | {dur / count / 1e3:.2f} |")
    print("\nWhat the top kernels compute (result shape; the jax ops fused into them):")
    for name, _ in rows[:12]:
        print(f"  {name}: {describe_kernel(hlo, name)}")
    print_gaps(kernels, n, args.timeline)


def print_gaps(kernels, steps: int, timeline: int):
    """Idle time between consecutive kernels: per step, by size, the largest gaps with
    the kernels on either side; with `timeline`, that many kernels from the middle of
    the trace in order (start offset, gap before, duration)."""
    evs = sorted((start, dur, name) for _, name, start, dur in kernels)
    gaps = []  # (gap ns, index of the kernel after it)
    end = evs[0][0] + evs[0][1]
    for i, (start, dur, _) in enumerate(evs[1:], 1):
        gaps.append((max(0, start - end), i))
        end = max(end, start + dur)
    total = sum(g for g, _ in gaps) / steps / 1e3
    print(f"\nidle between kernels: {total:.1f} us per step over {len(gaps) / steps:.1f} gaps")
    for lo, hi in ((0, 1e3), (1e3, 2e3), (2e3, 5e3), (5e3, 2e4), (2e4, 1e12)):
        sel = [g for g, _ in gaps if lo <= g < hi]
        label = f"{lo / 1e3:g}-{hi / 1e3:g}" if hi < 1e12 else f"{lo / 1e3:g}+"
        print(f"  gaps {label} us: {len(sel) / steps:.1f} per step, "
              f"{sum(sel) / steps / 1e3:.1f} us per step")
    print("largest gaps (us: kernel before -> kernel after):")
    for g, i in sorted(gaps, reverse=True)[:8]:
        print(f"  {g / 1e3:.1f}: {evs[i - 1][2][:50]} -> {evs[i][2][:50]}")
    if timeline:
        mid = max(0, len(evs) // 2 - timeline // 2)
        t0 = evs[mid][0]
        print(f"\n| kernel (from the middle of the trace) | start us | gap before us | us |")
        print("| --- | --- | --- | --- |")
        for j in range(mid, min(len(evs), mid + timeline)):
            start, dur, name = evs[j]
            gap = gaps[j - 1][0] if j else 0
            print(f"| {name[:60]} | {(start - t0) / 1e3:.1f} | {gap / 1e3:.1f} | "
                  f"{dur / 1e3:.1f} |")


def describe_kernel(hlo: str, name: str) -> str:
    """Result shape and source op names of the HLO instruction behind kernel `name`."""
    base, _, num = name.rpartition("_")  # kernel gemm_fusion_dot_12 is HLO gemm_fusion_dot.12
    names = {name, f"{base}.{num}"} if num.isdigit() else {name}
    lines = hlo.splitlines()

    def inst(line):
        text = line.strip().removeprefix("ROOT ").lstrip("%")
        return text.split(" = ")[0], text

    for line in lines:
        iname, text = inst(line)
        if iname not in names or " = " not in text:
            continue
        shape = text.split(" = ", 1)[1].split(" ")[0]
        calls = re.search(r"calls=%?([\w.\-]+)", text)
        ops = re.findall(r'op_name="([^"]+)"', text)
        if calls:  # collect the op names inside the fused computation
            head = re.compile(rf"^%?{re.escape(calls.group(1))}\s")
            inside = False
            for ln in lines:
                if head.match(ln.strip()):
                    inside = True
                elif inside and ln.strip() == "}":
                    break
                elif inside:
                    ops += re.findall(r'op_name="([^"]+)"', ln)
        short = sorted({o.split("/")[-1] for o in ops})
        return f"{shape}; {', '.join(short[:8]) or '?'}"
    return "(not in the compiled HLO)"


if __name__ == "__main__":
    main()
