"""FlashAttention throughput on the GPU: jaxllm's Pallas kernels against the anchors.

Implementations, all in one run: jaxllm `pallas_triton` and `pallas_mosaic` (when built),
cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`), JAX's own Pallas Triton
`mha` (it has no GQA, so K/V are repeated to Hq heads *before* timing; its time excludes
the repeat), and plain XLA einsums (jaxllm's "xla" impl).

Shapes: B * S = 16384 tokens, S in {1024, 4096, 16384}, Hq = 32, Hkv in {32, 8},
D in {64, 128}, causal and full, bf16. FLOPs = 4 B Hq Sq Skv D (halved when causal);
fwd+bwd counts 3.5x. Times are medians of batches of back-to-back calls, synchronised
with block_until_ready; the implementations of a shape are timed in `--rounds`
interleaved rounds, and each figure is the median over rounds (the ratio to cuDNN: the
median per-round ratio). `rel_err` is ||o - o_ref|| / ||o_ref|| of the forward output
against the float32 reference on a subset of heads.

  python benchmarks/attention.py            # every shape
  python benchmarks/attention.py --quick    # B=4 S=4096 Hq=32 Hkv=8 D=128 only
  python benchmarks/attention.py --tune     # sweep pallas_triton tiles on the headline shape
  python benchmarks/attention.py --seqs 16384 --impls pallas_triton,cudnn   # a slice
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import interleaved, speedup
from jaxllm.kernels import available_flash_impls, flash_attention, reference

HQ, TOKENS = 32, 16384


def attention_flops(b, hq, sq, skv, d, causal):
    f = 4 * b * hq * sq * skv * d
    return f / 2 if causal else f


def time_fn(fn, *args, target_s=0.03, batches=5):
    """Median seconds per call; each batch runs calls back to back, then synchronises."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    n = int(min(200, max(3, target_s / max(time.perf_counter() - t, 1e-6))))
    times = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def jax_pallas_mha(q, k, v, *, causal, sm_scale):
    from jax.experimental.pallas.ops.gpu import attention as jax_attention
    return jax_attention.mha(q, k, v, None, sm_scale=sm_scale, causal=causal)


def make_impls(hq, hkv, opts=None):
    """name -> (fn(q, k, v) -> o, needs_repeated_kv)."""
    impls = {}
    for name in ("pallas_triton", "pallas_mosaic", "cudnn", "xla"):
        if name in available_flash_impls():
            kw = (opts or {}) if name == "pallas_triton" else {}
            impls[name] = (functools.partial(flash_attention, impl=name, **kw), False)
    impls["jax_pallas_mha"] = (jax_pallas_mha, hq != hkv)
    return impls


def rel_error(o, q, k, v, causal, scale):
    """Relative Frobenius error of o against the float32 reference on <= 4 query heads."""
    hq, hkv = q.shape[2], k.shape[2]
    g = hq // hkv
    nkv = max(1, 4 // g)
    hs = nkv * g
    with jax.default_matmul_precision("highest"):
        ref = reference.flash_attention(*(x.astype(jnp.float32) for x in
                                          (q[:, :, :hs], k[:, :, :nkv], v[:, :, :nkv])),
                                        causal=causal, sm_scale=scale)
    o = o[:, :, :hs].astype(jnp.float32)
    return float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))


def bench_shape(b, s, hkv, d, causal, impls, with_bwd=True, rounds=1):
    """Rows for one shape. Every implementation is compiled and checked first, then timed
    once a round for `rounds` rounds (order reversed every other round): figures are the
    medians over rounds, and `*_x_cudnn` the medians of the per-round ratios to cuDNN."""
    key = jax.random.split(jax.random.key(s + hkv + d + causal), 4)
    q = jax.random.normal(key[0], (b, s, HQ, d), jnp.bfloat16)
    k = jax.random.normal(key[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(key[2], (b, s, hkv, d), jnp.bfloat16)
    do = jax.random.normal(key[3], (b, s, HQ, d), jnp.bfloat16)
    scale = d**-0.5
    flops = attention_flops(b, HQ, s, s, d, causal)
    rows, timed = [], {}  # timed: name -> (row, [(kind, fn, args)])
    for name, (fn, repeat) in impls.items():
        row = dict(b=b, s=s, hq=HQ, hkv=hkv, d=d, causal=causal, impl=name)
        rows.append(row)
        if name == "xla" and s > 4096:
            row["note"] = "skipped: materialises S x S scores"
            continue
        kk, vv = (jnp.repeat(k, HQ // hkv, 2), jnp.repeat(v, HQ // hkv, 2)) if repeat else (k, v)
        if repeat:
            row["note"] = "K/V repeated to Hq before timing"
        f = jax.jit(functools.partial(fn, causal=causal, sm_scale=scale))

        def loss(q, k, v, do, f=f):  # do is an argument: a closed-over constant gets folded
            return jnp.vdot(f(q, k, v).astype(jnp.float32), do.astype(jnp.float32))

        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        try:
            o = f(q, kk, vv)
            row["rel_err"] = rel_error(o, q, k, v, causal, scale)
            kinds = [("fwd", f, (q, kk, vv))]
            if with_bwd:
                jax.block_until_ready(g(q, kk, vv, do))  # compile before the rounds
                kinds.append(("fwdbwd", g, (q, kk, vv, do)))
            timed[name] = (row, kinds)
        except Exception as e:  # keep going: one failing impl must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    def on_error(key, e):
        timed[key[0]][0]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

    samples = interleaved({(n, kind): functools.partial(time_fn, fn, *args)
                           for n, (_, kinds) in timed.items() for kind, fn, args in kinds},
                          rounds, on_error)
    for (name, kind), ts in samples.items():
        row = timed[name][0]
        if "error" in row:  # its other kind failed: no half-timed rows
            continue
        t = statistics.median(ts)
        mult = 3.5 if kind == "fwdbwd" else 1.0
        row[f"{kind}_ms"], row[f"{kind}_tflops"] = t * 1e3, mult * flops / t / 1e12
        ref = samples.get(("cudnn", kind))
        if ref:
            row[f"{kind}_x_cudnn"] = speedup(ref, ts)
    for row in rows:
        print(json.dumps(row), flush=True)
        if os.environ.get("OUT"):  # the shapes done survive a run cut short
            with open(os.path.join(os.environ["OUT"], "attention.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
    return rows


def print_table(rows):
    cudnn = {(r["s"], r["hkv"], r["d"], r["causal"]): r for r in rows if r["impl"] == "cudnn"}
    hdr = (f"{'B':>3} {'S':>6} {'Hkv':>4} {'D':>4} {'mask':>6} {'impl':<15} {'fwd TF/s':>9} "
           f"{'x cuDNN':>8} {'f+b TF/s':>9} {'x cuDNN':>8} {'rel_err':>8}  note")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        c = cudnn.get((r["s"], r["hkv"], r["d"], r["causal"]), {})

        def fmt(key, r=r, c=c):
            v = r.get(key)
            x = r.get(key.replace("_tflops", "_x_cudnn"))
            if x is None and v and c.get(key):
                x = v / c[key]
            ratio = f"{x:8.2f}" if x else f"{'':>8}"
            return (f"{v:9.1f}" if v else f"{'-':>9}") + " " + ratio

        err = f"{r['rel_err']:8.1e}" if "rel_err" in r else f"{'-':>8}"
        print(f"{r['b']:>3} {r['s']:>6} {r['hkv']:>4} {r['d']:>4} "
              f"{'causal' if r['causal'] else 'full':>6} {r['impl']:<15} {fmt('fwd_tflops')} "
              f"{fmt('fwdbwd_tflops')} {err}  {r.get('error', r.get('note', ''))}")


def tune(d, causals):
    """Time pallas_triton tile candidates at B=4 S=4096 Hq=32 Hkv=8 (fwd, then bwd)."""
    from jaxllm.kernels.pallas.flash_triton import BlockSizes, default_block_sizes
    base = default_block_sizes(d)
    fwd = [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
           for bq, bk, w, st in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                                 (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4),
                                 (64, 128, 4, 2)]]
    bwd = [dict(block_q_dkv=a, block_k_dkv=b, block_q_dq=c, block_k_dq=e, num_warps_bwd=w,
                num_stages_bwd=st)
           for a, b, c, e, w, st in [(32, 64, 64, 32, 4, 2), (32, 128, 128, 32, 8, 2),
                                     (64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2),
                                     (32, 128, 128, 32, 4, 3), (64, 64, 64, 64, 4, 3),
                                     (16, 64, 64, 16, 4, 3)]]
    rows = []
    for causal, (stage, cands) in itertools.product(causals, (("fwd", fwd), ("bwd", bwd))):
        for cand in cands:
            bs = BlockSizes(**{**vars_of(base), **cand})
            impls = {"pallas_triton": make_impls(HQ, 8, {"block_sizes": bs})["pallas_triton"]}
            r = bench_shape(4, 4096, 8, d, causal, impls, with_bwd=stage == "bwd")[0]
            r.update(stage=stage, **cand)
            rows.append(r)
    return rows


def vars_of(bs):
    import dataclasses
    return {f.name: getattr(bs, f.name) for f in dataclasses.fields(bs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only B=4 S=4096 Hkv=8 D=128")
    ap.add_argument("--tune", type=int, nargs="*", metavar="D",
                    help="sweep pallas_triton tiles for these head dims (default 128)")
    ap.add_argument("--impls", default="", help="comma-separated subset of implementations")
    ap.add_argument("--seqs", default="1024,4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds per shape (medians over rounds)")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    if args.tune is not None:
        rows = []
        for d in args.tune or [128]:
            rows += tune(d, (True, False))
        for r in rows:
            keys = [k for k in r if k.startswith(("block", "num_"))]
            print(r["d"], "causal" if r["causal"] else "full  ", r["stage"],
                  " ".join(f"{k}={r[k]}" for k in keys),
                  f"fwd {r.get('fwd_tflops', 0):6.1f}", f"f+b {r.get('fwdbwd_tflops', 0):6.1f}",
                  r.get("error", ""))
        return
    if args.quick:
        shapes = [(4, 4096, 8, 128)]
    else:
        seqs = [int(x) for x in args.seqs.split(",")]
        shapes = [(TOKENS // s, s, hkv, d) for s in seqs for hkv in (32, 8)
                  for d in (64, 128)]
    rows = []
    for (b, s, hkv, d), causal in itertools.product(shapes, (False, True)):
        impls = make_impls(HQ, hkv)
        if args.impls:
            impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
        rows += bench_shape(b, s, hkv, d, causal, impls, rounds=args.rounds)
    print_table(rows)


if __name__ == "__main__":
    main()
