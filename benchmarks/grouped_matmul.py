"""Grouped matmul (MoE experts): jaxllm's `pallas_triton` and `pallas_mosaic` kernels against
`jax.lax.ragged_dot` ("xla") and a dense bf16 matmul of the same FLOPs, in one run.

    PYTHONPATH=. python benchmarks/grouped_matmul.py [--rounds 5] [--json PATH]
    PYTHONPATH=. python benchmarks/grouped_matmul.py --tiles block_n=256,num_stages=3
    PYTHONPATH=. python benchmarks/grouped_matmul.py \
        --mosaic-tiles "block_n=128;block_m=256,block_n=128"
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/grouped_matmul.py --quick --rounds 1 \
        --no-mosaic   # smoke test (with pallas_mosaic in the simulator: about 15 minutes)

DeepSeek-V3-like expert shapes: 64 experts, d_model 2048, expert width 1408, 16k tokens
routed to top-6 and top-8 experts (M = tokens x top_k rows). Both products of an expert
MLP: "up" lhs [M, 2048] x rhs [64, 2048, 1408] and "down" lhs [M, 1408] x
rhs [64, 1408, 2048]. Group sizes: "balanced" (every row routed to a uniformly random
expert: multinomial counts) and "skewed" (expert shares ~ 1 / rank, the largest expert
taking about a fifth of the rows), bf16.

Each case times four modes of every implementation: the forward, d lhs (dout [M, N] x
rhs[g]^T) and d rhs (lhs_g^T dout_g) alone, and forward+backward (the gradients of lhs
and rhs). The implementations: `pallas_triton`, `pallas_mosaic` (its d rhs is
gmm_triton's kernel, so its "d rhs" row times that), ragged_dot, and "dense": lhs [M, K]
@ w [K, N] with the same M, K, N (d lhs dout @ w^T, d rhs lhs^T @ dout), so the same
2 M K N FLOPs a product (fwd+bwd: 3x that). Figures: TFLOP/s and "x dense", the median
per-round ratio of the dense matmul's time to the implementation's in the same mode (the
target, fwd+bwd: >= 0.7). --tiles adds "pallas_triton, tiles" (other
`gmm_triton.BlockSizes` fields); --mosaic-tiles "pallas_mosaic, <fields>" rows
(`gmm_mosaic.BlockSizes`, one per ';'-separated set), all timed in the same rounds.
Before timing, every implementation of ours (and each tile set) is checked against the
jnp reference (forward and both gradients) at one shape: --check-tokens tokens, top-8,
skewed, up; `check` says how it went (max |err| / max |want| <= 2e-2 per output).
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import add_args, interleaved, print_table, speedup, time_fn, write_json
from jaxllm.kernels import grouped_matmul
from jaxllm.kernels.pallas import gmm_mosaic, gmm_triton

FULL = dict(experts=64, d_model=2048, width=1408, tokens=16384, top_ks=(6, 8))
QUICK = dict(experts=4, d_model=128, width=64, tokens=64, top_ks=(2,))  # K, N: multiples of 64
DTYPE = jnp.bfloat16
TOL = 2e-2
MODES = (("fwd", 1), ("d lhs", 1), ("d rhs", 1), ("fwd+bwd", 3))  # (mode, x 2MKN FLOPs)


def group_sizes(rows: int, experts: int, kind: str, seed: int) -> np.ndarray:
    """int32 [experts] summing to `rows`: "balanced" (uniform routing) or "skewed"."""
    rng = np.random.default_rng(seed)
    if kind == "balanced":
        p = np.full(experts, 1.0 / experts)
    else:
        p = 1.0 / np.arange(1, experts + 1)
        p = rng.permutation(p / p.sum())
    return rng.multinomial(rows, p).astype(np.int32)


def inputs(m: int, k: int, n: int, sizes: np.ndarray, seed: int):
    kl, kr, kd = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(kl, (m, k), DTYPE)
    rhs = (jax.random.normal(kr, (len(sizes), k, n), jnp.float32) * k ** -0.5).astype(DTYPE)
    dout = jax.random.normal(kd, (m, n), DTYPE)
    return lhs, rhs, jnp.asarray(sizes), dout


def _cpu() -> bool:  # the kernels called alone run interpreted (simulated) on the CPU
    return jax.default_backend() == "cpu"


def gmm_fns(impl: str, **kw) -> dict:
    """mode -> fn(lhs, rhs, sizes, dout) of one impl; fwd+bwd returns out and both grads.
    Ours time d lhs and d rhs with their kernels called alone; ragged_dot through a vjp
    in one argument (XLA drops the other product)."""
    def fwd(lhs, rhs, sizes, dout):
        return grouped_matmul(lhs, rhs, sizes, impl=impl, **kw)

    def fwd_bwd(lhs, rhs, sizes, dout):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, impl=impl, **kw),
                           lhs, rhs)
        return out, *vjp(dout)

    def one_grad(argnum):
        def fn(lhs, rhs, sizes, dout):
            def f(x):
                a, b = (x, rhs) if argnum == 0 else (lhs, x)
                return grouped_matmul(a, b, sizes, impl=impl, **kw)
            return jax.vjp(f, (lhs, rhs)[argnum])[1](dout)[0]
        return fn

    fns = {"fwd": fwd, "d lhs": one_grad(0), "d rhs": one_grad(1), "fwd+bwd": fwd_bwd}
    if impl in ("pallas_triton", "pallas_mosaic"):
        tbs = gmm_triton._block_sizes(jnp.dtype(DTYPE).itemsize, dict(kw) if impl == "pallas_triton"
                                      else {})
        if impl == "pallas_triton":
            fns["d lhs"] = lambda lhs, rhs, sizes, dout: gmm_triton._gmm(
                dout, rhs, sizes, dout.dtype, trans_rhs=True, bs=tbs, interpret=_cpu())
        else:
            mbs = gmm_mosaic._block_sizes(dict(kw))
            fns["d lhs"] = lambda lhs, rhs, sizes, dout: gmm_mosaic._gmm(
                dout, rhs, sizes, dout.dtype, trans_rhs=True, bs=mbs, interpret=_cpu())
        fns["d rhs"] = lambda lhs, rhs, sizes, dout: gmm_triton._tgmm(
            lhs, dout, sizes, rhs.shape[0], rhs.dtype, bs=tbs, interpret=_cpu())
    return fns


def dense_fns() -> dict:
    """A dense lhs [M, K] @ w [K, N] of the grouped product's FLOPs (w: rhs[0])."""
    def fwd_bwd(lhs, rhs, sizes, dout):
        out, vjp = jax.vjp(lambda a, w: a @ w, lhs, rhs[0])
        return out, *vjp(dout)
    return {"fwd": lambda lhs, rhs, sizes, dout: lhs @ rhs[0],
            "d lhs": lambda lhs, rhs, sizes, dout: dout @ rhs[0].T,
            "d rhs": lambda lhs, rhs, sizes, dout: lhs.T @ dout,
            "fwd+bwd": fwd_bwd}


def check(args, impl: str, name: str | None = None, **kw) -> str:
    """One impl against the reference: forward and both gradients, relative max error."""
    name = name or impl
    try:
        got = jax.jit(gmm_fns(impl, **kw)["fwd+bwd"])(*args)
    except Exception as err:  # noqa: BLE001  a kernel that fails to build must not sink the run
        print(f"check {name}: FAILED {type(err).__name__}: {str(err)[:600]}", flush=True)
        return "FAIL"
    want = jax.jit(gmm_fns("reference")["fwd+bwd"])(*args)
    errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                  / jnp.max(jnp.abs(w.astype(jnp.float32)))) for g, w in zip(got, want)]
    ok = all(e <= TOL for e in errs)
    print(f"check {name} (out, d lhs, d rhs) max |err| / max |want|: "
          + ", ".join(f"{e:.2e}" for e in errs) + f" (tol {TOL:.0e}) {'ok' if ok else 'FAIL'}",
          flush=True)
    return "ok" if ok else "FAIL"


def parse_tiles(spec: str) -> dict:
    return {k: int(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)}


def variants(impls: list[str], tiles: dict, mosaic_sweep: list[dict]) -> dict:
    """name -> (impl, tile kwargs) of everything timed beside dense."""
    out = {name: (name, {}) for name in impls}
    if tiles:
        out["pallas_triton, tiles"] = ("pallas_triton", tiles)
    for t in mosaic_sweep:
        out["pallas_mosaic, " + ",".join(f"{k}={v}" for k, v in t.items())] = (
            "pallas_mosaic", t)
    return out


def case_rows(shape: dict, top_k: int, kind: str, proj: str, rounds: int,
              timed: dict) -> list[dict]:
    d, w, e = shape["d_model"], shape["width"], shape["experts"]
    m = shape["tokens"] * top_k
    k, n = (d, w) if proj == "up" else (w, d)
    sizes = group_sizes(m, e, kind, seed=top_k)
    args = inputs(m, k, n, sizes, seed=top_k + 1)
    flops = 2 * m * k * n
    fns = {name: gmm_fns(impl, **kw) for name, (impl, kw) in timed.items()}
    fns["dense"] = dense_fns()

    def failed(name, err):
        print(f"  {proj} top-{top_k} {kind} {name}: FAILED {type(err).__name__}: "
              f"{str(err)[:300]}", flush=True)

    rows = []
    for mode, mult in MODES:
        jitted = {name: jax.jit(f[mode]) for name, f in fns.items()}
        samples = interleaved({name: (lambda f=f: time_fn(f, *args))
                               for name, f in jitted.items()}, rounds, failed)
        base = samples.get("dense")
        for name, ts in samples.items():
            t = statistics.median(ts)
            rows.append({"proj": proj, "top_k": top_k, "groups": kind, "M": m, "K": k, "N": n,
                         "mode": mode, "impl": name, "ms": 1e3 * t,
                         "TFLOP/s": mult * flops / t / 1e12,
                         "x dense": speedup(base, ts) if base else None})
        print(f"  done {proj} top-{top_k} {kind} {mode}", flush=True)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small shapes (runs on the CPU, interpret mode / the simulator)")
    ap.add_argument("--check-tokens", type=int, default=2048,
                    help="tokens of the correctness check's shape (top-8, skewed, up)")
    ap.add_argument("--top-ks", default=None, metavar="K,...",
                    help="top-k values to time (default: the shape's, 6 and 8)")
    ap.add_argument("--no-xla", action="store_true",
                    help="leave out jax.lax.ragged_dot (slow on the GPU)")
    ap.add_argument("--no-mosaic", action="store_true",
                    help="leave out pallas_mosaic (e.g. on a GPU older than Hopper)")
    ap.add_argument("--tiles", default="", metavar="FIELD=INT,...",
                    help="also time pallas_triton with these BlockSizes fields")
    ap.add_argument("--mosaic-tiles", default="", metavar="FIELD=INT,...;...",
                    help="also time pallas_mosaic with each ';'-separated set of "
                         "gmm_mosaic.BlockSizes fields")
    args = add_args(ap).parse_args(argv)
    tiles = parse_tiles(args.tiles)
    sweep = [] if args.no_mosaic else [parse_tiles(t) for t in args.mosaic_tiles.split(";")
                                       if t.strip()]
    shape = QUICK if args.quick else FULL
    top_ks = (tuple(int(t) for t in args.top_ks.split(",")) if args.top_ks
              else shape["top_ks"])
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {shape['experts']} "
          f"experts, d {shape['d_model']}, width {shape['width']}, {shape['tokens']} "
          f"tokens, bf16", flush=True)
    impls = (["pallas_triton"] + ([] if args.no_mosaic else ["pallas_mosaic"])
             + ([] if args.no_xla else ["xla"]))
    timed = variants(impls, tiles, sweep)
    check_tokens = shape["tokens"] if args.quick else args.check_tokens
    m = check_tokens * 8
    check_args = inputs(m, shape["d_model"], shape["width"],
                        group_sizes(m, shape["experts"], "skewed", 0), 0)
    checks = {name: check(check_args, impl, name, **kw) for name, (impl, kw) in timed.items()
              if impl != "xla"}
    status = ", ".join(f"{name} {v}" for name, v in checks.items())
    rows = []
    for top_k in top_ks:
        for kind in ("balanced", "skewed"):
            for proj in ("up", "down"):
                rows += case_rows(shape, top_k, kind, proj, args.rounds, timed)
    write_json(args.json, rows, shape=shape, check=status, tiles=tiles, mosaic_tiles=sweep)
    print_table(rows, ["proj", "top_k", "groups", "M", "K", "N", "mode", "impl", "ms",
                       "TFLOP/s", "x dense"],
                title=f"grouped matmul, bf16, {args.rounds} interleaved rounds; "
                      f"check: {status}")
    return rows


if __name__ == "__main__":
    main()
