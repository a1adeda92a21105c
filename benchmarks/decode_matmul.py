"""Decode steps with XLA's matmuls against jaxllm's fused decode kernels, same model.

    PYTHONPATH=. python benchmarks/decode_matmul.py [--config configs/llama_1b.yaml]
        [--batches 1,4,16] [--sweep launch|rows|merge]

The decode form of the model (per-layer weights, q/k/v and gate/up joined) decodes
--new-tokens greedy tokens after a random prompt of --prompt-len, once with
`inference.matmul_impl=xla` (cuBLAS / XLA fusions between the weight reads) and once with
`pallas_triton` (kernels/pallas/gemv_triton.py: norm, RoPE, cache writes, SwiGLU and
residual adds inside the four weight reads of each layer). Printed per batch: whether
both give the same first --check greedy tokens (bf16: near-ties may differ) and the
largest logit difference of one decode step against the logits' spread.
--sweep also times other launch settings of the kernels (gemv_triton.TUNED). Printed
last: TPOT, tokens/s and % of the HBM roofline (weights + live K/V read once per step at
the datasheet bandwidth) per batch and variant.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import load_config
from jaxllm.inference.decode import generate_ids, inference_params
from jaxllm.kernels.pallas import gemv_triton
from jaxllm.model import build_model

HBM_DATASHEET = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
SWEEPS = {  # launch settings (gemv_triton.TUNED) to time besides the defaults
    "launch": [dict(prefetch=2), dict(prefetch=0), dict(fma_block_rows=1),
               dict(fma_block_rows=4), dict(fma_elems=16384), dict(num_warps=4)],
    "rows": [dict(fma_rows=0), dict(fma_rows=16)],  # tensor cores / CUDA cores at any rows
    "merge": [dict(split_counters=False)],  # attention splits merged by XLA after the kernel
}


def apply_tuned(opts: dict):
    """Set launch settings (keys of gemv_triton.TUNED); returns a function that restores
    the previous ones."""
    unknown = set(opts) - set(gemv_triton.TUNED)
    if unknown:
        raise SystemExit(f"unknown launch settings {sorted(unknown)}")
    saved = dict(gemv_triton.TUNED)
    gemv_triton.TUNED.update(opts)
    return lambda: gemv_triton.TUNED.update(saved)


def step_logits(graphdef, params, cache, token, pos):
    model = nnx.merge(graphdef, params)
    return model.forward_cached(token[:, None], cache, pos)[0][:, 0]


def compare_logits(forms, batch: int, prompt_len: int):
    """One decode step after the same prefill, in both forms: max |logit difference|
    against the spread of the logits (bf16 weights: rounding differs, not the math)."""
    from jaxllm.inference.decode import decode_steps

    rng = np.random.default_rng(batch)
    tokens = jnp.asarray(rng.integers(0, 256, size=(batch, prompt_len)), jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    graphdef, params = forms["xla"]
    prefill, _ = decode_steps(graphdef)
    cache, tok = prefill(params, tokens, lengths, jax.random.key(0), cache_len=prompt_len + 64,
                         temperature=0.0, top_k=0, top_p=1.0)
    step = jax.jit(step_logits, static_argnums=0)
    want = step(graphdef, params, cache, tok, lengths)
    got = step(*forms["pallas_triton"], cache, tok, lengths)
    return float(jnp.abs(got - want).max()), float(want.std())


def roofline_s(cfg, batch: int, ctx: float) -> float:
    bw = next((v for k, v in HBM_DATASHEET.items() if k in jax.devices()[0].device_kind), None)
    m = cfg.model
    weights = 2 * (m.num_params(embeddings=False) + m.vocab_size * m.d_model)
    kv = 2 * m.n_layers * ctx * m.n_kv_heads * m.resolved_head_dim * 2 * batch
    return (weights + kv) / bw if bw else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/llama_1b.yaml")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--check", type=int, default=16)
    ap.add_argument("--sweep", choices=sorted(SWEEPS), default=None,
                    help="also time these launch settings, at every batch")
    ap.add_argument("--tuned", default=None,
                    help="JSON of gemv_triton.TUNED entries to use as the defaults, e.g. "
                         "'{\"fma_block_rows\": {\"none\": 4, \"glu\": 2, \"qkv\": 2}}'")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.tuned:
        apply_tuned(json.loads(args.tuned))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    cfg = load_config(args.config, args.overrides)
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    forms = {}
    for impl in ("xla", "pallas_triton"):
        c = load_config(args.config, args.overrides + [f"inference.matmul_impl={impl}"])
        forms[impl] = inference_params(model, c, unstack=True, fuse=True)
    del model
    ctx = args.prompt_len + args.new_tokens / 2
    rows = []

    def run(name, impl, batch):
        rng = np.random.default_rng(batch)  # every variant of a batch sees the same prompts
        prompts = rng.integers(0, 256, size=(batch, args.prompt_len)).tolist()
        graphdef, params = forms[impl]
        jax.clear_caches()  # launch settings are read when the step is traced
        ids, t = generate_ids(graphdef, params, prompts, max_new_tokens=args.new_tokens,
                              temperature=0.0, eos_id=None, chunk=args.chunk)
        floor = roofline_s(cfg, batch, ctx)
        rows.append((batch, name, t["tpot_s"], batch / t["tpot_s"], 100 * floor / t["tpot_s"]))
        print(rows[-1], flush=True)
        return ids

    for batch in map(int, args.batches.split(",")):
        want = run("xla", "xla", batch)
        got = run("pallas_triton", "pallas_triton", batch)
        same = sum(a[:args.check] == b[:args.check] for a, b in zip(want, got))
        diff, spread = compare_logits(forms, batch, args.prompt_len)
        print(f"batch {batch}: first {args.check} greedy tokens agree on {same}/{batch} rows; "
              f"one step's logits: max |pallas - xla| {diff:.4f}, logits std {spread:.4f}",
              flush=True)
        if args.sweep:
            for opts in SWEEPS[args.sweep]:
                restore = apply_tuned(opts)
                run(f"pallas_triton {opts}", "pallas_triton", batch)
                restore()

    print(f"\nprompt {args.prompt_len}, {args.new_tokens} new tokens, greedy")
    print("| batch | matmuls | TPOT ms | tokens/s | % HBM roofline |")
    print("| --- | --- | --- | --- | --- |")
    for b, name, tpot, tps, pct in rows:
        print(f"| {b} | {name} | {1e3 * tpot:.3f} | {tps:,.0f} | {pct:.0f}% |")


if __name__ == "__main__":
    main()
