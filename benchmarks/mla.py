"""Flash attention in MLA's shape (query-key head dim 192, value head dim 128, as DeepSeek-V3
expands its latent for training and prefill), forward and forward+backward, causal.

    PYTHONPATH=. python benchmarks/mla.py [--shapes B,S,H,Dqk,Dv;...] [--rounds 5] [--json P]

Ours: `pallas_triton` and `xla` on k [.., Dqk] and v [.., Dv]. Anchors in the same run:
cuDNN with v zero-padded to Dqk (what a kernel of one head dim needs: its extra output
columns are dropped), and cuDNN at head dim Dv for both (the cost of the same heads without
the rope part). TFLOP/s count the work of the unpadded shape: 2 B H S^2 (Dqk + Dv), halved
for causal, 3.5x for forward+backward; x cudnn is the ratio to the padded cuDNN anchor.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.common import add_args, interleaved, print_table, speedup, time_fn, write_json
from jaxllm.kernels import flash_attention

HEADLINE = "4,4096,16,192,128;1,16384,16,192,128"


def _inputs(b, s, h, dqk, dv):
    ks = jax.random.split(jax.random.key(0), 3)
    q, k = (jax.random.normal(x, (b, s, h, dqk), jnp.bfloat16) for x in ks[:2])
    return q, k, jax.random.normal(ks[2], (b, s, h, dv), jnp.bfloat16)


def _cases(q, k, v, backward: bool):
    """name -> jitted function of (q, k, v); the anchors pad or cut their inputs first."""
    dqk, dv = q.shape[-1], v.shape[-1]
    scale = dqk ** -0.5

    def run(impl, q, k, v):
        return flash_attention(q, k, v, causal=True, sm_scale=scale, impl=impl)

    def padded(q, k, v):  # one head dim: v padded to Dqk, the extra outputs dropped
        v = jnp.pad(v, ((0, 0),) * 3 + ((0, dqk - dv),))
        return run("cudnn", q, k, v)[..., :dv]

    def same_dim(q, k, v):  # the same heads at head dim Dv
        return run("cudnn", q[..., :dv], k[..., :dv], v)

    fns = {"pallas_triton": functools.partial(run, "pallas_triton"),
           "xla": functools.partial(run, "xla"), "cudnn (v padded)": padded,
           f"cudnn (D {dv})": same_dim}
    if backward:
        fns = {n: jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32)),
                           (0, 1, 2)) for n, f in fns.items()}
    return {n: jax.jit(f) for n, f in fns.items()}


def main():
    ap = add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--shapes", default=HEADLINE, help="B,S,H,Dqk,Dv[;...]")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(";"):
        b, s, h, dqk, dv = map(int, shape.split(","))
        q, k, v = _inputs(b, s, h, dqk, dv)
        for backward in (False, True):
            flops = 2 * b * h * s * s * (dqk + dv) / 2 * (3.5 if backward else 1.0)
            fns = _cases(q, k, v, backward)
            errors = {}
            times = interleaved({n: functools.partial(time_fn, f, q, k, v)
                                 for n, f in fns.items()}, args.rounds,
                                on_error=lambda n, e: errors.update({n: e}))
            anchor = times.get("cudnn (v padded)")
            for name in fns:
                row = {"shape": shape, "pass": "fwd+bwd" if backward else "fwd", "impl": name}
                if name in errors:
                    row["note"] = f"{type(errors[name]).__name__}: {str(errors[name])[:60]}"
                else:
                    t = sorted(times[name])[len(times[name]) // 2]
                    row.update(ms=1e3 * t, tflops=flops / t / 1e12,
                               x_cudnn=speedup(anchor, times[name]) if anchor else None)
                rows.append(row)
    print_table(rows, ["shape", "pass", "impl", "ms", "tflops", "x_cudnn", "note"],
                title="flash attention, Dqk != Dv (causal, bf16)")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
