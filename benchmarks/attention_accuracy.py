"""Forward error of the attention kernels against the float32 reference, plain and peaked.

B=1 S=4096 Hq=8 Hkv=2, bf16, causal and full, head dims --dims. K and V are standard
normal; Q is standard normal times each --q-scales factor: a larger factor makes each
row's softmax peaked (a few keys carry most of the weight), where the rounding of P to
bf16 before the P V product shows most. For each implementation: max and mean
|o - reference| in float32, the reference (`kernels/reference.py`) run on the inputs
cast to float32 at highest matmul precision. "mosaic running-max" is `pallas_mosaic`
with `fixed_max=False`; "pallas_mosaic" is its default (each row shifted by its first
key tile's max). An implementation that fails prints its error and the script goes on.

  PYTHONPATH=. python3 benchmarks/attention_accuracy.py [--dims 64,128,256]
      [--q-scales 1,4] [--impls cudnn,pallas_mosaic,mosaic running-max,pallas_triton]
"""
from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp

from jaxllm.kernels import flash_attention, reference

B, S, HQ, HKV = 1, 4096, 8, 2
IMPLS = {
    "cudnn": dict(impl="cudnn"),
    "pallas_mosaic": dict(impl="pallas_mosaic"),
    "mosaic running-max": dict(impl="pallas_mosaic", fixed_max=False),
    "pallas_triton": dict(impl="pallas_triton"),
    "xla": dict(impl="xla"),
}


def errors(fn, q, k, v, ref):
    o = jax.jit(fn)(q, k, v).astype(jnp.float32)
    e = jnp.abs(o - ref)
    return float(e.max()), float(e.mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--q-scales", default="1,4")
    ap.add_argument("--impls", default="cudnn,pallas_mosaic,mosaic running-max,pallas_triton")
    args = ap.parse_args()
    impls = [n.strip() for n in args.impls.split(",") if n.strip()]
    unknown = [n for n in impls if n not in IMPLS]
    if unknown:
        raise SystemExit(f"unknown implementations {unknown}; choose from {list(IMPLS)}")
    try:
        dims = [int(x) for x in args.dims.split(",")]
        scales = [float(x) for x in args.q_scales.split(",")]
    except ValueError as e:
        raise SystemExit(f"--dims and --q-scales want comma-separated numbers: {e}")
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for d, causal, scale in itertools.product(dims, (False, True), scales):
        mask = "causal" if causal else "full"
        ks = jax.random.split(jax.random.key(d + causal), 3)
        q = (scale * jax.random.normal(ks[0], (B, S, HQ, d), jnp.float32)).astype(jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, S, HKV, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, S, HKV, d), jnp.bfloat16)
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(functools.partial(reference.flash_attention, causal=causal))(
                *(x.astype(jnp.float32) for x in (q, k, v)))
        cells = []
        for name in impls:
            fn = functools.partial(flash_attention, causal=causal, **IMPLS[name])
            try:
                mx, mean = errors(fn, q, k, v, ref)
                cells.append(f"{mx:.2g} / {mean:.2g}")
            except Exception as e:  # noqa: BLE001  keep going
                cells.append(type(e).__name__)
                print(f"!! {name} D={d} {mask} q x{scale:g}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
        print(f"D={d} {mask} q x{scale:g}: " + " | ".join(cells), flush=True)
        rows.append((d, mask, scale, cells))

    print(f"\n## max / mean |o - reference| (B={B} S={S} Hq={HQ} Hkv={HKV} bf16)\n")
    print("| D | mask | Q | " + " | ".join(impls) + " |")
    print("|---|---|---|" + "---|" * len(impls))
    for d, mask, scale, cells in rows:
        print(f"| {d} | {mask} | {scale:g} · N(0, 1) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
