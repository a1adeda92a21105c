"""Decoding end to end: TTFT, TPOT, tokens/s and % of the HBM roofline, fused kernels vs XLA.

    PYTHONPATH=. python benchmarks/decode.py [--config configs/llama_1b.yaml] [--batches 1,32]
        [--prompt-len 1024] [--new-tokens 128] [--chunk 32] [--rounds 5] [--json PATH]
        [--profile DIR] [config overrides ...]
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/decode.py --quick     # smoke test

The config's model with random weights (speed does not depend on them) decodes
--new-tokens greedy tokens (no EOS stop) after a random prompt of --prompt-len tokens per
row, through `generate_ids` (prefill, then on-device chunks of --chunk steps). Its
parameters are converted once per `inference.matmul_impl`: "auto" (the fused decode
kernels on a GPU, where the shapes fit) and "xla"; the two are timed in interleaved rounds
(figures: medians over rounds; x xla: the median per-round ratio of TPOT). tokens/s is the
decode rate, batch / TPOT. `same`: rows whose first 16 greedy tokens equal XLA's (in bf16
a near-tie may resolve differently).

HBM roofline of a step: the bytes it must read, every non-embedding weight and the output
head in the compute dtype plus the live K/V of every row (at the mean context, prompt +
new / 2), at the datasheet bandwidth; % roofline = that time / TPOT.

--profile DIR traces one decode chunk per batch and impl with `jax.profiler` (traces kept
in DIR) and prints wall and GPU-busy time per step, kernel launches per step, and the
kernels that take the most time. A step whose busy time is far below its wall time is
bound by launches and gaps, not by HBM.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import (add_args, fill_defaults, interleaved, print_table, roofline_pct,
                               speedup, write_json)
from jaxllm import build_model, load_config
from jaxllm.inference.generate import decode_chunk, generate_ids, prefill
from jaxllm.inference.params import decode_params

FULL = dict(config="configs/llama_1b.yaml", batches="1,32", prompt_len=1024, new_tokens=128,
            chunk=32)
QUICK = dict(config="configs/tiny.yaml", batches="2", prompt_len=32, new_tokens=16, chunk=8)
QUICK_OVERRIDES = ["model.n_layers=2"]
IMPLS = ("auto", "xla")
SAME_TOKENS = 16


def step_bytes(cfg, batch: int, ctx: float) -> float:
    """Bytes one decode step must read: every weight except the embedding table, the output
    head, and the K/V of `batch` rows of `ctx` tokens, in the compute dtype."""
    m = cfg.model
    weights = m.num_params(embeddings=False) + m.vocab_size * m.d_model
    kv = 2 * m.n_layers * ctx * m.n_kv_heads * m.resolved_head_dim * batch
    return jnp.dtype(m.dtype).itemsize * (weights + kv)


def measure(params: dict, cfg, batch: int, args) -> list[dict]:
    """Rows of one batch size, one per matmul impl, timed in interleaved rounds."""
    vocab = min(256, cfg.model.vocab_size)
    prompts = np.random.default_rng(batch).integers(0, vocab, (batch, args.prompt_len)).tolist()
    opts = dict(max_new_tokens=args.new_tokens, temperature=0.0, eos_id=None, chunk=args.chunk)
    runs = {impl: [] for impl in params}  # (ids, timings) per round
    compile_s = {}
    for impl, p in params.items():  # compile both before the rounds
        compile_s[impl] = generate_ids(p, prompts, warmup=True, **opts)[1]["compile_s"]

    def timer(impl):
        def once():
            runs[impl].append(generate_ids(params[impl], prompts, warmup=False, **opts))
            return runs[impl][-1][1]["tpot_s"]
        return once
    tpot = interleaved({impl: timer(impl) for impl in params}, args.rounds)
    nbytes = step_bytes(cfg, batch, args.prompt_len + args.new_tokens / 2)
    want = [row[:SAME_TOKENS] for row in runs["xla"][-1][0]]
    rows = []
    for impl, ts in tpot.items():
        t = statistics.median(ts)
        ids = runs[impl][-1][0]
        rows.append({"batch": batch, "matmul_impl": impl,
                     "TTFT ms": 1e3 * statistics.median(r[1]["ttft_s"] for r in runs[impl]),
                     "TPOT ms": 1e3 * t, "tokens/s": batch / t,
                     "% roofline": roofline_pct(nbytes, t), "x xla": speedup(tpot["xla"], ts),
                     "same": f"{sum(a[:SAME_TOKENS] == b for a, b in zip(ids, want))}/{batch}",
                     "compile s": compile_s[impl]})
        print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------------------------------
# --profile: one traced decode chunk


def profile(params, cfg, batch: int, args, trace_dir: str) -> tuple[dict, list[dict]]:
    """(summary, top kernels) of one traced chunk of `args.chunk` decode steps."""
    rng = np.random.default_rng(batch)
    tokens = jnp.asarray(rng.integers(0, min(256, cfg.model.vocab_size),
                                      (batch, args.prompt_len)), jnp.int32)
    lengths = jnp.full((batch,), args.prompt_len, jnp.int32)
    # the cache length generate_ids gives these prompts
    cache_len = -(-(-(-args.prompt_len // 16) * 16 + args.new_tokens + args.chunk) // 64) * 64
    opts = dict(temperature=0.0, top_k=0, top_p=1.0)
    cache, tok = prefill(params, tokens, lengths, jax.random.key(0), cache_len=cache_len,
                         **opts)
    state = (cache, tok, lengths, jnp.zeros(batch, bool), jax.random.key(1))
    step_opts = dict(opts, eos_id=None, steps=args.chunk)
    for _ in range(2):  # compile, then one warm chunk
        state = decode_chunk(params, *state, **step_opts)[:5]
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = decode_chunk(params, *state, **step_opts)[:5]
    jax.block_until_ready(state)
    wall_us = 1e6 * (time.perf_counter() - t0) / args.chunk
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(decode_chunk(params, *state, **step_opts))

    kernels = gpu_kernels(trace_dir)
    n = args.chunk
    summary = {"wall us/step": wall_us, "busy us/step": busy_ns(kernels) / n / 1e3,
               "kernels/step": len(kernels) / n}
    agg = collections.defaultdict(lambda: [0, 0])
    for name, _, dur in kernels:
        agg[name[:70]][0] += 1
        agg[name[:70]][1] += dur
    top = [{"kernel": name, "calls/step": count / n, "us/step": dur / n / 1e3,
            "us/call": dur / count / 1e3}
           for name, (count, dur) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:args.top]]
    return summary, top


def gpu_kernels(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start ns, duration ns) of every kernel on the GPU streams of the trace
    (the "XLA Ops" / "XLA Modules" lines only annotate them; copies left out)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit(f"no trace written under {trace_dir}")
    out = []
    for plane in jax.profiler.ProfileData.from_file(paths[0]).planes:
        if plane.name.startswith("/device:GPU"):
            out += [(ev.name, ev.start_ns, ev.duration_ns) for line in plane.lines
                    if not line.name.startswith("XLA") for ev in line.events
                    if "Memcpy" not in ev.name]
    return out


def busy_ns(kernels) -> int:
    """Length of the union of the kernels' [start, start + duration) intervals."""
    total, end = 0, -1
    for start, dur in sorted((s, d) for _, s, d in kernels):
        if start + dur > end:
            total += start + dur - max(start, end)
            end = start + dur
    return total


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="configs/tiny.yaml, short (the CPU)")
    ap.add_argument("--config", help=f"default {FULL['config']}")
    ap.add_argument("--batches", help=f"comma-separated (default {FULL['batches']})")
    ap.add_argument("--prompt-len", type=int, help=f"default {FULL['prompt_len']}")
    ap.add_argument("--new-tokens", type=int, help=f"default {FULL['new_tokens']}")
    ap.add_argument("--chunk", type=int, help=f"decode steps per device loop "
                                              f"(default {FULL['chunk']})")
    ap.add_argument("--profile", metavar="DIR", help="also trace one chunk per batch and impl "
                                                      "and print the per-kernel breakdown")
    ap.add_argument("--top", type=int, default=12, help="kernels listed by --profile")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.n_layers=8")
    args = add_args(ap).parse_args(argv)
    fill_defaults(args, FULL, QUICK, QUICK_OVERRIDES)
    cfg = load_config(args.config, args.overrides)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.config} "
          f"{' '.join(args.overrides)}; prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"greedy", flush=True)
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    params = {impl: decode_params(model, load_config(
        args.config, args.overrides + [f"inference.matmul_impl={impl}"])) for impl in IMPLS}
    del model
    rows, profiles = [], []
    for batch in map(int, args.batches.split(",")):
        rows += measure(params, cfg, batch, args)
        if args.profile:
            for impl, p in params.items():
                summary, top = profile(p, cfg, batch, args,
                                       str(Path(args.profile) / f"b{batch}_{impl}"))
                profiles.append({"batch": batch, "matmul_impl": impl, **summary, "top": top})
                if top:
                    print_table(top, title=f"batch {batch}, {impl}: top kernels")
                else:
                    print(f"batch {batch}, {impl}: no GPU kernels in the trace")
    write_json(args.json, rows, profiles=profiles)
    if profiles:
        print_table(profiles, ["batch", "matmul_impl", "wall us/step", "busy us/step",
                               "kernels/step"], title="one traced decode chunk")
    print_table(rows, title=f"decode, {args.config}, prompt {args.prompt_len}, "
                            f"{args.new_tokens} new tokens, {args.rounds} interleaved rounds")
    return rows


if __name__ == "__main__":
    main()
