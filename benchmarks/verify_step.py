"""One decode step of 1-16 new tokens of one sequence (a speculative verify step) against
the one-row step: the default decode program against XLA's matmuls.

    PYTHONPATH=. python benchmarks/verify_step.py [--config configs/llama_1b.yaml]
        [--rows 1,2,4,8] [--context 1024] [--steps 32] [--rounds 5] [--json PATH]
        [config overrides ...]
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/verify_step.py --quick   # smoke test

The config's model with random weights, a random prompt of --context tokens prefilled into
a contiguous cache, then per row count S and implementation a jitted device loop of
--steps steps of `step.forward` over S new tokens at positions context .. context + S - 1
(each step's greedy tokens feed the next, so the output head and the argmax stay in;
every step rewrites the same cache rows). step ms = loop time / steps: median over
interleaved rounds. "auto": the config's decode parameters (on a GPU the fused decode
matmuls take one-row steps; steps of more rows run XLA's matmuls over their weights);
"xla": inference.matmul_impl=xla. x 1-row: step time over the "auto" one-row step's (the
target for verify steps: <= 1.3); x xla: the median per-round ratio of XLA's time to this
one's (above 1: faster than XLA); max |dlogits|: the largest difference of the first
step's float32 logits from XLA's.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import (add_args, fill_defaults, interleaved, print_table, speedup,
                               write_json)
from jaxllm import build_model, load_config
from jaxllm.inference.params import decode_params
from jaxllm.inference.step import forward, init_cache, round_up

FULL = dict(config="configs/llama_1b.yaml", rows="1,2,4,8", context=1024, steps=32)
QUICK = dict(config="configs/tiny.yaml", rows="1,2,4", context=32, steps=2)
QUICK_OVERRIDES = ["model.n_layers=2"]
MAX_ROWS = 16  # new tokens a step: a verify step of k + 1 rows


@functools.partial(jax.jit, static_argnames="steps", donate_argnames="cache")
def run_steps(params, tokens, cache, start, *, steps: int):
    """`steps` decode steps of tokens (B, S) at positions start .. start + S - 1, each
    fed the previous step's greedy tokens. -> (cache, the last tokens, first logits)."""
    logits, cache, _ = forward(params, tokens, cache, start)
    first = logits

    def body(_, carry):
        cache, tok = carry
        logits, cache, _ = forward(params, tok, cache, start)
        return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    cache, tok = jax.lax.fori_loop(1, steps, body,
                                   (cache, jnp.argmax(logits, -1).astype(jnp.int32)))
    return cache, tok, first


def measure(params: dict, cfg, s: int, prefilled, args) -> tuple[dict, dict]:
    """-> (impl -> [seconds a step, one per round], impl -> first-step logits)."""
    vocab = min(256, cfg.model.vocab_size)
    tokens = jnp.asarray(np.random.default_rng(s).integers(0, vocab, (1, s)), jnp.int32)
    start = jnp.full((1,), args.context, jnp.int32)
    caches, first = {}, {}
    for impl, p in params.items():  # compile, and the logits of the first step
        cache = jax.tree.map(jnp.copy, prefilled[impl])
        cache, _, logits = run_steps(p, tokens, cache, start, steps=args.steps)
        first[impl] = np.asarray(logits, np.float32)
        caches[impl] = cache

    def timer(impl):
        def once():
            t = time.perf_counter()
            caches[impl], tok, _ = run_steps(params[impl], tokens, caches[impl], start,
                                             steps=args.steps)
            tok.block_until_ready()
            return (time.perf_counter() - t) / args.steps
        return once
    return interleaved({impl: timer(impl) for impl in params}, args.rounds), first


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="configs/tiny.yaml, short (the CPU)")
    ap.add_argument("--config", help=f"default {FULL['config']}")
    ap.add_argument("--rows", help=f"new tokens a step, comma-separated (default "
                                   f"{FULL['rows']}; at most {MAX_ROWS})")
    ap.add_argument("--context", type=int, help=f"tokens in the cache (default "
                                                f"{FULL['context']})")
    ap.add_argument("--steps", type=int, help=f"steps a device loop (default {FULL['steps']})")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.n_layers=8")
    args = add_args(ap).parse_args(argv)
    fill_defaults(args, FULL, QUICK, QUICK_OVERRIDES)
    if args.quick:
        args.rounds = min(args.rounds, 2)
    rows = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= MAX_ROWS for r in rows):
        raise ValueError(f"--rows {args.rows}: each must lie in [1, {MAX_ROWS}]")
    cfg = load_config(args.config, args.overrides)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.config} "
          f"{' '.join(args.overrides)}; context {args.context}, {args.steps} steps a loop",
          flush=True)
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    params = {"auto": decode_params(model, cfg),
              "xla": decode_params(model, load_config(
                  args.config, args.overrides + ["inference.matmul_impl=xla"]))}
    del model
    prompt = jnp.asarray(np.random.default_rng(0).integers(
        0, min(256, cfg.model.vocab_size), (1, args.context)), jnp.int32)
    cache_len = round_up(args.context + max(rows), 64)
    prefilled = {impl: forward(p, prompt, init_cache(p, 1, cache_len), jnp.zeros(1, jnp.int32),
                               prefill=True)[1] for impl, p in params.items()}
    times, diffs = {}, {}
    for s in rows:
        times[s], first = measure(params, cfg, s, prefilled, args)
        diffs[s] = float(np.abs(first["auto"] - first["xla"]).max())
        print(f"rows {s}: " + ", ".join(f"{impl} {1e3 * statistics.median(t):.3f} ms"
                                        for impl, t in times[s].items()), flush=True)
    one = statistics.median(times[rows[0]]["auto"]) if rows[0] == 1 else None
    table = []
    for s in rows:
        for impl, t in times[s].items():
            ms = 1e3 * statistics.median(t)
            table.append({"rows": s, "impl": impl, "step ms": ms,
                          "x 1-row": ms / (1e3 * one) if one else None,
                          "x xla": speedup(times[s]["xla"], t),
                          "max |dlogits|": diffs[s] if impl == "auto" else None})
    print_table(table, title="x 1-row: step time / the one-row step's (\"auto\")")
    write_json(args.json, table)
    return table


if __name__ == "__main__":
    main()
