"""Grouped matmul (MoE experts): jaxllm's `pallas_triton` kernel against
`jax.lax.ragged_dot` ("xla") and a dense bf16 matmul of the same FLOPs, in one run.

    PYTHONPATH=. python benchmarks/grouped_matmul.py [--rounds 5] [--json PATH]
    PYTHONPATH=. python benchmarks/grouped_matmul.py --tiles block_n=256,num_stages=3
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/grouped_matmul.py --quick   # smoke test

DeepSeek-V3-like expert shapes: 64 experts, d_model 2048, expert width 1408, 16k tokens
routed to top-6 and top-8 experts (M = tokens x top_k rows). Both products of an expert
MLP: "up" lhs [M, 2048] x rhs [64, 2048, 1408] and "down" lhs [M, 1408] x
rhs [64, 1408, 2048]. Group sizes: "balanced" (every row routed to a uniformly random
expert: multinomial counts) and "skewed" (expert shares ~ 1 / rank, the largest expert
taking about a fifth of the rows), bf16.

Each case times the forward and forward+backward (the gradients of lhs and rhs) of ours,
of ragged_dot and of "dense": lhs [M, K] @ w [K, N] with the same M, K, N, so the same
2 M K N FLOPs (fwd+bwd: 3x that). Figures: TFLOP/s and "x dense", the median per-round
ratio of the dense matmul's time to the implementation's (the target for ours,
fwd+bwd: >= 0.7). --tiles adds "ours, tiles": ours with other `gmm_triton.BlockSizes`
fields, timed in the same rounds. Before timing, ours (and ours with --tiles) is checked
against the jnp reference (forward and both gradients) at one shape: --check-tokens
tokens, top-8, skewed, up; `check` says how it went (max |err| / max |want| <= 2e-2 per
output).
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import add_args, interleaved, print_table, speedup, time_fn, write_json
from jaxllm.kernels import grouped_matmul

FULL = dict(experts=64, d_model=2048, width=1408, tokens=16384, top_ks=(6, 8))
QUICK = dict(experts=4, d_model=64, width=48, tokens=64, top_ks=(2,))
DTYPE = jnp.bfloat16
TOL = 2e-2


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


def gmm_fns(impl: str, **kw):
    """(forward, forward+backward) of one impl: fwd+bwd returns the lhs and rhs grads."""
    def fwd(lhs, rhs, sizes, dout):
        return grouped_matmul(lhs, rhs, sizes, impl=impl, **kw)

    def fwd_bwd(lhs, rhs, sizes, dout):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, impl=impl, **kw),
                           lhs, rhs)
        return out, *vjp(dout)
    return fwd, fwd_bwd


def dense_fns():
    """A dense lhs [M, K] @ w [K, N] of the grouped product's FLOPs (w: rhs[0])."""
    def fwd(lhs, rhs, sizes, dout):
        return lhs @ rhs[0]

    def fwd_bwd(lhs, rhs, sizes, dout):
        out, vjp = jax.vjp(lambda a, w: a @ w, lhs, rhs[0])
        return out, *vjp(dout)
    return fwd, fwd_bwd


def check(args, name: str = "ours", **kw) -> str:
    """Ours against the reference: forward and both gradients, relative max error."""
    got = jax.jit(gmm_fns("pallas_triton", **kw)[1])(*args)
    want = jax.jit(gmm_fns("reference")[1])(*args)
    errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                  / jnp.max(jnp.abs(w.astype(jnp.float32)))) for g, w in zip(got, want)]
    ok = all(e <= TOL for e in errs)
    print(f"check {name} (out, d lhs, d rhs) max |err| / max |want|: "
          + ", ".join(f"{e:.2e}" for e in errs) + f" (tol {TOL:.0e}) {'ok' if ok else 'FAIL'}",
          flush=True)
    return "ok" if ok else "FAIL"


def case_rows(shape: dict, top_k: int, kind: str, proj: str, rounds: int,
              impls: list[str], tiles: dict | None = None) -> list[dict]:
    d, w, e = shape["d_model"], shape["width"], shape["experts"]
    m = shape["tokens"] * top_k
    k, n = (d, w) if proj == "up" else (w, d)
    sizes = group_sizes(m, e, kind, seed=top_k)
    args = inputs(m, k, n, sizes, seed=top_k + 1)
    flops = 2 * m * k * n
    fns = {name: gmm_fns(name) for name in impls}
    if tiles:
        fns["ours, tiles"] = gmm_fns("pallas_triton", **tiles)
    fns["dense"] = dense_fns()

    def failed(name, err):
        print(f"  {proj} top-{top_k} {kind} {name}: FAILED {type(err).__name__}: "
              f"{str(err)[:300]}", flush=True)

    rows = []
    for mode, i, mult in (("fwd", 0, 1), ("fwd+bwd", 1, 3)):
        jitted = {name: jax.jit(f[i]) for name, f in fns.items()}
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
                    help="small shapes (runs on the CPU, interpret mode)")
    ap.add_argument("--check-tokens", type=int, default=2048,
                    help="tokens of the correctness check's shape (top-8, skewed, up)")
    ap.add_argument("--no-xla", action="store_true",
                    help="leave out jax.lax.ragged_dot (slow on the GPU)")
    ap.add_argument("--tiles", default="", metavar="FIELD=INT,...",
                    help="also time ours with these BlockSizes fields (e.g. block_n=256)")
    args = add_args(ap).parse_args(argv)
    tiles = {k: int(v) for k, v in (kv.split("=") for kv in args.tiles.split(",") if kv)}
    shape = QUICK if args.quick else FULL
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {shape['experts']} "
          f"experts, d {shape['d_model']}, width {shape['width']}, {shape['tokens']} "
          f"tokens, bf16", flush=True)
    check_tokens = shape["tokens"] if args.quick else args.check_tokens
    m = check_tokens * 8
    check_args = inputs(m, shape["d_model"], shape["width"],
                        group_sizes(m, shape["experts"], "skewed", 0), 0)
    status = check(check_args)
    if tiles:
        status += ", tiles " + check(check_args, "ours, tiles", **tiles)
    impls = ["pallas_triton"] + ([] if args.no_xla else ["xla"])
    rows = []
    for top_k in shape["top_ks"]:
        for kind in ("balanced", "skewed"):
            for proj in ("up", "down"):
                rows += case_rows(shape, top_k, kind, proj, args.rounds, impls, tiles)
    write_json(args.json, rows, shape=shape, check=status, tiles=tiles)
    print_table(rows, ["proj", "top_k", "groups", "M", "K", "N", "mode", "impl", "ms",
                       "TFLOP/s", "x dense"],
                title=f"grouped matmul, bf16, {args.rounds} interleaved rounds; "
                      f"check: {status}")
    return rows


if __name__ == "__main__":
    main()
