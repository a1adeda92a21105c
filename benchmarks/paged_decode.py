"""Paged decode attention on the GPU: effective K/V bandwidth against the anchors, one run.

    PYTHONPATH=. python benchmarks/paged_decode.py            # full table
    PYTHONPATH=. python benchmarks/paged_decode.py --quick    # headline shape only
    PYTHONPATH=. python benchmarks/paged_decode.py --sweep    # + kernel configurations

Effective bandwidth = K/V bytes the attention must read (sum of lengths x Hkv x D x 2 x
itemsize) / time. Compared in the same run: jaxllm's pallas_triton paged kernel, JAX's
own Pallas paged_attention (same page layout and tables), cuDNN and XLA einsum attention
on a contiguous cache [B, ctx, Hkv, D] (q of length 1), and the device's copy and read
bandwidth: over 2 GiB, and read-only over exactly the shape's K/V bytes (an XLA reduce of
that size: what a plain read of that many bytes a call reaches). Pages are scattered (a
random permutation of the pool). Each timing is the median over repetitions of one
executable that runs `unroll` calls back to back on rotating inputs (up to 8 sets,
>= ~300 MB in rotation where 8 reach it; only B = 1 at ctx 512, 8 x 2 MB, stays within
the 60 MB L2), divided by `unroll`; the implementations of a shape
are timed in `--rounds` interleaved rounds, and each figure is the median over rounds
(the ratio to cuDNN: the median per-round ratio).
The script first checks every implementation against the jnp reference.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import interleaved, speedup
from jaxllm.kernels import reference
from jaxllm.kernels.pallas import paged_triton
from jaxllm.kernels.xla import xla_attention

HQ, HKV, D = 32, 8, 128
DTYPE = jnp.bfloat16
SCALE = D**-0.5


# ---------------------------------------------------------------------------------------
# timing


def timer(impl, slot, est_bytes, iters=5):
    """A function timing impl(*slot(u)), u = 0..unroll-1, in one executable (compiled and
    warmed up here): each call returns the median seconds per call over `iters` runs.

    Every call gets its own operands (at least its own query array), so XLA cannot merge
    identical calls; `unroll` makes one executable run for ~3 ms so that dispatch and
    synchronisation are amortised.
    """
    est = max(est_bytes / 3.5e12, 2e-6)
    unroll = int(min(32, max(4, math.ceil(3e-3 / est))))
    sets = [slot(u) for u in range(unroll)]
    run = jax.jit(lambda sets: [impl(*s) for s in sets])
    jax.block_until_ready(run(sets))

    def once():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(run(sets))
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / unroll
    return once


def bench(impl, slot, est_bytes, iters=5):
    """Median seconds per call of impl(*slot(u)) (see `timer`)."""
    return timer(impl, slot, est_bytes, iters)()


def device_bandwidth():
    x = jax.random.normal(jax.random.key(0), (1 << 30,), DTYPE)  # 2 GiB
    nbytes = x.size * x.dtype.itemsize
    slot = lambda u: (x, jnp.asarray(u + 1, DTYPE))  # noqa: E731
    t_copy = bench(lambda a, c: a + c, slot, 2 * nbytes)
    t_read = bench(lambda a, c: jnp.max(a + c), slot, nbytes)
    del x
    return 2 * nbytes / t_copy, nbytes / t_read


# ---------------------------------------------------------------------------------------
# inputs


def queries(key, b, shape_tail=(HQ, D)):
    return lambda u: jax.random.normal(jax.random.fold_in(key, u), (b, *shape_tail), DTYPE)


def make_paged(key, b, ctx, page, lengths, n_rot):
    """slot(u) -> paged args; a pool with n_rot disjoint, scattered page sets."""
    n = -(-ctx // page)
    num_pages = n_rot * b * n
    kk, kv, kq = jax.random.split(key, 3)
    k_pages = jax.random.normal(kk, (HKV, num_pages, page, D), DTYPE)
    v_pages = jax.random.normal(kv, (HKV, num_pages, page, D), DTYPE)
    perm = np.random.default_rng(0).permutation(num_pages).astype(np.int32)
    tables = [jnp.asarray(perm[r * b * n:(r + 1) * b * n].reshape(b, n)) for r in range(n_rot)]
    q = queries(kq, b)
    return lambda u: (q(u), k_pages, v_pages, tables[u % n_rot], lengths)


def make_contiguous(key, b, ctx, n_rot):
    """slot(u) -> (q [B, 1, Hq, D], k, v [B, ctx, Hkv, D]) over n_rot caches."""
    kk, kv, kq = jax.random.split(key, 3)
    ks = [jax.random.normal(jax.random.fold_in(kk, r), (b, ctx, HKV, D), DTYPE)
          for r in range(n_rot)]
    vs = [jax.random.normal(jax.random.fold_in(kv, r), (b, ctx, HKV, D), DTYPE)
          for r in range(n_rot)]
    q = queries(kq, b, (1, HQ, D))
    return lambda u: (q(u), ks[u % n_rot], vs[u % n_rot])


def rotations(kv_bytes):
    return int(min(8, max(1, math.ceil(300e6 / kv_bytes))))


# ---------------------------------------------------------------------------------------
# implementations


def ours(**cfg):
    return lambda q, k, v, t, ln: paged_triton.paged_attention(q, k, v, t, ln, sm_scale=SCALE,
                                                               **cfg)


def jax_paged(n_table):
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa
    k_splits = math.gcd(16, n_table)

    def fn(q, k, v, t, ln):  # JAX's kernel has no softmax scale: fold it into q
        return jpa.paged_attention((q * SCALE).astype(q.dtype), k, v, t, ln, k_splits=k_splits)
    return fn


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=SCALE, implementation="cudnn")


def xla(q, k, v):
    return xla_attention(q, k, v, causal=False, sm_scale=SCALE)


# ---------------------------------------------------------------------------------------
# correctness first


def check_correctness():
    rng = np.random.default_rng(1)
    results = []

    def case(page, lengths, hq=HQ, hkv=HKV, d=D, dtype=DTYPE):
        b, n = len(lengths), max(-(-max(lengths) // page), 1)
        num_pages = b * n + 5
        k = jnp.asarray(rng.standard_normal((hkv, num_pages, page, d)), dtype)
        v = jnp.asarray(rng.standard_normal((hkv, num_pages, page, d)), dtype)
        t = jnp.asarray(rng.permutation(num_pages)[: b * n].reshape(b, n), jnp.int32)
        q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
        return q, k, v, t, jnp.asarray(lengths, jnp.int32)

    def err(a, b):
        return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))

    def check(name, tol, got_fn, want):
        try:
            results.append((name, err(got_fn(), want), tol))
        except Exception as e:  # report, keep going
            results.append((name, float("inf"), tol))
            print(f"  check {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)

    ragged = [0, 1, 15, 16, 17, 4000, 2048, 513]
    for page in (16, 64):
        args = case(page, ragged)
        want = reference.paged_attention(*args, sm_scale=SCALE)
        for cfg in ({}, {"num_splits": 1}) if page == 16 else ({"num_splits": 5, "block_k": 256},):
            check(f"ours page={page} {cfg}", 2e-2,
                  lambda: paged_triton.paged_attention(*args, sm_scale=SCALE, **cfg), want)
        if page == 16:
            check("ours page=16 splits merged by XLA", 2e-2,
                  lambda: ours(merge="xla", num_splits=6)(*args), want)
    args32 = case(8, [300, 0, 77], hq=4, hkv=4, d=64, dtype=jnp.float32)
    check("ours float32 MHA d=64", 1e-4,
          lambda: paged_triton.paged_attention(*args32, sm_scale=0.2),
          reference.paged_attention(*args32, sm_scale=0.2))
    args = case(16, [4096] * 4)
    want = reference.paged_attention(*args, sm_scale=SCALE)
    check("jax pallas paged", 2e-2, lambda: jax_paged(args[3].shape[1])(*args), want)
    q, kp, vp, t, ln = args
    kc, vc = reference.gather_pages(kp, t), reference.gather_pages(vp, t)
    check("cudnn contiguous", 2e-2, lambda: cudnn(q[:, None], kc, vc)[:, 0], want)
    ok = True
    for name, e, tol in results:
        status = "ok" if e <= tol else "FAIL"
        ok &= status == "ok"
        print(f"  check {name:45s} max|err|={e:.2e} (tol {tol:.0e}) {status}", flush=True)
    return ok


# ---------------------------------------------------------------------------------------
# measurements


def measure_shape(b, ctx, pages, contiguous_cache, impls=("ours", "jax", "cudnn", "xla"),
                  configs=None, ragged=False, rounds=3):
    """Rows of {impl, page, TB/s, x_cudnn} for one (B, ctx).

    impls may also name "read": an XLA max-reduce over as many bytes as the K/V the
    attention reads (the device's read bandwidth at this call size).

    Every implementation is compiled first, then timed once a round for `rounds` rounds
    (the order reversed every other round), so slow and fast spells of the device fall on
    all of them alike: the row's time is the median over rounds, and `x_cudnn` the median
    of the per-round bandwidth ratios to cuDNN on the contiguous cache (when it ran)."""
    key = jax.random.key(b * 7919 + ctx)
    lengths = jnp.full((b,), ctx, jnp.int32)
    if ragged:
        lengths = jnp.asarray(np.random.default_rng(b).integers(1, ctx + 1, b), jnp.int32)
    kv_bytes = int(lengths.sum()) * HKV * D * 2 * jnp.dtype(DTYPE).itemsize
    n_rot = rotations(kv_bytes)
    jobs = []  # (name, page, cfg, fn, slot)
    if not ragged and ({"cudnn", "xla"} & set(impls)):
        if contiguous_cache.get((b, ctx)) is None:
            contiguous_cache.clear()
            contiguous_cache[(b, ctx)] = make_contiguous(key, b, ctx, n_rot)
        csets = contiguous_cache[(b, ctx)]
        if "cudnn" in impls:
            jobs.append(("cudnn contiguous", 0, None, cudnn, csets))
        if "xla" in impls:
            jobs.append(("xla contiguous", 0, None, xla, csets))
    page_sets = {page: make_paged(key, b, ctx, page, lengths, n_rot) for page in pages}
    for page, sets in page_sets.items():
        if "ours" in impls:
            jobs.append(("ours", page, None, ours(), sets))
        for cfg in configs or []:
            jobs.append((f"ours {cfg}", page, cfg, ours(**cfg), sets))
        if "jax" in impls:
            jobs.append(("jax pallas paged", page, None, jax_paged(-(-ctx // page)), sets))
    if "read" in impls:  # arrays of at most 2^30 elements: one of 2^31 (B=32, ctx 32768)
        # did not finish on the H200
        n_el = kv_bytes // jnp.dtype(DTYPE).itemsize
        sizes = [min(1 << 30, n_el - i) for i in range(0, n_el, 1 << 30)]
        flat = [[jax.random.normal(jax.random.fold_in(key, r * 64 + i), (n,), DTYPE)
                 for i, n in enumerate(sizes)] for r in range(n_rot)]
        jobs.append(("read-only, same bytes", 0, "read",
                     lambda xs, c: functools.reduce(jnp.maximum, [jnp.max(x + c) for x in xs]),
                     lambda u: (flat[u % n_rot], jnp.asarray(u + 1, DTYPE))))

    def failed(name, page, e):  # one failing variant must not sink the run
        print(f"  B={b} ctx={ctx} page={page} {name}: FAILED {type(e).__name__}: "
              f"{str(e)[:300]}", flush=True)

    timers = {}
    for name, page, cfg, fn, slot in jobs:
        try:
            timers[(name, page)] = (cfg, timer(fn, slot, kv_bytes))
        except Exception as e:  # noqa: BLE001
            failed(name, page, e)
    samples = interleaved({k: once for k, (_, once) in timers.items()}, rounds,
                          lambda k, e: failed(*k, e))
    ref = samples.get(("cudnn contiguous", 0))
    rows = []
    for (name, page), ts in samples.items():
        t = statistics.median(ts)
        x = speedup(ref, ts) if ref else None
        rows.append(dict(impl=name, B=b, ctx=ctx, page=page, cfg=timers[(name, page)][0],
                         us=t * 1e6, tbps=kv_bytes / t / 1e12, x_cudnn=x, ragged=ragged))
        print(f"  B={b:4d} ctx={ctx:6d} page={page:3d} {name:28s} {t * 1e6:9.1f} us "
              f"{kv_bytes / t / 1e12:6.3f} TB/s" + (f"  x{x:.3f} cuDNN" if x else ""),
              flush=True)
    del page_sets
    return rows


def _cfg(block_k, num_splits, num_warps=4, num_stages=3):
    return dict(block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                num_stages=num_stages)


# num_stages >= 5 makes Triton double-buffer the K/V tiles (the page-id load is one
# indirection level ahead of them); 3 gives one buffer, overlapped across resident CTAs.
# Fewer splits give fewer, longer programs (less start-up and merging per byte).
SWEEP = [_cfg(128, s) for s in (1, 2, 3)]
SWEEP += [_cfg(64, 1, 4, 3), _cfg(64, 2, 4, 3), _cfg(256, 1, 8, 3), _cfg(128, 1, 4, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="headline shape only")
    ap.add_argument("--sweep", action="store_true", help="also sweep kernel configurations")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds per shape (medians over rounds)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    measure = functools.partial(measure_shape, rounds=args.rounds)
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}, SMs {getattr(dev, 'core_count', '?')}",
          flush=True)
    t_start = time.time()
    ok = check_correctness()
    print(f"correctness: {'all ok' if ok else 'FAILURES'} ({time.time() - t_start:.0f}s)", flush=True)
    copy_bw, read_bw = device_bandwidth()
    print(f"device copy (read+write) {copy_bw / 1e12:.3f} TB/s, read-only (max-reduce) "
          f"{read_bw / 1e12:.3f} TB/s", flush=True)
    rows, cc = [], {}
    if args.sweep:  # kernel configurations at the headline shape; splits at B=8 and 128
        rows += measure(32, 4096, [16], cc, impls=("ours",), configs=SWEEP)
        rows += measure(8, 4096, [16], cc, impls=("ours",),
                        configs=[dict(num_splits=s) for s in (4, 8, 16)])
        rows += measure(128, 4096, [16], cc, impls=("ours",),
                        configs=[dict(num_splits=s) for s in (1, 2)])
    rows += measure(32, 4096, [16], cc, impls=("ours", "jax"), ragged=True)
    if args.quick:
        rows += measure(32, 4096, [16], cc, impls=("ours", "jax", "cudnn", "xla", "read"),
                        configs=[dict(merge="xla")])
        rows += measure(8, 4096, [16], cc, impls=("ours", "cudnn"),
                        configs=[dict(merge="xla")])
    else:
        free = dev.memory_stats().get("bytes_limit", 140e9) if hasattr(dev, "memory_stats") else 140e9
        for ctx in (512, 4096, 32768):
            for b in (1, 8, 32, 128):
                need = 4.6 * b * ctx * HKV * D * 2 * 2  # two paged pools, contiguous, read; margin
                if need > 0.9 * free:
                    print(f"  skip B={b} ctx={ctx}: needs ~{need / 1e9:.0f} GB", flush=True)
                    continue
                rows += measure(b, ctx, [16, 64], cc, impls=("ours", "jax", "cudnn", "read"))
    cc.clear()
    summary = dict(device=dev.device_kind, jax=jax.__version__, correctness_ok=ok,
                   copy_tbps=copy_bw / 1e12, read_tbps=read_bw / 1e12, rows=rows,
                   seconds=time.time() - t_start)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "paged_decode.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print_table(rows)
    print(f"total {time.time() - t_start:.0f}s")


def print_table(rows):
    """Markdown: per (B, ctx, page) ours / JAX paged / best contiguous."""
    by = {}
    for r in rows:
        if r["cfg"] in (None, "read") and not r["ragged"]:
            by.setdefault((r["B"], r["ctx"]), []).append(r)
    print("\n| B | ctx | page | ours TB/s | JAX Pallas paged TB/s | cuDNN contig. | XLA contig. "
          "| read-only, same bytes | ours / best contiguous | ours / cuDNN, per round |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    f = lambda x: f"{x:.2f}" if x else "-"  # noqa: E731
    for (b, ctx), rs in sorted(by.items()):
        get = {(r["impl"], r["page"]): r for r in rs}
        tb = {k: r["tbps"] for k, r in get.items()}
        contig = [tb.get(("cudnn contiguous", 0)), tb.get(("xla contiguous", 0))]
        best = max([c for c in contig if c] or [float("nan")])
        for page in sorted({r["page"] for r in rs if r["page"]}):
            o, j = tb.get(("ours", page)), tb.get(("jax pallas paged", page))
            x = get[("ours", page)].get("x_cudnn") if o else None
            print(f"| {b} | {ctx} | {page} | {f(o)} | {f(j)} | {f(contig[0])} | {f(contig[1])} "
                  f"| {f(tb.get(('read-only, same bytes', 0)))} "
                  f"| {f(o / best if o else None)} | {f(x)} |")


if __name__ == "__main__":
    main()
