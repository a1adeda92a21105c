"""FlashAttention kernels against their anchors, all in one run: throughput in interleaved
rounds (the default), forward accuracy (--accuracy), throughput at the power cap
(--sustained).

Implementations: jaxllm's `pallas_mosaic` and `pallas_triton`, cuDNN, XLA einsums
("xla"), the jnp reference, JAX's own Pallas Triton `mha` ("jax_pallas_mha": no GQA, so
K/V are repeated to Hq heads before timing), the `pallas_mosaic` variants of VARIANTS
(its remaining choices; the defaults depend on the mask and head dim) and, with
--sustained, "gemm": a bf16 XLA matmul of about the full-mask forward's FLOPs.

Conventions: FLOPs = 4 B Hq Sq Skv D, halved when causal; fwd+bwd counts 3.5x that. A
time is the median over batches of back-to-back jitted calls; the implementations of a
shape are timed in --rounds interleaved rounds, a figure is the median over rounds and
"x cudnn" the median per-round ratio to cuDNN. rel_err is ||o - ref|| / ||ref|| of the
forward against the float32 reference on up to 4 query heads, grad_err the largest such
error of dq, dk and dv (those heads and their KV heads) of <o, dO>.

  PYTHONPATH=. python benchmarks/attention.py                # headline: D 128 GQA 4, D 256, D 64
  PYTHONPATH=. python benchmarks/attention.py --grid --seqs 1024,4096
  PYTHONPATH=. python benchmarks/attention.py --variants "mosaic running-max,mosaic grid"
  PYTHONPATH=. python benchmarks/attention.py --accuracy [--dims 64,128,256 --q-scales 1,4]
  PYTHONPATH=. python benchmarks/attention.py --sustained [--seconds 3 --reps 2]
  PYTHONPATH=. python benchmarks/attention.py --quick        # CPU smoke test, tiny shapes
"""
from __future__ import annotations

import argparse
import functools
import itertools
import shutil
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp

from benchmarks.common import add_args, interleaved, print_table, speedup, time_fn, write_json
from jaxllm.kernels import flash_attention, reference

# (B, S, Hq, Hkv, D): the headline shape, then D 256 and D 64 with MHA
HEADLINE = [(4, 4096, 32, 8, 128), (2, 8192, 32, 32, 256), (8, 2048, 32, 32, 64)]
QUICK = [(1, 64, 2, 1, 64)]  # CPU: interpret mode
GPU_IMPLS = ["pallas_mosaic", "cudnn", "pallas_triton", "xla", "jax_pallas_mha"]
CPU_IMPLS = ["reference", "xla", "pallas_triton"]
VARIANTS = {  # name -> pallas_mosaic options over its defaults
    "mosaic running-max": dict(fixed_max=False),  # cuDNN's error with peaked rows
    "mosaic pingpong": dict(schedule="pingpong"),
    "mosaic overlapped": dict(schedule="overlapped"),
    "mosaic grid": dict(persistent=False, persistent_dq=False),  # one CTA a work item
    "mosaic serial-bwd": dict(overlap_bwd=False),
    "mosaic bk64": dict(block_kv=64),
}
XLA_MAX_S = 4096  # above this the einsums' S x S scores take too much memory


def attention_flops(b, hq, sq, skv, d, causal):
    f = 4 * b * hq * sq * skv * d
    return f / 2 if causal else f


def _jax_pallas_mha(q, k, v, *, causal, sm_scale):
    from jax.experimental.pallas.ops.gpu import attention as jax_attention
    return jax_attention.mha(q, k, v, None, sm_scale=sm_scale, causal=causal)


def make_impl(name):
    """name -> fn(q, k, v, *, causal, sm_scale), and whether it wants K/V repeated to Hq."""
    if name == "jax_pallas_mha":
        return _jax_pallas_mha, True
    if name in VARIANTS:
        return functools.partial(flash_attention, impl="pallas_mosaic", **VARIANTS[name]), False
    return functools.partial(flash_attention, impl=name), False


def _inputs(b, s, hq, hkv, d, seed=0, q_scale=1.0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = (q_scale * jax.random.normal(ks[0], (b, s, hq, d), jnp.float32)).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, s, hq, d), jnp.bfloat16)
    return q, k, v, do


def _error(e) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__


def rel_error(o, q, k, v, causal):
    """||o - ref|| / ||ref|| against the float32 reference on <= 4 query heads."""
    g = q.shape[2] // k.shape[2]
    nkv = max(1, 4 // g)
    with jax.default_matmul_precision("highest"):
        ref = reference.flash_attention(*(x.astype(jnp.float32) for x in
                                          (q[:, :, :nkv * g], k[:, :, :nkv], v[:, :, :nkv])),
                                        causal=causal)
    o = o[:, :, :nkv * g].astype(jnp.float32)
    return float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))


def reference_grads(q, k, v, do, causal):
    """The float32 reference's dq, dk, dv of <o, dO> on <= 4 query heads (whole GQA
    groups) and their KV heads: what grad_error compares against."""
    g = q.shape[2] // k.shape[2]
    nkv = max(1, 4 // g)

    def loss(q, k, v):
        return jnp.vdot(reference.flash_attention(q, k, v, causal=causal),
                        do[:, :, :nkv * g].astype(jnp.float32))

    with jax.default_matmul_precision("highest"):
        return jax.grad(loss, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (
            q[:, :, :nkv * g], k[:, :, :nkv], v[:, :, :nkv])))


def grad_error(grads, ref, hkv: int, repeated: bool):
    """The largest ||g - ref|| / ||ref|| of dq, dk and dv against reference_grads' `ref`
    (on its heads); `repeated`: dk and dv are of K/V repeated to every query head (summed
    back over each group of the hkv KV heads here)."""
    dq, dk, dv = (x.astype(jnp.float32) for x in grads)
    if repeated:
        g = dq.shape[2] // hkv
        dk, dv = (x.reshape(*x.shape[:2], hkv, g, x.shape[-1]).sum(3) for x in (dk, dv))
    nq, nkv = ref[0].shape[2], ref[1].shape[2]
    got = (dq[:, :, :nq], dk[:, :, :nkv], dv[:, :, :nkv])
    return max(float(jnp.linalg.norm(x - r) / jnp.linalg.norm(r)) for x, r in zip(got, ref))


def bench_shape(shape, causal, impls, rounds, batches=5, target_s=0.03):
    """One row per implementation: compiled and checked first, then fwd and fwd+bwd timed
    in interleaved rounds."""
    b, s, hq, hkv, d = shape
    q, k, v, do = _inputs(b, s, hq, hkv, d, seed=s + hkv + d + causal)
    flops = attention_flops(b, hq, s, s, d, causal)
    rows, timers, ref_grads = {}, {}, None  # the reference's gradients, once a shape
    for name in impls:
        row = rows[name] = dict(b=b, s=s, hq=hq, hkv=hkv, d=d,
                                mask="causal" if causal else "full", impl=name)
        if name == "xla" and s > XLA_MAX_S:
            row["note"] = "skipped: S x S scores"
            continue
        fn, repeat = make_impl(name)
        kk, vv = (jnp.repeat(k, hq // hkv, 2), jnp.repeat(v, hq // hkv, 2)) if repeat else (k, v)
        f = jax.jit(functools.partial(fn, causal=causal, sm_scale=d ** -0.5))

        def loss(q, k, v, do, f=f):  # do is an argument: a closed-over constant gets folded
            return jnp.vdot(f(q, k, v).astype(jnp.float32), do.astype(jnp.float32))

        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        try:
            row["rel_err"] = rel_error(f(q, kk, vv), q, k, v, causal)
            grads = g(q, kk, vv, do)
            if ref_grads is None:
                ref_grads = reference_grads(q, k, v, do, causal)
            row["grad_err"] = grad_error(grads, ref_grads, hkv, repeat)
        except Exception as e:  # noqa: BLE001  one failing impl must not hide the others
            row["error"] = _error(e)
            continue
        for kind, fn_, args in (("fwd", f, (q, kk, vv)), ("fwdbwd", g, (q, kk, vv, do))):
            timers[(name, kind)] = functools.partial(time_fn, fn_, *args, batches=batches,
                                                     target_s=target_s)

    def on_error(key, e):
        rows[key[0]]["error"] = _error(e)

    samples = interleaved(timers, rounds, on_error)
    for (name, kind), ts in samples.items():
        row = rows[name]
        if "error" in row:  # its other kind failed: no half-timed rows
            continue
        t = statistics.median(ts)
        row[f"{kind}_ms"] = t * 1e3
        row[f"{kind}_tflops"] = (3.5 if kind == "fwdbwd" else 1.0) * flops / t / 1e12
        if ("cudnn", kind) in samples:
            row[f"{kind}_x_cudnn"] = speedup(samples[("cudnn", kind)], ts)
    return list(rows.values())


def run_accuracy(dims, q_scales, impls, b, s, hq, hkv):
    """Max and mean |o - reference| of the forward, plain and peaked queries."""
    rows = []
    for d, causal, qs in itertools.product(dims, (False, True), q_scales):
        q, k, v, _ = _inputs(b, s, hq, hkv, d, seed=d + causal, q_scale=qs)
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(functools.partial(reference.flash_attention, causal=causal))(
                *(x.astype(jnp.float32) for x in (q, k, v)))
        for name in impls:
            fn, repeat = make_impl(name)
            kk, vv = (jnp.repeat(k, hq // hkv, 2), jnp.repeat(v, hq // hkv, 2)) if repeat \
                else (k, v)
            row = dict(d=d, mask="causal" if causal else "full", q_scale=qs, impl=name)
            try:
                err = jnp.abs(jax.jit(functools.partial(fn, causal=causal, sm_scale=d ** -0.5))(
                    q, kk, vv).astype(jnp.float32) - ref)
                row.update(max_err=float(err.max()), mean_err=float(err.mean()))
            except Exception as e:  # noqa: BLE001  keep going
                row["error"] = _error(e)
            rows.append(row)
    return rows


class _Sampler:
    """nvidia-smi's SM clock, power and throttle reasons every 0.2 s while active."""
    QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"

    def __init__(self, settle: float):
        self.settle, self.samples, self._stop = settle, [], threading.Event()

    def _run(self):
        t0 = time.time()
        while not self._stop.wait(0.2):
            out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={self.QUERY}",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True)
            try:
                clk, pw, thr = (x.strip() for x in out.stdout.strip().splitlines()[0].split(","))
            except (ValueError, IndexError):
                continue
            if time.time() - t0 >= self.settle:
                self.samples.append((int(clk), float(pw), int(thr, 16) & 0x4 != 0))

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_sustained(shape, impls, seconds, reps):
    """Each forward loops alone for `seconds`, `reps` times in turn, nvidia-smi sampled:
    time, clock and power at the board's power limit, speed and speed a cycle x the first."""
    b, s, hq, hkv, d = shape
    q, k, v, _ = _inputs(b, s, hq, hkv, d)
    n = max(256, round((attention_flops(b, hq, s, s, d, False) / 2) ** (1 / 3) / 256) * 256)
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    gemm = jax.jit(lambda x: x @ x)
    fns = {}
    for mask, name in itertools.product(("full", "causal"), impls):
        if name == "gemm":
            fns[(mask, name)] = (functools.partial(gemm, a), (), 2 * n ** 3)
            continue
        fn, repeat = make_impl(name)
        kk, vv = (jnp.repeat(k, hq // hkv, 2), jnp.repeat(v, hq // hkv, 2)) if repeat else (k, v)
        f = jax.jit(functools.partial(fn, causal=mask == "causal", sm_scale=d ** -0.5))
        fns[(mask, name)] = (f, (q, kk, vv), attention_flops(b, hq, s, s, d, mask == "causal"))
    for f, args, _ in fns.values():
        jax.block_until_ready(f(*args))
    res = {key: ([], []) for key in fns}
    for _ in range(reps):
        for key, (f, args, _) in fns.items():
            calls, t_end = 0, time.time() + seconds
            with _Sampler(settle=1.0) as smp:
                t0 = time.perf_counter()
                while time.time() < t_end:
                    for _ in range(10):
                        out = f(*args)
                    jax.block_until_ready(out)
                    calls += 10
                res[key][0].append((time.perf_counter() - t0) / calls)
            res[key][1].extend(smp.samples)
    rows, first = [], {}
    for (mask, name), (times, smp) in res.items():
        t = statistics.median(times)
        clk = statistics.median(x[0] for x in smp) if smp else float("nan")
        tfl = fns[(mask, name)][2] / t / 1e12
        f0 = first.setdefault(mask, (tfl, clk))
        rows.append(dict(mask=mask, impl=name, us=t * 1e6, tflops=tfl, sm_mhz=clk,
                         power_w=statistics.median(x[1] for x in smp) if smp else None,
                         power_capped=f"{sum(x[2] for x in smp)}/{len(smp)}",
                         x_first=tfl / f0[0], clock_x_first=clk / f0[1],
                         cycle_x_first=(tfl / f0[0]) / (clk / f0[1])))
    return rows


def _names(text, allowed):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"unknown implementations {unknown}; choose from {sorted(allowed)}")
    return names


def _shape(text):
    try:
        b, s, hq, hkv, d = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"a shape is B,S,Hq,Hkv,D (five integers); got {text!r}")
    return b, s, hq, hkv, d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--grid", action="store_true", help="B*S = 16384 over --seqs, Hkv 32 "
                      "and 8, D 64 and 128 (Hq 32)")
    mode.add_argument("--accuracy", action="store_true", help="forward error, plain and peaked Q")
    mode.add_argument("--sustained", action="store_true", help="each forward alone at the power "
                      "cap, nvidia-smi sampled (the first shape)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke test: tiny shapes, reference / xla / pallas_triton, 1 round")
    ap.add_argument("--impls", help="comma-separated implementations (default: all that apply)")
    ap.add_argument("--variants", default="", help="pallas_mosaic variants to add: " +
                    ", ".join(VARIANTS))
    ap.add_argument("--shapes", help="B,S,Hq,Hkv,D[;B,S,Hq,Hkv,D...] instead of the headline's")
    ap.add_argument("--seqs", default="1024,4096,16384", help="--grid: sequence lengths")
    ap.add_argument("--masks", default="causal,full")
    ap.add_argument("--dims", default="64,128,256", help="--accuracy: head dims")
    ap.add_argument("--q-scales", default="1,4", help="--accuracy: factors on Q (peaked rows)")
    ap.add_argument("--seconds", type=float, default=3.0, help="--sustained: seconds a kernel")
    ap.add_argument("--reps", type=int, default=2, help="--sustained: repetitions")
    add_args(ap, rounds=5)
    args = ap.parse_args()
    known = set(GPU_IMPLS) | set(CPU_IMPLS) | set(VARIANTS) | {"gemm"}
    impls = _names(args.impls, known) if args.impls else \
        (CPU_IMPLS if args.quick else GPU_IMPLS) + _names(args.variants, set(VARIANTS))
    masks = [m == "causal" for m in _names(args.masks, {"causal", "full"})]
    rounds, timing = (1, dict(batches=1, target_s=0.0)) if args.quick else (args.rounds, {})
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)

    if args.accuracy:
        b, s, hq, hkv = (1, 128, 4, 2) if args.quick else (1, 4096, 8, 2)
        dims = [64] if args.quick else [int(x) for x in args.dims.split(",")]
        rows = run_accuracy(dims, [float(x) for x in args.q_scales.split(",")],
                            impls, b, s, hq, hkv)
        print_table(rows, ["d", "mask", "q_scale", "impl", "max_err", "mean_err", "error"],
                    title=f"max / mean |o - reference|, B={b} S={s} Hq={hq} Hkv={hkv} bf16")
        write_json(args.json, rows, mode="accuracy")
        return

    if args.shapes:
        shapes = [_shape(x) for x in args.shapes.split(";")]
    elif args.quick:
        shapes = QUICK
    elif args.grid:
        shapes = [(16384 // s, s, 32, hkv, d) for s in (int(x) for x in args.seqs.split(","))
                  for hkv in (32, 8) for d in (64, 128)]
    else:
        shapes = HEADLINE

    if args.sustained:
        if jax.default_backend() != "gpu" or not shutil.which("nvidia-smi"):
            sys.exit("--sustained needs an NVIDIA GPU and nvidia-smi")
        rows = run_sustained(shapes[0], impls, args.seconds, args.reps)
        print_table(rows, title=f"forward at the power cap, B,S,Hq,Hkv,D = {shapes[0]}; "
                                f"x_first: against the first implementation")
        write_json(args.json, rows, mode="sustained", shape=shapes[0])
        return

    rows = []
    for shape, causal in itertools.product(shapes, masks):
        print(f"B,S,Hq,Hkv,D = {shape}, {'causal' if causal else 'full'}", flush=True)
        rows += bench_shape(shape, causal, impls, rounds, **timing)
    cols = ["b", "s", "hq", "hkv", "d", "mask", "impl", "fwd_tflops", "fwd_x_cudnn",
            "fwdbwd_tflops", "fwdbwd_x_cudnn", "rel_err", "grad_err", "error", "note"]
    print_table(rows, [c for c in cols if any(c in r for r in rows)],
                title=f"TFLOP/s; x cudnn: median per-round ratio over {rounds} rounds")
    write_json(args.json, rows, mode="grid" if args.grid else "throughput")


if __name__ == "__main__":
    main()
