"""The Mosaic GPU paged decode kernel (`kernels/pallas/paged_mosaic.py`) against the
pallas_triton kernel and cuDNN on a contiguous cache, in interleaved rounds (the helpers
of benchmarks/paged_decode.py), after a check against the jnp reference.

    PYTHONPATH=. python benchmarks/paged_mosaic_check.py

Variants: grid (one CTA per item) and persistent (`programs`), ring depths, and the
bare page stream (`paged_mosaic._MATH = False`: the consumer only waits for and frees
the slots), an upper bound for any kernel that reads the pages through this ring.
"""
import sys
import time

import jax.numpy as jnp
import numpy as np

from benchmarks import paged_decode as pdb
from jaxllm.kernels import reference
from jaxllm.kernels.pallas import paged_mosaic


def mosaic(bare=False, **cfg):
    inner = paged_mosaic.paged_attention.__wrapped__  # traced inline: _MATH is read then

    def fn(q, k, v, t, ln):
        paged_mosaic._MATH = not bare
        try:
            return inner(q, k, v, t, ln, sm_scale=pdb.SCALE, **cfg)
        finally:
            paged_mosaic._MATH = True
    return fn


def check():
    rng = np.random.default_rng(3)
    bad = 0
    for page in (16, 64):
        lengths = [0, 1, 15, 16, 17, 4000, 2048, 513]
        b, n = len(lengths), -(-max(lengths) // page)
        p = b * n + 5
        k, v = (jnp.asarray(rng.standard_normal((8, p, page, 128)), jnp.bfloat16)
                for _ in range(2))
        t = jnp.asarray(rng.permutation(p)[: b * n].reshape(b, n), jnp.int32)
        q = jnp.asarray(rng.standard_normal((b, 32, 128)), jnp.bfloat16)
        args = (q, k, v, t, jnp.asarray(lengths, jnp.int32))
        want = reference.paged_attention(*args, sm_scale=0.09)
        for cfg in ({}, dict(num_splits=1, programs=3), dict(num_splits=5),
                    dict(num_splits=2, programs=5, block_k=64, num_stages=5)):
            got = paged_mosaic.paged_attention(*args, sm_scale=0.09, **cfg)
            e = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            bad += e > 2e-2
            print(f"check page={page} {cfg}: max|err| {e:.2e}", flush=True)
    return bad == 0


def main():
    t0 = time.time()
    if not check():
        sys.exit("correctness check failed")
    cfgs = {
        "mosaic grid bk64 st2": dict(block_k=64, num_stages=2, num_splits=1),
        "mosaic persistent bk64 st6": dict(block_k=64, num_stages=6, num_splits=1, programs=128),
        "mosaic persistent bk128 st3": dict(block_k=128, num_stages=3, num_splits=1,
                                            programs=128),
    }
    rows = []
    for ctx in (32768, 4096):
        for page in (16, 64):
            fns = {"triton (default)": pdb.ours()}
            for name, cfg in cfgs.items():
                fns[name] = mosaic(**cfg)
                fns[name + ", bare stream"] = mosaic(bare=True, **cfg)
            rows += pdb.measure_shape(32, ctx, [page], {}, impls=("cudnn", "read"),
                                      extra=fns, rounds=3)
    copy_bw, read_bw = pdb.device_bandwidth()
    print(f"device copy {copy_bw / 1e12:.2f}, read-only {read_bw / 1e12:.2f} TB/s")
    print("\n| B | ctx | page | impl | TB/s | x cuDNN |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['B']} | {r['ctx']} | {r['page']} | {r['impl']} | {r['tbps']:.2f} "
              f"| {r['x_cudnn'] or 0:.3f} |")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
