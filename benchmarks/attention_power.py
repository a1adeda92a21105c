"""Attention kernels at the GPU's power limit: time a call, SM clock and board power
while each implementation runs alone for a few seconds, in the same run.

A kernel that keeps the tensor cores busy can draw the board's whole power budget;
the driver then lowers the SM clock (throttle reason "sw power cap"), and the time of a
call depends on the energy a FLOP costs as much as on the cycles it takes. This script
shows which case a run is in: every implementation loops back-to-back calls for
`--seconds` while `nvidia-smi` is sampled every 0.2 s (the first second of each window
is left out, so the clock has settled), `--reps` times in turn. Per mask it then gives
each implementation's time, TFLOP/s (FLOPs as in benchmarks/attention.py), median SM
clock and power, the throttle reasons seen, and against the first implementation its
speed (inverse time ratio), its clock, and its speed a clock cycle (speed / clock).

An entry of `--impls` is an implementation of `jaxllm.kernels.flash_attention` or the
name of a `pallas_mosaic` variant in benchmarks/mosaic_check.py (e.g. "mosaic multicast"),
or "gemm": an XLA (cuBLAS) bf16 matmul of N x N by N x N with N the multiple of 256
nearest to the full-mask forward's FLOPs (N = 8192 at the default shape), the board's
dense tensor-core rate at its power limit as an anchor. The ratio columns compare
TFLOP/s, which for the attention kernels of one mask is the inverse ratio of times.

  PYTHONPATH=. python3 benchmarks/attention_power.py [--shape 4,4096,32,8,128]
      [--impls cudnn,pallas_mosaic] [--masks full,causal] [--seconds 4] [--reps 2]
"""
from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp

from benchmarks.attention import attention_flops
from benchmarks.mosaic_check import VARIANTS
from jaxllm.kernels import FLASH_IMPLS, flash_attention

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
REASONS = {0x1: "idle", 0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal",
           0x40: "hw thermal", 0x80: "hw power brake"}


def sample_once():
    """(SM clock MHz, power W, throttle bit mask) of GPU 0, or None."""
    out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={QUERY}",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    try:
        clk, pw, thr = (x.strip() for x in out.stdout.strip().splitlines()[0].split(","))
        return int(clk), float(pw), int(thr, 16)
    except (ValueError, IndexError):
        return None


class Sampler:
    """Samples nvidia-smi in a thread while `with` is active; .samples after it."""

    def __init__(self, settle: float):
        self.settle, self.samples, self._stop = settle, [], threading.Event()

    def _run(self):
        t0 = time.time()
        while not self._stop.wait(0.2):
            s = sample_once()
            if s and time.time() - t0 >= self.settle:
                self.samples.append(s)

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def reasons(mask: int) -> str:
    names = [n for bit, n in REASONS.items() if mask & bit]
    return ", ".join(names) or ("none" if mask == 0 else hex(mask))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,4096,32,8,128", help="B,S,Hq,Hkv,D")
    ap.add_argument("--impls", default="cudnn,pallas_mosaic")
    ap.add_argument("--masks", default="full,causal")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if jax.default_backend() != "gpu" or not shutil.which("nvidia-smi"):
        sys.exit("attention_power.py needs an NVIDIA GPU and nvidia-smi")
    b, s, hq, hkv, d = (int(x) for x in args.shape.split(","))
    impls, masks = args.impls.split(","), args.masks.split(",")
    unknown = [n for n in impls if n not in FLASH_IMPLS and n not in VARIANTS and n != "gemm"]
    if unknown:
        sys.exit(f"unknown --impls {unknown}: choose from {list(FLASH_IMPLS)} or the "
                 f"variants {list(VARIANTS)}")
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.bfloat16)
    fns, flops = {}, {}
    n_gemm = max(256, round((attention_flops(b, hq, s, s, d, False) / 2) ** (1 / 3) / 256) * 256)
    a_gemm = jax.random.normal(ks[0], (n_gemm, n_gemm), jnp.bfloat16)
    gemm = jax.jit(lambda x: x @ x)
    for mask in masks:
        for impl in impls:
            if impl == "gemm":
                jax.block_until_ready(gemm(a_gemm))
                fns[(impl, mask)] = lambda q, k, v: gemm(a_gemm)
                flops[(impl, mask)] = 2 * n_gemm ** 3
                continue
            flops[(impl, mask)] = attention_flops(b, hq, s, s, d, mask == "causal")
            opts = dict(impl=impl) if impl in FLASH_IMPLS else dict(impl="pallas_mosaic",
                                                                      **VARIANTS[impl])
            f = jax.jit(functools.partial(flash_attention, causal=mask == "causal", **opts))
            jax.block_until_ready(f(q, k, v))
            fns[(impl, mask)] = f
    res = {key: ([], []) for key in fns}  # times (s), samples
    for rep in range(args.reps):
        for key, f in fns.items():
            n, t_end = 0, time.time() + args.seconds
            with Sampler(settle=1.0) as smp:
                t0 = time.perf_counter()
                while time.time() < t_end:
                    for _ in range(10):
                        out = f(q, k, v)
                    jax.block_until_ready(out)
                    n += 10
                dt = (time.perf_counter() - t0) / n
            res[key][0].append(dt)
            res[key][1].extend(smp.samples)
            print(f"rep {rep} {key[0]:22s} {key[1]:6s} {dt * 1e6:8.1f} us/call, "
                  f"{len(smp.samples)} samples", flush=True)

    if "gemm" in impls:
        print(f"\ngemm: {n_gemm} x {n_gemm} x {n_gemm} bf16, {2 * n_gemm ** 3:.3g} FLOPs a call")
    print(f"\nB={b} S={s} Hq={hq} Hkv={hkv} D={d} bf16, forward; {args.reps} x "
          f"{args.seconds:g} s a kernel; medians over reps / samples\n")
    print("| mask | impl | us/call | TFLOP/s | SM clock MHz [min, max] | power W | throttle "
          "| speed x first | clock x first | speed a cycle x first |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mask in masks:
        first = None
        for impl in impls:
            times, smp = res[(impl, mask)]
            t = statistics.median(times)
            clk = statistics.median(x[0] for x in smp) if smp else float("nan")
            pw = statistics.median(x[1] for x in smp) if smp else float("nan")
            thr = "; ".join(sorted({reasons(x[2]) for x in smp})) or "-"
            clks = [x[0] for x in smp] or [0]
            tfl = flops[(impl, mask)] / t / 1e12
            if first is None:
                first = (tfl, clk)
            speed, clock = tfl / first[0], clk / first[1]
            print(f"| {mask} | {impl} | {t * 1e6:.0f} | {tfl:.0f} | {clk:.0f} [{min(clks)}, "
                  f"{max(clks)}] | {pw:.0f} | {thr} | {speed:.3f} | {clock:.3f} | "
                  f"{speed / clock:.3f} |")


if __name__ == "__main__":
    main()
