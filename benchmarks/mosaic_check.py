"""pallas_mosaic on the GPU: correctness against the float32 reference, then throughput
against pallas_triton and cuDNN in the same run, and tile/pipeline/schedule variants.

Shapes (bf16): B=4 S=4096 Hq=32 Hkv=8 D=128 and B=16 S=1024 Hq=32 Hkv=8 D=64, causal and
full. Correctness: max abs error of o and of dq, dk, dv (for a random cotangent) against
`kernels/reference.py` in float32, on the first batch row and the first two KV heads
(8 query heads) at full sequence length, so the reference fits in memory. Throughput
follows benchmarks/attention.py: FLOPs = 4 B Hq Sq Skv D, halved when causal; fwd+bwd
counts 3.5x that; time = median over batches of back-to-back jitted calls, synchronised
with block_until_ready, after a warm-up call. Timing runs in `--rounds` interleaved
rounds (every implementation once a round, the order reversed every other round); the
table gives the median TFLOP/s and the median of the per-round ratios to cuDNN, which
is steadier than a ratio of two separate timings. Every implementation and variant runs in
its own try/except: a failure prints its first 40 lines and the script goes on. A
markdown table comes last.

  PYTHONPATH=. python3 benchmarks/mosaic_check.py [--quick | --headline]
      [--variants "mosaic,mosaic pingpong"] [--rounds 5]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import traceback

import jax
import jax.numpy as jnp

from benchmarks.attention import attention_flops, time_fn  # the same conventions
from benchmarks.common import interleaved, speedup
from jaxllm.kernels import flash_attention, reference

HQ, HKV = 32, 8
SHAPES = [(4, 4096, 128), (16, 1024, 64)]  # (B, S, D)
PINGPONG = dict(overlap_softmax=False, schedule_barrier=True)
VARIANTS = {  # name -> pallas_mosaic options (the defaults depend on the mask and D)
    "mosaic": {},
    "mosaic bk64 st3": dict(block_kv=64, num_stages=3),
    "mosaic no-pingpong": dict(overlap_softmax=False, schedule_barrier=False),
    "mosaic bwd 1wg st3": dict(compute_wgs_bwd=1, num_stages_bwd=3),
    # forward schedule options (BlockSizes docstring); the backward is the default one
    "mosaic pingpong": PINGPONG,
    # the ping-pong step that issues Q K_{j+1}^T only once P_j V_j is done
    "mosaic no-chain": dict(PINGPONG, chain_qk=False),
    "mosaic early-k": dict(PINGPONG, early_k_wait=True),
    "mosaic early-k sum": dict(PINGPONG, early_k_wait=True, sum_before_sync=True),
    # each row's first key tile's max kept as its shift for the whole stream (the
    # default at D <= 128), or the running max (the default before)
    "mosaic fixed-max": dict(fixed_max=True),
    "mosaic running-max": dict(fixed_max=False),
    "mosaic pingpong fixed-max": dict(PINGPONG, fixed_max=True),
    "mosaic overlap": dict(overlap_softmax=True, schedule_barrier=True),
    "mosaic overlap no-pingpong": dict(overlap_softmax=True, schedule_barrier=False),
    "mosaic bq128 bk64": dict(PINGPONG, block_q=128, block_kv=64),
    # one CTA a tile and a backward that awaits each product before the next (the
    # defaults before the persistent kernels)
    "mosaic grid serial-bwd": dict(persistent=False, persistent_dq=False, overlap_bwd=False),
    # dQ formed by the dk/dv kernel and added with TMA reductions (no dq kernel)
    "mosaic fused-dq": dict(fused_dq=True),
    # clusters of two CTAs sharing each K/V tile by TMA multicast (forward)
    "mosaic multicast": dict(kv_multicast=True),
    "mosaic multicast st3": dict(kv_multicast=True, num_stages=3),
    "mosaic multicast bk64 st4": dict(kv_multicast=True, block_kv=64, num_stages=4),
}
# --headline: B=4 S=4096 D=128 only, cuDNN and the variants not skipped here (no
# pallas_triton); the default and the new forward schedules also get a correctness check.
HEADLINE_SKIP = ("mosaic bk64 st3", "mosaic bwd 1wg st3", "mosaic grid serial-bwd",
                 "mosaic fused-dq")
HEADLINE_CHECK = ("mosaic pingpong", "mosaic no-chain", "mosaic fixed-max", "mosaic running-max",
                  "mosaic pingpong fixed-max", "mosaic early-k", "mosaic early-k sum",
                  "mosaic overlap", "mosaic overlap no-pingpong", "mosaic bq128 bk64")


def report_error(where, e):
    lines = "".join(traceback.format_exception(e)).splitlines()
    print(f"!! {where}: {type(e).__name__}", flush=True)
    print("\n".join(lines[-40:] if len(lines) > 40 else lines), flush=True)


def check(q, k, v, do, causal, opts):
    """Max abs errors of o, dq, dk, dv against the float32 reference (a head subset)."""
    q, do = q[:1, :, :8], do[:1, :, :8]
    k, v = k[:1, :, :2], v[:1, :, :2]

    def loss(fn, q, k, v):
        return jnp.vdot(fn(q, k, v).astype(jnp.float32), do.astype(jnp.float32))

    kern = functools.partial(flash_attention, causal=causal, impl="pallas_mosaic", **opts)
    ref = functools.partial(reference.flash_attention, causal=causal)
    o = jax.jit(kern)(q, k, v).astype(jnp.float32)
    g = jax.jit(jax.grad(functools.partial(loss, kern), argnums=(0, 1, 2)))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        o_ref = jax.jit(ref)(*f32)
        g_ref = jax.jit(jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2)))(*f32)
    errs = {"o": float(jnp.abs(o - o_ref).max())}
    for name, a, r in zip(("dq", "dk", "dv"), g, g_ref):
        errs[name] = float(jnp.abs(a.astype(jnp.float32) - r).max())
        errs[name + "_scale"] = float(jnp.abs(r).max())
    return errs


def compile_pair(fn, q, k, v, do, causal):
    """(forward, forward+backward) jitted and run once (compiled, warmed up)."""
    f = jax.jit(functools.partial(fn, causal=causal))

    def loss(q, k, v, do):
        return jnp.vdot(f(q, k, v).astype(jnp.float32), do.astype(jnp.float32))

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(f(q, k, v))
    jax.block_until_ready(g(q, k, v, do))
    return f, g


def bench_rounds(pairs, q, k, v, do, flops, rounds):
    """name -> {fwd, fwdbwd: median TFLOP/s, x_fwd, x_fwdbwd: median per-round ratio to
    cuDNN}, timed in interleaved rounds (benchmarks/rounds.py)."""
    args = {"fwd": (q, k, v), "fwdbwd": (q, k, v, do)}
    samples = interleaved({(n, kind): functools.partial(time_fn, fn, *args[kind], batches=3)
                           for n, fg in pairs.items() for kind, fn in zip(args, fg)}, rounds)
    out = {}
    for (name, kind), ts in samples.items():
        row = out.setdefault(name, {})
        row[kind] = (3.5 if kind == "fwdbwd" else 1.0) * flops / statistics.median(ts) / 1e12
        if ("cudnn", kind) in samples:
            row["x_" + kind] = speedup(samples[("cudnn", kind)], ts)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="headline shape and default tiles only")
    ap.add_argument("--headline", action="store_true",
                    help="headline shape, cuDNN and the mosaic variants (each checked)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved timing rounds; figures are medians over rounds")
    ap.add_argument("--shape", default=None,
                    help="B,S,D: time this shape only (Hq=32, Hkv=8) instead of SHAPES")
    ap.add_argument("--variants", default=None,
                    help="comma-separated names from VARIANTS to run (default: all)")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    shapes = SHAPES[:1] if args.quick or args.headline else SHAPES
    if args.shape:
        try:
            b, s, d = (int(x) for x in args.shape.split(","))
        except ValueError:
            raise SystemExit(f"--shape wants B,S,D (three integers); got {args.shape!r}")
        shapes = [(b, s, d)]
    variants = dict(list(VARIANTS.items())[:1]) if args.quick else VARIANTS
    if args.headline:
        variants = {n: o for n, o in VARIANTS.items() if n not in HEADLINE_SKIP}
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
        variants = {n: VARIANTS[n] for n in names}
    # correctness: the default, plus (--headline) every variant with its own forward
    checked = {n: o for n, o in variants.items()
               if n == "mosaic" or (args.headline and n in HEADLINE_CHECK)}
    rows, checks = [], []
    for (b, s, d), causal in itertools.product(shapes, (True, False)):
        mask = "causal" if causal else "full"
        ks = jax.random.split(jax.random.key(s + d + causal), 4)
        q = jax.random.normal(ks[0], (b, s, HQ, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, s, HKV, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, s, HKV, d), jnp.bfloat16)
        do = jax.random.normal(ks[3], (b, s, HQ, d), jnp.bfloat16)
        flops = attention_flops(b, HQ, s, s, d, causal)
        for name, opts in checked.items():
            try:
                errs = check(q, k, v, do, causal, opts)
                checks.append((b, s, d, mask, name, errs))
                print(f"check {name} B={b} S={s} D={d} {mask}: " +
                      " ".join(f"{n}={e:.3g}" for n, e in errs.items()), flush=True)
            except Exception as e:  # noqa: BLE001  keep going
                report_error(f"check {name} B={b} S={s} D={d} {mask}", e)
        impls = {"cudnn": functools.partial(flash_attention, impl="cudnn")}
        if not args.headline:
            impls["pallas_triton"] = functools.partial(flash_attention, impl="pallas_triton")
        for name, opts in variants.items():
            impls[name] = functools.partial(flash_attention, impl="pallas_mosaic", **opts)
        pairs, failed = {}, {}
        for name, fn in impls.items():
            try:
                pairs[name] = compile_pair(fn, q, k, v, do, causal)
            except Exception as e:  # noqa: BLE001
                report_error(f"{name} B={b} S={s} D={d} {mask}", e)
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}" if str(e) \
                    else type(e).__name__
        timed = bench_rounds(pairs, q, k, v, do, flops, args.rounds)
        for name in impls:
            row = dict(b=b, s=s, d=d, mask=mask, impl=name, **timed.get(name, {}))
            if name in failed:
                row["error"] = failed[name]
            print(row, flush=True)
            rows.append(row)

    print("\n## correctness (max abs error vs float32 reference; *_scale = max |ref grad|)\n")
    print("| B | S | D | mask | impl | o | dq | dk | dv | dq scale | dk scale | dv scale |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b, s, d, mask, name, e in checks:
        print(f"| {b} | {s} | {d} | {mask} | {name} | {e['o']:.3g} | {e['dq']:.3g} | "
              f"{e['dk']:.3g} | {e['dv']:.3g} | {e['dq_scale']:.3g} | {e['dk_scale']:.3g} | "
              f"{e['dv_scale']:.3g} |")
    print(f"\n## throughput (TFLOP/s, Hq={HQ} Hkv={HKV} bf16; x = median per-round ratio to cuDNN)\n")
    print("| B | S | D | mask | impl | fwd | x cuDNN | fwd+bwd | x cuDNN | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = []
        for key in ("fwd", "fwdbwd"):
            val, x = r.get(key), r.get("x_" + key)
            cells.append(f"{val:.1f}" if val else "-")
            cells.append(f"{x:.2f}" if x else "-")
        print(f"| {r['b']} | {r['s']} | {r['d']} | {r['mask']} | {r['impl']} | "
              f"{' | '.join(cells)} | {r.get('error', '')} |")


if __name__ == "__main__":
    main()
