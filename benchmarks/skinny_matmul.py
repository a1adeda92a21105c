"""Decode-shaped matmuls on the GPU: XLA's dot against jaxllm's skinny Pallas kernel.

    PYTHONPATH=. python benchmarks/skinny_matmul.py [--rows 1,8] [--config configs/llama_1b.yaml]

For each weight matrix of a decode step of the config (q/k/v and gate/up joined, as
`Decoder.fuse_projections` makes them, the output projection, the MLP down projection),
x [M, K] @ w [K, N] in bf16 with M rows (batch x new tokens). Effective bandwidth = weight
bytes / time: the step is a weight stream. Each timing is the median of 5 runs of one
executable that runs 16 calls back to back over 8 weight copies (more bytes than the
50 MB L2), divided by 16. Results are checked against a float32 dot first.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import load_config
from jaxllm.kernels.pallas.matmul_triton import skinny_matmul

CALLS, COPIES = 16, 8


def timed(fn, xs, ws):
    run = jax.jit(lambda xs, ws: [fn(xs[i], ws[i % COPIES]) for i in range(CALLS)])
    jax.block_until_ready(run(xs, ws))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(run(xs, ws))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / CALLS


def per_sm(s: int):
    sms = getattr(jax.devices()[0], "core_count", 132) or 132
    return lambda x, w: skinny_matmul(x, w, split_k=max(1, -(-s * sms // (w.shape[1] // 128))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/llama_1b.yaml")
    ap.add_argument("--rows", default="1,8")
    args = ap.parse_args()
    m = load_config(args.config).model
    d, hd = m.d_model, m.resolved_head_dim
    shapes = {"qkv": (d, (m.n_heads + 2 * m.n_kv_heads) * hd), "o": (m.n_heads * hd, d),
              "gate_up": (d, 2 * m.mlp_dim), "down": (m.mlp_dim, d)}
    variants = {"xla dot": lambda x, w: x @ w, "skinny": skinny_matmul}
    for s in (1, 2, 4):  # programs per SM (the default aims at ~3)
        variants[f"skinny ~{s} programs/SM"] = per_sm(s)
    variants["skinny bk128 st3"] = lambda x, w: skinny_matmul(x, w, block_k=128, num_stages=3)
    variants["skinny bn64 w2"] = lambda x, w: skinny_matmul(x, w, block_n=64, num_warps=2)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in shapes.items():
            key = jax.random.key(k * n + rows)
            ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.05
                  for i in range(COPIES)]
            xs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (rows, k), jnp.bfloat16)
                  for i in range(CALLS)]
            want = np.asarray(jnp.dot(xs[0].astype(jnp.float32), ws[0].astype(jnp.float32)))
            for vname, fn in variants.items():
                try:
                    got = np.asarray(jax.jit(fn)(xs[0], ws[0]), np.float32)
                    err = float(np.abs(got - want).max())
                    t = timed(fn, xs, ws)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"  {rows} {name} {vname}: failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}", flush=True)
                    continue
                tbps = k * n * 2 / t / 1e12
                rows_out.append((rows, name, k, n, vname, 1e6 * t, tbps, err))
                print(f"  M={rows} {name} [{k}x{n}] {vname:24s} {1e6 * t:7.2f} us "
                      f"{tbps:5.2f} TB/s  max err {err:.3g}", flush=True)
    print("\n| M | matrix | K x N | impl | us | TB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows, name, k, n, vname, us, tbps, _ in rows_out:
        print(f"| {rows} | {name} | {k} x {n} | {vname} | {us:.2f} | {tbps:.2f} |")


if __name__ == "__main__":
    main()
