"""Where a jitted step's GPU time goes: its kernels traced and attributed to what they do.

    PYTHONPATH=. python benchmarks/step_profile.py [--config configs/llama_1b.yaml] [--steps 3]
        [--top 25] [--trace DIR] [config overrides ...]

Traces --steps calls of the trainer's jitted train step (`train.trainer.make_train_fns`, on
random tokens, after a warm-up call) and attributes every GPU kernel to a category through
the compiled HLO: each kernel is annotated in the trace with the HLO instruction that
launched it, and that instruction's metadata names the JAX operation and its scope (the
named scopes the model, kernels and trainer open: flash_attention, rms_norm, rope,
cross_entropy, optimizer). Categories, first match wins:

    attention   the flash_attention entry point's kernels (cuDNN, Pallas, XLA)
    matmul      dot products (cuBLAS, cuBLASLt, CUTLASS, XLA's Triton GEMMs, grouped matmuls)
    optimizer   the optimizer's update and apply (optax), gradient clipping included
    loss        the cross-entropy over the vocabulary (not the head's matmul)
    norm        RMSNorm forward and backward
    rope        rotary embeddings
    copy        copies, transposes, dynamic slices and updates, concatenates
    other       everything else (residual adds, activations, RoPE, reductions, casts)

It prints per category: GPU time a step, its share of the summed kernel time, kernel count;
then the step's wall time (`time_fn`), kernel time and idle gaps, and the --top kernels.
Traced, XLA launches every kernel on its own rather than through its command buffers
(`--xla_enable_command_buffers_during_profiling` is off by default): the kernels' times
are the step's, the trace's span and gaps are not; the wall time is timed untraced.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile

CATEGORIES = ("attention", "matmul", "optimizer", "loss", "norm", "rope", "copy", "other")
_RULES = (  # (category, regex on "kernel name | hlo opcode | custom-call target | op_name")
    ("attention", r"flash|fmha|cudnn|sdpa|dot_product_attention"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|\| dot\b|dot_general|ragged_dot|grouped_matmul|gmm"),
    ("optimizer", r"optimizer"),
    ("loss", r"cross_entropy"),
    ("norm", r"rms_norm"),
    ("rope", r"\brope\b"),
    ("copy", r"\| (copy|transpose|dynamic-slice|dynamic-update-slice|concatenate|slice|pad)\b"
             r"|memcpy|memset"),
)


def hlo_index(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> "opcode | custom-call target | metadata op_name"."""
    out = {}
    pat = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\s([\w\-]+)\(")
    for line in hlo_text.splitlines():
        m = pat.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', line)
        op_name = re.search(r'op_name="([^"]+)"', line)
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        out[name] = " | ".join([opcode, target.group(1) if target else "",
                                op_name.group(1) if op_name else "",
                                calls.group(1) if calls else ""])
    return out


def categorise(kernel: str, info: str) -> str:
    text = f"{kernel} | {info}".lower()
    for cat, rule in _RULES:
        if re.search(rule, text):
            return cat
    return "other"


def trace_kernels(trace_dir: str) -> list[tuple[str, str, int, int]]:
    """(kernel name, HLO op, start ns, duration ns) of the kernels in the trace. On a GPU
    the HLO op is the "XLA Ops" annotation spanning the kernel's start; on the CPU (a smoke
    test) the thunks of HLO ops stand in for kernels."""
    import bisect

    import jax

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit(f"no trace written under {trace_dir}")
    planes = list(jax.profiler.ProfileData.from_file(paths[0]).planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    out = []
    for plane in gpu or [p for p in planes if p.name == "/host:CPU"]:
        ops = sorted((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name)
                     for line in plane.lines if line.name == "XLA Ops" for ev in line.events)
        starts = [o[0] for o in ops]
        for line in plane.lines:
            if gpu and line.name.startswith("XLA"):  # annotations of the kernels below
                continue
            for ev in line.events:
                hlo = dict(ev.stats).get("hlo_op")
                if not gpu and not hlo:
                    continue
                if gpu:
                    i = bisect.bisect_right(starts, ev.start_ns) - 1
                    hlo = ops[i][2] if i >= 0 and ev.start_ns < ops[i][1] else ""
                out.append((ev.name, str(hlo), ev.start_ns, ev.duration_ns))
    return out


def op_info(index: dict[str, str], kernel: str, hlo: str) -> str:
    """The HLO instruction behind a kernel: by its annotation, else by the kernel's name
    (XLA names a fusion's kernel after the fusion, "." written "_")."""
    name = re.sub(r"^%", "", hlo).split(" ")[0].split(":")[0]
    if name in index:
        return index[name]
    return index.get(re.sub(r"_(\d+)$", r".\1", kernel), index.get(kernel, hlo))


def breakdown(fn, args, hlo_text: str, steps: int, trace_dir: str, top: int) -> list[dict]:
    import jax

    from benchmarks.common import print_table
    from benchmarks.decode import busy_ns

    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            out = fn(*args)
        jax.block_until_ready(out)
    kernels = trace_kernels(trace_dir)
    index = hlo_index(hlo_text)
    per = collections.defaultdict(lambda: [0, 0])
    names = collections.defaultdict(lambda: [0, 0, ""])
    for name, hlo, _, dur in kernels:
        info = op_info(index, name, hlo)
        cat = categorise(name, info)
        per[cat][0] += dur
        per[cat][1] += 1
        n = names[(name[:60], cat)]
        n[0] += dur
        n[1] += 1
        n[2] = n[2] or (info.split(" | ") + ["", ""])[2][-70:]
    total = sum(v[0] for v in per.values())
    span = (max(s + d for _, _, s, d in kernels) - min(s for _, _, s, _ in kernels))
    rows = [{"category": c, "ms / step": per[c][0] / 1e6 / steps,
             "share %": 100 * per[c][0] / total, "kernels / step": per[c][1] / steps}
            for c in CATEGORIES if c in per]
    rows.append({"category": "sum of kernels", "ms / step": total / 1e6 / steps,
                 "share %": 100.0, "kernels / step": len(kernels) / steps})
    rows.append({"category": "busy (union)", "ms / step": busy_ns(
        [(n, s, d) for n, _, s, d in kernels]) / 1e6 / steps})
    rows.append({"category": "trace span", "ms / step": span / 1e6 / steps})
    print_table([{"kernel": k[0], "category": k[1], "ms / step": v[0] / 1e6 / steps,
                  "calls / step": v[1] / steps, "op": v[2]}
                 for k, v in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]],
                title="longest kernels")
    return rows


def main(argv=None) -> list[dict]:
    import jax
    import numpy as np

    from benchmarks.common import print_table, time_fn
    from jaxllm import load_config
    from jaxllm.train.trainer import init_state, sharding_plan

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/llama_1b.yaml")
    ap.add_argument("--steps", type=int, default=3, help="steps traced")
    ap.add_argument("--top", type=int, default=25, help="kernels listed")
    ap.add_argument("--trace", help="keep the trace here (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="config overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, ["parallelism.dp=1", "checkpoint.enabled=false",
                                    *args.overrides])
    plan = sharding_plan(cfg, devices=jax.devices()[:1])
    _, params, opt_state, fns = init_state(cfg, plan)
    t = cfg.train
    tok = np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                            (t.batch_size, t.seq_len + 1))
    batch = plan.place_batch({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    hlo = fns.step.lower(params, opt_state, batch).compile().as_text()
    # the step donates its state: feed each call's outputs to the next
    state = [params, opt_state]

    def step(_=None):
        state[0], state[1], metrics = fns.step(state[0], state[1], batch)
        return metrics["loss"]
    wall = time_fn(step, target_s=0.5, batches=3)
    with tempfile.TemporaryDirectory(prefix="profile_") as tmp:
        rows = breakdown(step, (None,), hlo, args.steps, args.trace or tmp, args.top)
    rows.append({"category": "wall (time_fn)", "ms / step": 1e3 * wall})
    print_table(rows, title=f"train step by category: {args.config} {' '.join(args.overrides)}")
    return rows


if __name__ == "__main__":
    main()
