"""Flash attention in MLA's shape (query-key head dim 192, value head dim 128, as DeepSeek-V3
expands its latent for training and prefill): checked against the float32 reference, then
forward and forward+backward timed, causal by default.

    PYTHONPATH=. python benchmarks/mla.py [--shapes B,S,H,Dqk,Dv;...] [--anchor B,S,Hq,Hkv,D]
        [--variants "mosaic serial-bwd,..."] [--masks causal,full] [--rounds 5] [--json P]

The check runs first, in a child process started before this one touches the GPU, so that
a kernel which faults or hangs (--check-timeout) costs only its own rows: for each of ours
and cuDNN's own MLA path, the max error of o, dq, dk and dv, max |x - ref| / max(1, max
|ref|), against the float32 reference at --check-shape (pallas_mosaic under both masks).
An implementation that fails the check is not timed.

Timed in interleaved rounds, per shape and pass:
  pallas_mosaic, pallas_triton     ours, on k [.., Dqk] and v [.., Dv]
  mosaic ...                       pallas_mosaic with the options of VARIANTS (--variants)
  cudnn                            jax.nn.dot_product_attention(implementation="cudnn") on
                                   the same inputs (it takes one head dim for k and v: the
                                   error it raises is printed)
  cudnn (mla)                      cuDNN's own Dqk != Dv path (cuDNN >= 9.10 on Hopper,
                                   through jax's private fused-attention module), if it runs
  cudnn (v padded)                 v zero-padded to Dqk, the extra outputs dropped
  cudnn (D 128), pallas_mosaic (D 128)   the same heads at head dim Dv for q, k and v
then the --anchor shape (the attention headline, B 4, S 4096, Hq 32, Hkv 8, D 128):
pallas_mosaic and cudnn, the no-regression row at equal head dims.

TFLOP/s count the unpadded work, 2 B Hq Sq Skv (Dqk + Dv), halved when causal, 3.5x for
forward+backward. x cudnn: the median per-round ratio to the first cuDNN anchor of the
shape that ran (cudnn, cudnn (mla), cudnn (v padded); for the D 128 rows cudnn (D 128)),
named in the `anchor` column.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys

from benchmarks.common import add_args, interleaved, print_table, speedup, time_fn, write_json

CHECK_SHAPE = "2,2048,16,192,128"
HEADLINE = "8,2048,16,192,128"  # configs/deepseek_mla_1gpu.yaml's heads and training batch
ANCHOR = "4,4096,32,8,128"  # benchmarks/attention.py's headline
VARIANTS = {  # name -> pallas_mosaic options over its defaults
    "mosaic serial-bwd": dict(overlap_bwd=False),  # fewer live registers in dk/dv
    "mosaic stages2": dict(num_stages=2),  # forward ring 2 deep: Q double-buffered instead
    "mosaic overlapped": dict(schedule="overlapped"),
    "mosaic pingpong": dict(schedule="pingpong"),
    "mosaic grid": dict(persistent=False, persistent_dq=False),
}
ROW = "MLA_CHECK "  # the child's result lines


def _cudnn_mla(q, k, v, *, causal, sm_scale):
    """cuDNN's fused attention with Dv != Dqk (jax.nn.dot_product_attention insists on
    k and v of one shape; the module under it does not)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    return fa.dot_product_attention(q, k, v, scale=sm_scale, mask_type=mask, qkv_layout="BTNH")


def _inputs(b, s, hq, hkv, dqk, dv, seed=0):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, s, hq, dqk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, hkv, dqk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, hkv, dv), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, s, hq, dv), jnp.bfloat16)
    return q, k, v, do


def _cases(shape, causal, variants, names=None):
    """name -> (fn(q, k, v), its inputs (q, k, v, do)) for one shape and mask; `names`
    keeps only those."""
    import jax
    import jax.numpy as jnp

    from jaxllm.kernels import flash_attention
    b, s, hq, hkv, dqk, dv = shape
    scale = dqk ** -0.5
    qkv = _inputs(*shape, seed=s + dqk + causal)

    def ours(impl, **opts):
        return functools.partial(flash_attention, causal=causal, sm_scale=scale, impl=impl,
                                 **opts)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                            implementation="cudnn")

    def padded(q, k, v):
        return cudnn(q, k, jnp.pad(v, ((0, 0),) * 3 + ((0, dqk - dv),)))[..., :dv]

    cases = {"pallas_mosaic": (ours("pallas_mosaic"), qkv),
             "pallas_triton": (ours("pallas_triton"), qkv)}
    cases.update({n: (ours("pallas_mosaic", **VARIANTS[n]), qkv) for n in variants})
    cases["cudnn"] = (cudnn, qkv)
    if dqk != dv:
        same = tuple(x[..., :dv] for x in qkv[:2]) + qkv[2:]
        cases.update({
            "cudnn (mla)": (functools.partial(_cudnn_mla, causal=causal, sm_scale=scale), qkv),
            "cudnn (v padded)": (padded, qkv),
            f"cudnn (D {dv})": (cudnn, same),
            f"pallas_mosaic (D {dv})": (ours("pallas_mosaic"), same)})
    return {n: c for n, c in cases.items() if names is None or n in names}


def _jitted(fn):
    """(forward, gradient of <o, do> in q, k, v), jitted; do is an argument so that it is
    not folded into the program."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, do):
        return jnp.vdot(fn(q, k, v).astype(jnp.float32), do.astype(jnp.float32))
    return jax.jit(fn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _error(e) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__


def check_child(shape, pairs, variants):
    """In the child: the errors of each (name, causal) against the float32 reference,
    one ROW line each (a "start" line first, so the parent knows what a crash hit)."""
    import jax
    import jax.numpy as jnp

    from jaxllm.kernels import reference
    refs = {}
    for name, causal in pairs:
        print(ROW + json.dumps(dict(start=name, causal=causal)), flush=True)
        row = dict(impl=name, mask="causal" if causal else "full")
        fn, (q, k, v, do) = _cases(shape, causal, variants, names={name})[name]
        if causal not in refs:
            ref_fn = functools.partial(reference.flash_attention, causal=causal,
                                       sm_scale=shape[4] ** -0.5)
            with jax.default_matmul_precision("highest"):
                f, g = _jitted(ref_fn)
                x32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
                refs[causal] = (f(*x32[:3]), g(*x32))
        o_ref, grads_ref = refs[causal]
        f, g = _jitted(fn)
        got = {}
        try:
            got["o"] = f(q, k, v)
            got.update(zip(("dq", "dk", "dv"), g(q, k, v, do)))
        except Exception as e:  # noqa: BLE001  one failing impl must not hide the others
            row["error"] = _error(e)
        for key, want in zip(("o", "dq", "dk", "dv"), (o_ref, *grads_ref)):
            if key in got:
                err = jnp.abs(got[key].astype(jnp.float32) - want).max()
                row[f"{key}_err"] = float(err / jnp.maximum(1.0, jnp.abs(want).max()))
        print(ROW + json.dumps(row), flush=True)


def run_check(shape_text, pairs, variants, timeout):
    """The check rows, run in child processes (a crash or hang ends one row, the rest
    run in a fresh child); before this process starts its own use of the GPU."""
    rows, todo = [], list(pairs)
    while todo:
        cmd = [sys.executable, os.path.abspath(__file__), "--check-child",
               json.dumps(dict(shape=shape_text, pairs=todo, variants=variants))]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            stdout, stderr, failure = out.stdout, out.stderr, (
                None if out.returncode == 0 else f"exit status {out.returncode}")
        except subprocess.TimeoutExpired as e:
            stdout, stderr = (x.decode() if isinstance(x, bytes) else x or ""
                              for x in (e.stdout, e.stderr))
            failure = f"no result within {timeout} s (killed)"
        started = None
        for line in stdout.splitlines():
            if line.startswith(ROW):
                row = json.loads(line[len(ROW):])
                if "start" in row:
                    started = (row["start"], row["causal"])
                else:
                    rows.append(row)
                    todo.remove(started)
                    started = None
        if failure is None and not todo:
            break
        print(f"check child: {failure or 'stopped early'}; its last output:\n"
              + "\n".join((stdout + stderr).splitlines()[-15:]), flush=True)
        if started is None:  # it died before its first row: nothing more to learn
            rows += [dict(impl=n, mask="causal" if c else "full", error=failure)
                     for n, c in todo]
            break
        name, causal = started
        rows.append(dict(impl=name, mask="causal" if causal else "full",
                         error=f"crashed or hung: {failure}"))
        todo.remove(started)
    return rows


def _anchor_of(name, times):
    """The cuDNN figure a row is read against: cudnn (D n) for the equal-dim rows of an
    MLA shape, else the first cuDNN path that ran."""
    if name.endswith(")") and "(D " in name:
        return name.replace("pallas_mosaic", "cudnn")
    return next((a for a in ("cudnn", "cudnn (mla)", "cudnn (v padded)") if a in times), None)


def bench(shape, causal, variants, rounds, skip):
    """One row per implementation and pass of one shape."""
    b, s, hq, hkv, dqk, dv = shape
    cases = {n: c for n, c in _cases(shape, causal, variants).items() if n not in skip}
    rows = []
    for kind in ("fwd", "fwd+bwd"):
        timers, errors = {}, {}
        for name, (fn, (q, k, v, do)) in cases.items():
            f, g = _jitted(fn)
            args = (f, q, k, v) if kind == "fwd" else (g, q, k, v, do)
            timers[name] = functools.partial(time_fn, *args)
        times = interleaved(timers, rounds, on_error=lambda n, e: errors.update({n: e}))
        for name in cases:
            row = dict(shape=f"{b},{s},{hq},{hkv},{dqk},{dv}",
                       mask="causal" if causal else "full", pass_=kind, impl=name)
            if name in errors:
                row["error"] = _error(errors[name])
            else:
                d = dv if "(D " in name else dqk
                flops = 2 * b * hq * s * s * (d + dv) / (2 if causal else 1)
                t = statistics.median(times[name])
                row.update(ms=1e3 * t, tflops=flops * (3.5 if kind != "fwd" else 1) / t / 1e12)
                anchor = _anchor_of(name, times)
                if anchor and anchor != name and anchor in times:
                    row.update(x_cudnn=speedup(times[anchor], times[name]), anchor=anchor)
            rows.append(row)
    return rows


def _shape(text, mla: bool):
    try:
        vals = tuple(int(x) for x in text.split(","))
        if mla:
            b, s, h, dqk, dv = vals
            return b, s, h, h, dqk, dv
        b, s, hq, hkv, d = vals
        return b, s, hq, hkv, d, d
    except ValueError:
        want = "B,S,H,Dqk,Dv" if mla else "B,S,Hq,Hkv,D"
        raise SystemExit(f"a shape here is {want} (five integers); got {text!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=HEADLINE, help="B,S,H,Dqk,Dv[;...]")
    ap.add_argument("--anchor", default=ANCHOR, help="B,S,Hq,Hkv,D at equal head dims "
                    "('' for none)")
    ap.add_argument("--masks", default="causal", help="causal,full")
    ap.add_argument("--variants", default="", help="pallas_mosaic variants to add: " +
                    ", ".join(VARIANTS))
    ap.add_argument("--check-shape", default=CHECK_SHAPE, help="B,S,H,Dqk,Dv ('' to skip)")
    ap.add_argument("--check-timeout", type=int, default=240, help="seconds for the check")
    ap.add_argument("--check-child", help=argparse.SUPPRESS)
    args = add_args(ap).parse_args()
    if args.check_child:
        job = json.loads(args.check_child)
        check_child(_shape(job["shape"], True), [tuple(p) for p in job["pairs"]],
                    job["variants"])
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    masks = [m.strip() for m in args.masks.split(",")]
    if unknown or not set(masks) <= {"causal", "full"}:
        raise SystemExit(f"unknown variants {unknown} (choose from {list(VARIANTS)}) or "
                         f"masks {masks} (causal, full)")
    causals = [m == "causal" for m in masks]

    check_rows = []
    if args.check_shape:
        _shape(args.check_shape, True)
        names = ["pallas_mosaic", *variants, "pallas_triton", "cudnn (mla)"]
        pairs = [(n, c) for c in causals for n in names]
        pairs += [("pallas_mosaic", c) for c in (True, False) if c not in causals]
        check_rows = run_check(args.check_shape, pairs, variants, args.check_timeout)

    import jax  # the backend starts only now: the check's children had the GPU to themselves

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    failed = {r["impl"] for r in check_rows if "error" in r and r["impl"].startswith(
        ("pallas", "mosaic"))}
    shapes = [_shape(x, True) for x in args.shapes.split(";") if x]
    rows = []
    for shape in shapes:
        for causal in causals:
            print(f"timing {shape} {'causal' if causal else 'full'}", flush=True)
            rows += bench(shape, causal, variants, args.rounds, skip=failed)
    if args.anchor:
        shape = _shape(args.anchor, False)
        for causal in causals:
            print(f"timing {shape} {'causal' if causal else 'full'}", flush=True)
            rows += bench(shape, causal, [], args.rounds, skip={"pallas_triton"})
    for name in sorted(failed):
        rows.append(dict(impl=name, error="not timed: failed the check"))

    if check_rows:
        print_table(check_rows, ["impl", "mask", "o_err", "dq_err", "dk_err", "dv_err", "error"],
                    title=f"max |x - ref| / max(1, max |ref|) against the float32 reference, "
                          f"B,S,H,Dqk,Dv = {args.check_shape}")
    print_table(rows, ["shape", "mask", "pass_", "impl", "ms", "tflops", "x_cudnn", "anchor",
                       "error"],
                title=f"flash attention, bf16, B,S,Hq,Hkv,Dqk,Dv; median of {args.rounds} "
                      f"interleaved rounds; x_cudnn: per-round ratio to `anchor`")
    write_json(args.json, rows, check=check_rows)


if __name__ == "__main__":
    main()
