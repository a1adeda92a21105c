"""Ragged paged attention (a serving step's mixed prefill and decode tokens over the paged
cache): jaxllm's kernel against our paged decode kernel and the jnp reference.

    PYTHONPATH=. python benchmarks/ragged_attention.py [--rounds 5] [--json PATH]
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/ragged_attention.py --quick   # smoke test

GQA 32/8, D 128 and D 64, pages of 16 tokens scattered over the pool (a random
permutation), bf16. Two steps:
  (a) decode only: B = 64 sequences of one new token over ragged contexts of 1k-2k
      tokens; ours (`kernels.ragged_paged_attention`, "pallas_triton") against our paged
      decode kernel (`kernels.paged_attention`, "pallas_triton") on the same pages and the
      reference (XLA). Figure: TB/s of K/V read (sum of kv_lens x Hkv x D x 2 x itemsize
      bytes / time) and its share of the datasheet HBM bandwidth.
  (b) mixed: T = 2048 tokens, one or two prefill chunks over cached prefixes plus 32
      decode rows; ours against the reference. Figure: TFLOP/s of the real tokens' causal
      attention (4 x D x Hq x the keys each token sees).
Then steps of a few sequences, where splitting each block's keys over programs
(`kv_splits`) matters, at the 1B model's GQA 16/8, D 128, padded as the engine pads
them (T to a power of two >= 16, S to 64 sequence slots, the rest empty):
  (c) a prefix-cache hit: one sequence, a 32-token chunk over a 2048-token prefix (T 32);
  (d) decode at batch 1 and 8 over 4096-token contexts (T 16), and at batch 64 over
      512-2048 (T 64, where the decode launch does not split);
ours (the default split rule) and ours with kv_splits=1 against the reference, and our
paged decode kernel on the real sequences for (d). Figure: TB/s of K/V read.
Every implementation is first checked against the reference on the step it is timed
on; the table's `check` column says how it went. Implementations of a step are timed in
interleaved rounds (`benchmarks.common`); "x ref" is the median per-round ratio.
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (add_args, interleaved, print_table, roofline_pct, speedup,
                               time_fn, write_json)
from jaxllm.kernels import paged_attention, ragged_paged_attention

FULL = dict(hq=32, hkv=8, head_dims=(128, 64), page=16, batch=64, ctx=(1024, 2048),
            tokens=2048, decode_rows=32,
            mixed={"one chunk": [(1024, 2016)], "two chunks": [(1500, 500), (256, 1516)]},
            small=dict(hq=16, hkv=8, d=128, page=16, slots=64, prefix=2048, chunk=32,
                       ctx=4096, batches=(1, 8), wide=64, wide_ctx=(512, 2048)))
QUICK = dict(hq=8, hkv=2, head_dims=(64,), page=16, batch=4, ctx=(40, 100), tokens=64,
             decode_rows=4, mixed={"two chunks": [(50, 20), (17, 40)]},
             small=dict(hq=4, hkv=2, d=32, page=16, slots=8, prefix=70, chunk=9, ctx=90,
                        batches=(1, 3), wide=8, wide_ctx=(20, 60)))
DTYPE = jnp.bfloat16


def step_inputs(seed: int, seqs, shape: dict, d: int, pad_rows: int = 0):
    """seqs: (cached tokens, new tokens) per sequence -> the arguments of
    ragged_paged_attention, pages of every sequence a random subset of the pool."""
    rng = np.random.default_rng(seed)
    page, hq, hkv = shape["page"], shape["hq"], shape["hkv"]
    kv_lens = np.array([c + n for c, n in seqs], np.int32)
    q_lens = np.array([n for _, n in seqs], np.int32)
    need = -(-kv_lens // page)
    width = int(need.max())
    num_pages = int(need.sum()) + 8
    perm = rng.permutation(num_pages).astype(np.int32)
    tables = np.zeros((len(seqs), width), np.int32)
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[at:at + n]
        at += n
    q_starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    t = int(q_starts[-1]) + pad_rows
    return (jax.random.normal(kq, (t, hq, d), DTYPE),
            jax.random.normal(kk, (hkv, num_pages, page, d), DTYPE),
            jax.random.normal(kv, (hkv, num_pages, page, d), DTYPE),
            jnp.asarray(tables), jnp.asarray(kv_lens), jnp.asarray(q_starts))


def ours(q, k, v, t, kv_lens, q_starts):
    return ragged_paged_attention(q, k, v, t, kv_lens, q_starts, impl="pallas_triton")


def ours_unsplit(q, k, v, t, kv_lens, q_starts):
    return ragged_paged_attention(q, k, v, t, kv_lens, q_starts, impl="pallas_triton",
                                  kv_splits=1)


def ref(q, k, v, t, kv_lens, q_starts):
    return ragged_paged_attention(q, k, v, t, kv_lens, q_starts, impl="reference")


def paged_decode(q, k, v, t, kv_lens, q_starts):
    del q_starts  # one token a sequence: row b is sequence b
    return paged_attention(q, k, v, t, kv_lens, impl="pallas_triton")


def check(name, fn, args, want) -> str:
    try:
        got = fn(*args)  # (the paged decode kernel: the first rows only)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                    - want[:got.shape[0]].astype(jnp.float32))))
    except Exception as e:  # noqa: BLE001  report, keep going
        print(f"  check {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return "FAIL"
    ok = err <= 2e-2
    print(f"  check {name}: max |err| {err:.2e} (tol 2e-02) {'ok' if ok else 'FAIL'}",
          flush=True)
    return "ok" if ok else "FAIL"


def measure(step: str, impls: dict, args, rounds: int, *, kv_bytes=None, flops=None,
            **row) -> list[dict]:
    """Rows of one step: every implementation checked, then timed in interleaved rounds."""
    want = ref(*args)
    checks = {name: check(name, fn, args, want) for name, fn in impls.items()}

    def failed(name, e):
        print(f"  {step} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    jitted = {name: jax.jit(fn) for name, fn in impls.items()}
    samples = interleaved({name: (lambda f=f: time_fn(f, *args)) for name, f in jitted.items()},
                          rounds, failed)
    base = samples.get("reference")
    rows = []
    for name, ts in samples.items():
        t = statistics.median(ts)
        r = {"step": step, **row, "impl": name, "us": 1e6 * t}
        if kv_bytes is not None:
            r.update({"TB/s": kv_bytes / t / 1e12, "% HBM": roofline_pct(kv_bytes, t)})
        if flops is not None:
            r["TFLOP/s"] = flops / t / 1e12
        r.update({"x ref": speedup(base, ts) if base else None, "check": checks[name]})
        rows.append(r)
    return rows


def decode_rows(shape: dict, d: int, rounds: int) -> list[dict]:
    rng = np.random.default_rng(d)
    ctx = rng.integers(shape["ctx"][0], shape["ctx"][1] + 1, shape["batch"])
    args = step_inputs(d, [(int(c) - 1, 1) for c in ctx], shape, d)
    kv_bytes = int(ctx.sum()) * shape["hkv"] * d * 2 * jnp.dtype(DTYPE).itemsize
    return measure("decode", {"ours": ours, "paged decode": paged_decode, "reference": ref},
                   args, rounds, kv_bytes=kv_bytes, D=d, T=shape["batch"])


def mixed_rows(shape: dict, d: int, rounds: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(d + 1)
    for i, (what, chunks) in enumerate(shape["mixed"].items()):
        decode = [(int(c) - 1, 1) for c in rng.integers(*shape["ctx"], shape["decode_rows"])]
        seqs = list(chunks) + decode
        pad = shape["tokens"] - sum(n for _, n in seqs)
        assert pad >= 0, f"{what}: more than {shape['tokens']} tokens"
        args = step_inputs(d + i, seqs, shape, d, pad_rows=pad)
        # causal FLOPs of the real tokens: token i of a chunk over c cached sees c + i + 1
        seen = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
        flops = 4 * d * shape["hq"] * seen
        rows += measure(what, {"ours": ours, "reference": ref}, args, rounds, flops=flops,
                        D=d, T=shape["tokens"])
    return rows


def _bucket(n: int) -> int:
    """The engine's token bucket: a power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def small_rows(shape: dict, rounds: int) -> list[dict]:
    """Steps of a few sequences in the engine's padded buckets (module docstring, c-d)."""
    sm = dict(shape["small"])
    d, slots = sm["d"], sm["slots"]
    rng = np.random.default_rng(7)
    wide = [(int(c) - 1, 1) for c in rng.integers(*sm["wide_ctx"], sm["wide"])]
    steps = [("prefix hit", [(sm["prefix"], sm["chunk"])], False)]
    steps += [(f"decode b{b}", [(sm["ctx"] - 1, 1)] * b, True) for b in sm["batches"]]
    steps += [(f"decode b{sm['wide']}", wide, True)]
    rows = []
    for i, (what, seqs, decode) in enumerate(steps):
        n_real = len(seqs)
        seqs = seqs + [(0, 0)] * (slots - n_real)
        tokens = sum(n for _, n in seqs)
        t = _bucket(tokens)
        args = step_inputs(100 + i, seqs, sm, d, pad_rows=t - tokens)
        kv_bytes = sum(c + n for c, n in seqs) * sm["hkv"] * d * 2 * jnp.dtype(DTYPE).itemsize
        impls = {"ours": ours, "ours, kv_splits=1": ours_unsplit, "reference": ref}
        if decode:
            def paged(q, k, v, tables, kv_lens, q_starts, b=n_real):
                return paged_decode(q[:b], k, v, tables[:b], kv_lens[:b], q_starts)
            impls["paged decode"] = paged
        rows += measure(what, impls, args, rounds, kv_bytes=kv_bytes, D=d, T=t)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small shapes (runs on the CPU, interpret mode)")
    args = add_args(ap).parse_args(argv)
    shape = QUICK if args.quick else FULL
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; GQA {shape['hq']}/"
          f"{shape['hkv']}, page {shape['page']}, bf16", flush=True)
    rows = []
    for d in shape["head_dims"]:
        rows += decode_rows(shape, d, args.rounds)
        rows += mixed_rows(shape, d, args.rounds)
    rows += small_rows(shape, args.rounds)
    write_json(args.json, rows, shape={k: str(v) for k, v in shape.items()})
    print_table(rows, ["step", "D", "T", "impl", "us", "TB/s", "% HBM", "TFLOP/s", "x ref",
                       "check"],
                title=f"ragged paged attention, {args.rounds} interleaved rounds")
    return rows


if __name__ == "__main__":
    main()
