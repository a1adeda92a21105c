"""Paged decode attention: jaxllm's kernel against JAX's Pallas paged kernel, cuDNN and XLA.

    PYTHONPATH=. python benchmarks/paged_attention.py [--rounds 5] [--json PATH]
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/paged_attention.py --quick   # smoke test

One query token per sequence over `ctx` cached tokens (B 8 / 32 / 128, ctx 4096, GQA 32/8,
D 128, bf16), pages of 16 tokens scattered over the pool (a random permutation), and one
row of ragged lengths (B 32, 1..ctx). Compared in one run: ours (`kernels.paged_attention`,
impl "pallas_triton"), JAX's Pallas paged_attention on the same pages and tables, cuDNN
and XLA attention on a contiguous cache [B, ctx, Hkv, D] (full lengths only), and two
anchors: a read-only XLA max-reduce over as many bytes as the K/V (what a plain read of
that size reaches), and the device's HBM copy (read + write) and read-only bandwidth over
2 GiB.

The figure is TB/s of K/V read (sum of lengths x Hkv x D x 2 x itemsize bytes / time) and
its share of the datasheet HBM bandwidth. One executable runs `unroll` calls back to back
on rotating inputs (>= 300 MB in rotation where 8 sets reach it, so L2 holds none of
them), timed with `time_fn` and divided by `unroll`; the implementations of a shape are
timed in interleaved rounds (x cuDNN: the median per-round ratio). Every implementation is
first checked against the jnp reference; the table's `check` column says how it went.
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (add_args, interleaved, print_table, roofline_pct, speedup,
                               time_fn, write_json)
from jaxllm.kernels import paged_attention, reference
from jaxllm.kernels.xla import xla_attention

FULL = dict(hq=32, hkv=8, d=128, page=16, ctx=4096, batches=(8, 32, 128), ragged_batch=32,
            device_elems=1 << 30, unroll=None)
QUICK = dict(hq=8, hkv=2, d=64, page=16, ctx=256, batches=(2,), ragged_batch=2,
             device_elems=1 << 20, unroll=1)
DTYPE = jnp.bfloat16
IMPLS = ("ours", "jax pallas paged", "cudnn contiguous", "xla contiguous",
         "read-only, same bytes")
PAGED = ("ours", "jax pallas paged")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# ---------------------------------------------------------------------------------------
# implementations: paged ones take (q [B, Hq, D], k/v pages, tables, lengths), contiguous
# ones (q [B, 1, Hq, D], k/v [B, ctx, Hkv, D])


def ours(q, k, v, t, ln):
    return paged_attention(q, k, v, t, ln, sm_scale=q.shape[-1] ** -0.5, impl="pallas_triton")


def jax_paged(q, k, v, t, ln):
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa
    # no softmax scale in JAX's kernel: folded into q; 8 pages per block, up to 16 splits
    k_splits = math.gcd(16, max(t.shape[1] // 8, 1))
    return jpa.paged_attention((q * q.shape[-1] ** -0.5).astype(q.dtype), k, v, t, ln,
                               k_splits=k_splits, interpret=not on_gpu())


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def xla(q, k, v):
    return xla_attention(q, k, v, causal=False, sm_scale=q.shape[-1] ** -0.5)


# ---------------------------------------------------------------------------------------
# correctness first


def check_all(shape) -> dict:
    """impl -> "ok" or "FAIL", every implementation against reference.paged_attention."""
    rng = np.random.default_rng(1)
    hq, hkv, d, ctx = shape["hq"], shape["hkv"], shape["d"], shape["ctx"]

    def case(page, lengths, hq=hq, hkv=hkv, d=d, dtype=DTYPE):
        b, n = len(lengths), max(-(-max(lengths) // page), 1)
        num_pages = b * n + 5
        k = jnp.asarray(rng.standard_normal((hkv, num_pages, page, d)), dtype)
        v = jnp.asarray(rng.standard_normal((hkv, num_pages, page, d)), dtype)
        t = jnp.asarray(rng.permutation(num_pages)[: b * n].reshape(b, n), jnp.int32)
        q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
        return q, k, v, t, jnp.asarray(lengths, jnp.int32)

    def contiguous(fn):
        def run(q, k, v, t, ln):
            kc, vc = reference.gather_pages(k, t), reference.gather_pages(v, t)
            return fn(q[:, None], kc, vc)[:, 0]
        return run

    ragged = [0, 1, 15, 16, 17, ctx - 96, ctx // 2, 33]
    cases = [("ours", "page 16, ragged lengths", ours, case(16, ragged), 2e-2),
             ("ours", "page 64, ragged lengths", ours, case(64, ragged), 2e-2),
             ("ours", "float32, MHA, D 64, page 8", ours,
              case(8, [300, 0, 77], hq=4, hkv=4, d=64, dtype=jnp.float32), 1e-4)]
    full = case(shape["page"], [ctx] * 4)
    cases += [("jax pallas paged", "full lengths", jax_paged, full, 2e-2),
              ("xla contiguous", "full lengths", contiguous(xla), full, 2e-2)]
    if on_gpu():
        cases.append(("cudnn contiguous", "full lengths", contiguous(cudnn), full, 2e-2))
    status = {}
    for impl, what, fn, args, tol in cases:
        want = reference.paged_attention(*args)
        try:
            err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want.astype(jnp.float32))))
        except Exception as e:  # noqa: BLE001  report, keep going
            print(f"  check {impl}, {what}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            err = float("inf")
        ok = err <= tol
        status[impl] = "ok" if ok and status.get(impl, "ok") == "ok" else "FAIL"
        print(f"  check {impl}, {what}: max |err| {err:.2e} (tol {tol:.0e}) "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    return status


# ---------------------------------------------------------------------------------------
# timing


def timer(fn, slot, unroll: int):
    """Seconds per call of fn(*slot(u)), u = 0..unroll-1 run in one executable (compiled
    here); every call gets its own query array, so XLA cannot merge identical calls."""
    sets = [slot(u) for u in range(unroll)]
    run = jax.jit(lambda sets: [fn(*s) for s in sets])
    jax.block_until_ready(run(sets))
    return lambda: time_fn(run, sets) / unroll


def device_rows(shape: dict, rounds: int) -> list[dict]:
    """The HBM copy (read + write) and read-only bandwidth over `device_elems` elements."""
    x = jax.random.normal(jax.random.key(0), (shape["device_elems"],), DTYPE)
    c = jnp.asarray(1, DTYPE)
    nbytes = x.size * x.dtype.itemsize
    copy, read = jax.jit(lambda a, c: a + c), jax.jit(lambda a, c: jnp.max(a + c))
    samples = interleaved({"HBM copy": lambda: time_fn(copy, x, c) / 2,  # reads and writes
                           "HBM read-only": lambda: time_fn(read, x, c)}, rounds)
    size = f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"
    return [{"impl": f"{name}, {size}", "TB/s": nbytes / statistics.median(ts) / 1e12,
             "% HBM": roofline_pct(nbytes, statistics.median(ts))}
            for name, ts in samples.items()]


def measure(b: int, shape: dict, rounds: int, checks: dict, ragged: bool = False) -> list[dict]:
    """Rows of one batch size: every implementation, timed in interleaved rounds; with
    `ragged`, lengths drawn from 1..ctx and the paged implementations only."""
    hq, hkv, d, page, ctx = (shape[k] for k in ("hq", "hkv", "d", "page", "ctx"))
    lengths = np.full(b, ctx)
    if ragged:
        lengths = np.random.default_rng(b).integers(1, ctx + 1, b)
    kv_bytes = int(lengths.sum()) * hkv * d * 2 * jnp.dtype(DTYPE).itemsize
    n_rot = int(min(8, max(1, math.ceil(300e6 / kv_bytes))))
    # calls per executable: ~3 ms of work at ~3.5 TB/s, 4 to 32
    unroll = shape["unroll"] or int(min(32, max(4, math.ceil(3e-3 / (kv_bytes / 3.5e12)))))
    kk, kv, kq = jax.random.split(jax.random.key(b), 3)

    def q(u, *tail):  # call u's own queries, [B, *tail, Hq, D]
        return jax.random.normal(jax.random.fold_in(kq, u), (b, *tail, hq, d), DTYPE)

    n = ctx // page
    num_pages = n_rot * b * n
    k_pages = jax.random.normal(kk, (hkv, num_pages, page, d), DTYPE)
    v_pages = jax.random.normal(kv, (hkv, num_pages, page, d), DTYPE)
    perm = np.random.default_rng(b).permutation(num_pages).astype(np.int32)
    tables = [jnp.asarray(perm[r * b * n:(r + 1) * b * n].reshape(b, n)) for r in range(n_rot)]
    lengths = jnp.asarray(lengths, jnp.int32)
    paged = lambda u: (q(u), k_pages, v_pages, tables[u % n_rot], lengths)  # noqa: E731

    jobs = {"ours": (ours, paged), "jax pallas paged": (jax_paged, paged)}
    if not ragged:
        jobs.update(contiguous_jobs(b, shape, n_rot, kk, kv, q))

    def failed(name, e):  # one failing implementation must not sink the rest
        print(f"  B={b} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    timers = {}
    for name in IMPLS:
        if name in jobs:
            try:
                timers[name] = timer(*jobs[name], unroll)
            except Exception as e:  # noqa: BLE001
                failed(name, e)
    samples = interleaved(timers, rounds, failed)
    ref = samples.get("cudnn contiguous")
    rows = []
    for name, ts in samples.items():
        t = statistics.median(ts)
        rows.append({"B": b, "ctx": "ragged" if ragged else ctx,
                     "page": page if name in PAGED else None,
                     "impl": name, "us": 1e6 * t, "TB/s": kv_bytes / t / 1e12,
                     "% HBM": roofline_pct(kv_bytes, t),
                     "x cuDNN": speedup(ref, ts) if ref else None,
                     "check": checks.get(name)})
    return rows


def contiguous_jobs(b: int, shape: dict, n_rot: int, kk, kv, q) -> dict:
    """cuDNN (on a GPU) and XLA on contiguous caches, and the read-only anchor over as
    many bytes as the K/V (arrays of at most 2^30 elements)."""
    hkv, d, ctx = shape["hkv"], shape["d"], shape["ctx"]
    cache = [(jax.random.normal(jax.random.fold_in(kk, r), (b, ctx, hkv, d), DTYPE),
              jax.random.normal(jax.random.fold_in(kv, r), (b, ctx, hkv, d), DTYPE))
             for r in range(n_rot)]
    contiguous = lambda u: (q(u, 1), *cache[u % n_rot])  # noqa: E731
    n_el = 2 * b * ctx * hkv * d
    flat = [[jax.random.normal(jax.random.fold_in(kk, 64 * r + i), (min(1 << 30, n_el - s),),
                               DTYPE) for i, s in enumerate(range(0, n_el, 1 << 30))]
            for r in range(n_rot)]
    read = lambda xs, c: functools.reduce(jnp.maximum, [jnp.max(x + c) for x in xs])  # noqa: E731
    jobs = {"xla contiguous": (xla, contiguous),
            "read-only, same bytes": (read, lambda u: (flat[u % n_rot],
                                                       jnp.asarray(u + 1, DTYPE)))}
    if on_gpu():
        jobs["cudnn contiguous"] = (cudnn, contiguous)
    return jobs


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a small shape, one batch size (runs on the CPU, interpret mode)")
    args = add_args(ap).parse_args(argv)
    shape = QUICK if args.quick else FULL
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; GQA {shape['hq']}/"
          f"{shape['hkv']}, D {shape['d']}, ctx {shape['ctx']}, page {shape['page']}", flush=True)
    checks = check_all(shape)
    rows = device_rows(shape, args.rounds)
    for b in shape["batches"]:
        rows += measure(b, shape, args.rounds, checks)
    rows += measure(shape["ragged_batch"], shape, args.rounds, checks, ragged=True)
    write_json(args.json, rows, shape=shape)
    print_table(rows, ["B", "ctx", "page", "impl", "us", "TB/s", "% HBM", "x cuDNN", "check"],
                title=f"paged decode attention, {args.rounds} interleaved rounds "
                            "(TB/s of K/V read)")
    return rows


if __name__ == "__main__":
    main()
