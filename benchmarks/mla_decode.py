"""MLA decode (absorbed form) over a paged latent cache: jaxllm's Triton kernel against the
jnp reference (XLA), on DeepSeek-V3's latent shape.

    PYTHONPATH=. python benchmarks/mla_decode.py [--rounds 5] [--json PATH]
    PYTHONPATH=. python benchmarks/mla_decode.py --config block_h=32 --config num_splits=4,num_stages=3
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/mla_decode.py --quick   # smoke test

B = 64 sequences of 4096 cached tokens each, pages of 64 tokens scattered over the pool (a
random permutation), bf16 latent rows of Dk = 576 (512 latent + 64 rope), values the first
512 columns, one new token a sequence, at two head counts:
  Hq 16: memory-bound; figure: TB/s of latent read (B x ctx x Dk x 2 bytes / time) and
         its share of the datasheet HBM bandwidth, against the target `TARGET_TBS`;
  Hq 128: compute-bound; figure: TFLOP/s = 2 x B x Hq x ctx x (Dk + v_dim) / time,
         against the target `TARGET_TFLOPS`.
(FlashMLA reports 3.0 TB/s and 660 TFLOP/s on an H800 for these two regimes.)
Each `--config` (comma-separated keyword=value of `mla_triton.mla_decode`: block_h,
block_k, num_splits, num_warps, num_stages) adds one more row of ours, so a sweep is one
command. Every implementation is first checked against the reference on the inputs it
is timed on (the `check` column); implementations are timed in interleaved rounds
(`benchmarks.common`); "x ref" is the median per-round ratio.
"""
from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (add_args, interleaved, print_table, roofline_pct, speedup,
                               time_fn, write_json)
from jaxllm.kernels import mla_decode

FULL = dict(batch=64, ctx=4096, page=64, dk=576, v_dim=512, heads=(16, 128))
QUICK = dict(batch=3, ctx=200, page=16, dk=72, v_dim=64, heads=(4, 16))
DTYPE = jnp.bfloat16
TARGET_TBS, TARGET_TFLOPS = 3.6, 550.0
_KNOBS = ("block_h", "block_k", "num_splits", "num_warps", "num_stages")


def inputs(seed: int, shape: dict, hq: int):
    """q [B, Hq, Dk], a pool of exactly the batch's pages in random order, its tables,
    and full-length contexts."""
    b, ctx, page, dk = shape["batch"], shape["ctx"], shape["page"], shape["dk"]
    n = -(-ctx // page)
    kq, kk = jax.random.split(jax.random.key(seed))
    tables = np.random.default_rng(seed).permutation(b * n).reshape(b, n).astype(np.int32)
    return (jax.random.normal(kq, (b, hq, dk), DTYPE),
            jax.random.normal(kk, (b * n, page, dk), DTYPE),
            jnp.asarray(tables), jnp.full((b,), ctx, jnp.int32))


def parse_config(text: str) -> dict:
    """'block_h=32,num_splits=4' -> {'block_h': 32, 'num_splits': 4}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in _KNOBS or not value.isdigit():
            raise SystemExit(f"--config {text!r}: want comma-separated KEY=INT with KEY one "
                             f"of {_KNOBS}")
        out[key] = int(value)
    return out


def check(name, fn, args, want) -> str:
    try:
        err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want.astype(jnp.float32))))
    except Exception as e:  # noqa: BLE001  report, keep going
        print(f"  check {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return "FAIL"
    ok = err <= 2e-2
    print(f"  check {name}: max |err| {err:.2e} (tol 2e-02) {'ok' if ok else 'FAIL'}",
          flush=True)
    return "ok" if ok else "FAIL"


def rows_for(shape: dict, hq: int, configs: list[str], rounds: int) -> list[dict]:
    v_dim, b, ctx, dk = shape["v_dim"], shape["batch"], shape["ctx"], shape["dk"]
    args = inputs(hq, shape, hq)
    impls = {"reference": functools.partial(mla_decode, v_dim=v_dim, impl="reference"),
             "ours": functools.partial(mla_decode, v_dim=v_dim, impl="pallas_triton")}
    for c in configs:
        impls[f"ours {c}"] = functools.partial(mla_decode, v_dim=v_dim, impl="pallas_triton",
                                               **parse_config(c))
    impls = {k: jax.jit(f) for k, f in impls.items()}
    want = impls["reference"](*args)
    checks = {k: check(f"Hq {hq} {k}", f, args, want) for k, f in impls.items()}

    def failed(name, e):
        print(f"  Hq {hq} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    samples = interleaved({k: (lambda f=f: time_fn(f, *args)) for k, f in impls.items()},
                          rounds, failed)
    kv_bytes = b * ctx * dk * jnp.dtype(DTYPE).itemsize
    flops = 2 * b * hq * ctx * (dk + v_dim)
    base = samples.get("reference")
    rows = []
    for name, ts in samples.items():
        t = statistics.median(ts)
        tbs, tflops = kv_bytes / t / 1e12, flops / t / 1e12
        bound = "memory" if hq <= 16 else "compute"
        rows.append({"Hq": hq, "impl": name, "us": 1e6 * t, "TB/s": tbs,
                     "% HBM": roofline_pct(kv_bytes, t), "TFLOP/s": tflops,
                     "target": (f"{TARGET_TBS} TB/s" if bound == "memory"
                                else f"{TARGET_TFLOPS:.0f} TFLOP/s"),
                     "met": ((tbs >= TARGET_TBS) if bound == "memory"
                             else (tflops >= TARGET_TFLOPS)),
                     "x ref": speedup(base, ts) if base else None, "check": checks[name]})
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small shapes (runs on the CPU, interpret mode)")
    ap.add_argument("--config", action="append", default=[], metavar="K=V,...",
                    help=f"one more row of ours with these keywords ({', '.join(_KNOBS)})")
    ap.add_argument("--heads", type=int, nargs="*", help="query head counts (default 16 128)")
    args = add_args(ap).parse_args(argv)
    shape = QUICK if args.quick else FULL
    heads = args.heads or shape["heads"]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; B {shape['batch']}, ctx "
          f"{shape['ctx']}, page {shape['page']}, Dk {shape['dk']}, v {shape['v_dim']}, bf16",
          flush=True)
    rows = []
    for hq in heads:
        rows += rows_for(shape, hq, args.config, args.rounds)
    write_json(args.json, rows, shape={k: str(v) for k, v in shape.items()})
    print_table(rows, ["Hq", "impl", "us", "TB/s", "% HBM", "TFLOP/s", "target", "met",
                       "x ref", "check"],
                title=f"MLA decode, {args.rounds} interleaved rounds")
    return rows


if __name__ == "__main__":
    main()
