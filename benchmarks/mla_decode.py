"""MLA decode (absorbed form) over a paged latent cache: jaxllm's Triton and Mosaic GPU
kernels against the jnp reference (XLA), on DeepSeek-V3's latent shape.

    PYTHONPATH=. python benchmarks/mla_decode.py [--rounds 5] [--json PATH] [--sweep]
    PYTHONPATH=. python benchmarks/mla_decode.py --config block_h=32 \
        --config num_splits=4,num_stages=3
    PYTHONPATH=. python benchmarks/mla_decode.py --mosaic-config num_stages=2,num_splits=2
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/mla_decode.py --quick   # smoke test

B = 64 sequences of 4096 cached tokens each, pages of 64 tokens scattered over the pool (a
random permutation), bf16 latent rows of Dk = 576 (512 latent + 64 rope), values the first
512 columns, one new token a sequence, at three head counts (64: one CTA of the Mosaic
kernel a sequence, no padded heads):
  Hq 16: memory-bound; figure: TB/s of latent read (B x ctx x Dk x 2 bytes / time) and
         its share of the datasheet HBM bandwidth, against the target `TARGET_TBS`;
  Hq 128: compute-bound; figure: TFLOP/s = 2 x B x Hq x ctx x (Dk + v_dim) / time,
         against the target `TARGET_TFLOPS`.
(FlashMLA reports 3.0 TB/s and 660 TFLOP/s on an H800 for these two regimes.)
Each `--config` (comma-separated keyword=value of `mla_triton.mla_decode`: block_h,
block_k, num_splits, num_warps, num_stages) adds one more row of the Triton kernel, each
`--mosaic-config` (block_k, num_stages, num_splits of `mla_mosaic.mla_decode`) one of the
Mosaic kernel (at Hq 16 "mosaic" is the narrow kernel, `mla_mosaic_narrow`; a config
with block_k times the kernel of 64 padded heads beside it); `--sweep` adds the Mosaic
kernel's ring depths and context splits (about two minutes more). Every implementation
is first checked against the reference on the inputs it is timed on (the `check` column)
and, before the timings, the kernels on ragged lengths (0, 1, page - 1, page, page + 1,
partial and full contexts) with and without splits; an implementation that fails to
compile is reported with its error and left out of the timings. Implementations are timed
in interleaved rounds (`benchmarks.common`); "x ref" is the median per-round ratio.
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

FULL = dict(batch=64, ctx=4096, page=64, dk=576, v_dim=512, heads=(16, 64, 128))
# Dk and v_dim the Mosaic kernel takes (multiples of 64 and 128); it runs only on Hopper
QUICK = dict(batch=3, ctx=200, page=16, dk=192, v_dim=128, heads=(4, 16))
DTYPE = jnp.bfloat16
TARGET_TBS, TARGET_TFLOPS = 3.6, 550.0
_KNOBS = ("block_h", "block_k", "num_splits", "num_warps", "num_stages")
_MOSAIC_KNOBS = ("block_k", "num_stages", "num_splits")
# --sweep: the Mosaic kernel's ring depth and context splits (32-token tiles: 64-token
# ones do not fit in shared memory beside Q at Dk 576)
SWEEP = ("num_stages=2", "num_splits=1", "num_splits=2", "num_splits=3", "num_splits=4",
         "num_stages=2,num_splits=2")


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


def parse_config(text: str, knobs=_KNOBS) -> dict:
    """'block_h=32,num_splits=4' -> {'block_h': 32, 'num_splits': 4}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in knobs or not value.isdigit():
            raise SystemExit(f"config {text!r}: want comma-separated KEY=INT with KEY one "
                             f"of {knobs}")
        out[key] = int(value)
    return out


def _error(name, e) -> None:
    """A failure in full for a kernel (a compile error is fixed from this text), short
    for the rest."""
    text = str(e)
    if "mosaic" in name:
        text = text[-4000:]
    else:
        text = text[:300]
    print(f"  {name}: FAILED {type(e).__name__}: {text}", flush=True)


def ragged_inputs(seed: int, shape: dict, hq: int, batch: int = 8):
    """q and a shuffled pool of `batch` rows with ragged lengths: 0, 1, page - 1, page,
    page + 1, a partial and two full contexts (pool slots past a row's length hold
    other rows' finite values, as in a serving cache)."""
    ctx, page, dk = shape["ctx"], shape["page"], shape["dk"]
    lengths = np.array([0, 1, page - 1, page, page + 1, ctx // 3 + 5, ctx, ctx][:batch],
                       np.int32)
    n = -(-ctx // page)
    rng = np.random.default_rng(seed)
    tables = rng.permutation(batch * n).reshape(batch, n).astype(np.int32)
    kq, kk = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kq, (batch, hq, dk), DTYPE),
            jax.random.normal(kk, (batch * n, page, dk), DTYPE),
            jnp.asarray(tables), jnp.asarray(lengths))


def check(name, fn, args, want) -> str:
    """Max |err| against the reference; ok within 2e-2 of 1 + |reference| elementwise."""
    try:
        got = fn(*args).astype(jnp.float32)
    except Exception as e:  # noqa: BLE001  report, keep going
        _error(f"check {name}", e)
        return "FAIL"
    diff = jnp.abs(got - want.astype(jnp.float32))
    err = float(jnp.max(diff))
    ok = bool(jnp.all(diff <= 2e-2 * (1 + jnp.abs(want.astype(jnp.float32)))))
    print(f"  check {name}: max |err| {err:.2e} (tol 2e-02 x (1 + |ref|)) "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return "ok" if ok else "FAIL"


def ragged_checks(shape: dict, hq: int, impls: dict) -> None:
    """The kernels on ragged lengths, one split and two, against the reference."""
    args = ragged_inputs(hq + 1, shape, hq)
    want = mla_decode(*args, v_dim=shape["v_dim"], impl="reference")
    for name, fn in impls.items():
        for splits in (1, 2):
            check(f"Hq {hq} {name}, ragged lengths, {splits} split(s)",
                  jax.jit(functools.partial(fn, num_splits=splits)), args, want)


def rows_for(shape: dict, hq: int, configs: list[str], mosaic_configs: list[str],
             rounds: int) -> list[dict]:
    v_dim, b, ctx, dk = shape["v_dim"], shape["batch"], shape["ctx"], shape["dk"]
    kernels = {name: functools.partial(mla_decode, v_dim=v_dim, impl=f"pallas_{name}")
               for name in ("triton", "mosaic")}
    if jax.default_backend() != "gpu":  # the Mosaic kernel: Hopper only (simulated: slow)
        del kernels["mosaic"]
    ragged_checks(shape, hq, kernels)
    args = inputs(hq, shape, hq)
    impls = {"reference": functools.partial(mla_decode, v_dim=v_dim, impl="reference"),
             **kernels}
    for c in configs:
        impls[f"triton {c}"] = functools.partial(kernels["triton"], **parse_config(c))
    if "mosaic" in kernels:
        for c in mosaic_configs:
            impls[f"mosaic {c}"] = functools.partial(kernels["mosaic"],
                                                     **parse_config(c, _MOSAIC_KNOBS))
    impls = {k: jax.jit(f) for k, f in impls.items()}
    want = impls["reference"](*args)
    checks = {k: check(f"Hq {hq} {k}", f, args, want) for k, f in impls.items()}
    # an implementation that raised (did not compile) is reported once, not timed
    impls = {k: f for k, f in impls.items() if checks[k] != "FAIL" or k == "reference"
             or not _raised(f, args)}

    def failed(name, e):
        _error(f"Hq {hq} {name}", e)

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


def _raised(fn, args) -> bool:
    try:
        jax.block_until_ready(fn(*args))
    except Exception:  # noqa: BLE001  already reported by check
        return True
    return False


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small shapes (runs on the CPU, interpret mode)")
    ap.add_argument("--config", action="append", default=[], metavar="K=V,...",
                    help=f"one more row of the Triton kernel ({', '.join(_KNOBS)})")
    ap.add_argument("--mosaic-config", action="append", default=[], metavar="K=V,...",
                    help=f"one more row of the Mosaic kernel ({', '.join(_MOSAIC_KNOBS)})")
    ap.add_argument("--sweep", action="store_true",
                    help=f"add the Mosaic rows {', '.join(SWEEP)}")
    ap.add_argument("--heads", type=int, nargs="*",
                    help="query head counts (default 16 64 128)")
    args = add_args(ap).parse_args(argv)
    mosaic_configs = args.mosaic_config + (list(SWEEP) if args.sweep else [])
    shape = QUICK if args.quick else FULL
    heads = args.heads or shape["heads"]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; B {shape['batch']}, ctx "
          f"{shape['ctx']}, page {shape['page']}, Dk {shape['dk']}, v {shape['v_dim']}, bf16",
          flush=True)
    rows = []
    for hq in heads:
        rows += rows_for(shape, hq, args.config, mosaic_configs, args.rounds)
    write_json(args.json, rows, shape={k: str(v) for k, v in shape.items()})
    print_table(rows, ["Hq", "impl", "us", "TB/s", "% HBM", "TFLOP/s", "target", "met",
                       "x ref", "check"],
                title=f"MLA decode, {args.rounds} interleaved rounds")
    return rows


if __name__ == "__main__":
    main()
