"""MoE prefill and decode on one GPU: TTFT of a prompt and TPOT at a few batch sizes, the
grouped matmul's tile variants beside the library's, in one run.

    PYTHONPATH=. python benchmarks/moe_decode.py [--config configs/deepseek_moe_1gpu.yaml]
        [--batches 1,32,64] [--prompt-len 1024] [--variants new,narrow,prefill64]
        [--chunks 3] [--json PATH] [config overrides ...]
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/moe_decode.py --quick     # smoke test

The config's model with random weights, greedy. Variants of the grouped matmul
(`kernels/pallas/gmm_triton.py`) inside the decode program; each traces and compiles its
own programs (a variant only changes how the kernel is set up, so where its programs are
the same as `new`'s by construction, `new`'s are reused):

  new        the library as it is
  narrow     new with 64-column tiles where the tiles have 16 rows (decode steps): 6 tokens'
             experts x 22 column tiles fill an H100's 132 SMs where 256 columns give 36
             programs (the same bytes, more of them in flight); decode programs only
  prefill64  new with 64-row tiles where it would take more (a prefill's ~100 rows an
             expert: fewer rows computed for straddled tiles, less reuse a tile); prefill only

Per variant: prefill of one --prompt-len prompt timed alone (back-to-back calls); TTFT as
`generate_ids` (and so benchmarks/plan_check.py) measures it: prefill dispatched, the first
decode chunk dispatched, then the first token read (a host that steps the chunk's device
loops returns from that dispatch only when it has walked the chunk); "TTFT no overlap":
prefill, then the token read. Per batch: decode chunks of 32 steps over a cache of
--prompt-len tokens, run back to back: TPOT = time / steps, and the host's time to dispatch
one chunk (the call's return, before blocking). Printed first: each compiled program's
grouped-matmul kernels (names gmm_{rows}x{columns}x{k} in its HLO; "ragged-dot" where XLA's
runs) and its while loops; the table last.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import add_args, fill_defaults, print_table, time_fn, write_json
from jaxllm import build_model, load_config
from jaxllm.inference.generate import decode_chunk, prefill
from jaxllm.inference.params import decode_params
from jaxllm.inference.step import init_cache, round_up
from jaxllm.kernels import pick
from jaxllm.kernels.pallas import gmm_triton

FULL = dict(config="configs/deepseek_moe_1gpu.yaml", batches="1,32,64", prompt_len=1024)
QUICK = dict(config="configs/tiny_moe.yaml", batches="1,2", prompt_len=32)
QUICK_OVERRIDES = ["model.n_layers=2"]
VARIANTS = ("new", "narrow", "prefill64")
STEPS, NEW_TOKENS = 32, 128  # decode chunk; the cache holds prompt + NEW_TOKENS + a chunk
OPTS = dict(temperature=0.0, top_k=0, top_p=1.0)


def _tiles(variant: str):
    """The forward tile rule of a variant (gmm_triton.tiles' signature)."""
    new = gmm_triton.tiles

    def tiles(m, groups, n, bs=None, itemsize=2):
        bm, bn = new(m, groups, n, bs, itemsize)
        if variant == "narrow" and bm == gmm_triton.MIN_BLOCK:
            bn = min(bn, 64)
        if variant == "prefill64" and bm > 64:
            bm = 64
        return bm, bn
    return tiles


@contextlib.contextmanager
def variant_of_gmm(variant: str):
    """The grouped matmul's setup as `variant` has it while tracing inside the block."""
    saved = gmm_triton.tiles
    if variant != "new":
        gmm_triton.tiles = _tiles(variant)
    jax.clear_caches()
    try:
        yield
    finally:
        gmm_triton.tiles = saved
        jax.clear_caches()


def describe(name: str, compiled) -> dict:
    """What a compiled program runs for the experts: its grouped-matmul kernels (with their
    tiles) and its while loops."""
    text = compiled.as_text()
    kernels = collections.Counter(re.findall(r"gmm(?:_rhs_t)?_\d+x\d+x\d+(?!\d)", text))
    if not kernels and "ragged-dot(" in text:
        kernels["ragged-dot (XLA)"] = text.count("ragged-dot(")
    if not kernels and "triton" in text:
        kernels["Triton calls, unnamed"] = text.count("custom-call(")
    loops = len(re.findall(r"\bwhile\(", text))
    return {"program": name, "grouped matmul": ", ".join(f"{k} x{v}" for k, v in
                                                          sorted(kernels.items())) or "-",
            "while loops": loops}


def _prompt(cfg, b: int, p: int):
    rng = np.random.default_rng(b)
    tokens = rng.integers(0, min(256, cfg.model.vocab_size), (b, p)).astype(np.int32)
    return jnp.asarray(tokens), jnp.full((b,), p, jnp.int32)


def lower_programs(params, cfg, batches, p: int, what: tuple) -> dict:
    """{"prefill": the lowered B=1 prefill, b: the lowered decode chunk at batch b}, those
    in `what` (lowering traces, so it runs under the variant's patch; compiling need not)."""
    cache_len = round_up(p + NEW_TOKENS + STEPS, 64)
    out = {}
    if "prefill" in what:
        tokens, lengths = _prompt(cfg, 1, p)
        out["prefill"] = prefill.lower(params, tokens, lengths, jax.random.key(0),
                                       cache_len=cache_len, **OPTS)
    for b in batches:
        if b in what:
            out[b] = decode_chunk.lower(params, *_decode_state(params, cfg, b, p, cache_len),
                                        steps=STEPS, eos_id=(), **OPTS)
    return out


def _decode_state(params, cfg, b: int, p: int, cache_len: int):
    return (init_cache(params, b, cache_len), jnp.ones((b,), jnp.int32),
            jnp.full((b,), p, jnp.int32), jnp.zeros((b,), bool), jax.random.key(1))


def measure_ttft(params, cfg, prefill_c, chunk_c, p: int, reps: int = 5) -> dict:
    """Prefill alone, TTFT with the first chunk dispatched before the token is read (as
    generate_ids), and without, in ms (medians over `reps`)."""
    tokens, lengths = _prompt(cfg, 1, p)
    key = jax.random.key(0)
    alone = time_fn(lambda: prefill_c(params, tokens, lengths, key)[1], target_s=0.2)
    ttft, plain = [], []
    for _ in range(reps):
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        cache, tok = prefill_c(params, tokens, lengths, key)
        chunk = chunk_c(params, cache, tok, lengths, jnp.zeros(1, bool), jax.random.key(1))
        tok.block_until_ready()
        ttft.append(time.perf_counter() - t0)
        jax.block_until_ready(chunk)
        t0 = time.perf_counter()
        tok = prefill_c(params, tokens, lengths, key)[1]
        tok.block_until_ready()
        plain.append(time.perf_counter() - t0)
    return {"prefill ms": 1e3 * alone, "TTFT ms": 1e3 * float(np.median(ttft)),
            "TTFT no overlap ms": 1e3 * float(np.median(plain))}


def measure_tpot(params, cfg, chunk_c, b: int, p: int, chunks: int) -> dict:
    """TPOT over `chunks` back-to-back decode chunks and the host's dispatch time of one,
    in ms."""
    state = _decode_state(params, cfg, b, p, round_up(p + NEW_TOKENS + STEPS, 64))
    state = chunk_c(params, *state)[:5]  # warm
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = chunk_c(params, *state)[:5]
    dispatch = time.perf_counter() - t0
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(chunks):
        state = chunk_c(params, *state)[:5]
    jax.block_until_ready(state)
    return {"TPOT ms": 1e3 * (time.perf_counter() - t0) / (chunks * STEPS),
            "chunk dispatch ms": 1e3 * dispatch}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="configs/tiny_moe.yaml (the CPU)")
    ap.add_argument("--config", help=f"default {FULL['config']}")
    ap.add_argument("--batches", help=f"comma-separated (default {FULL['batches']})")
    ap.add_argument("--prompt-len", type=int, help=f"default {FULL['prompt_len']}")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {VARIANTS} ('new' always runs)")
    ap.add_argument("--chunks", type=int, default=3, help="decode chunks timed per batch")
    ap.add_argument("overrides", nargs="*", help="config overrides")
    args = add_args(ap, rounds=None).parse_args(argv)
    fill_defaults(args, FULL, QUICK)
    overrides = (QUICK_OVERRIDES if args.quick else []) + args.overrides
    variants = [v for v in VARIANTS if v in args.variants.split(",") or v == "new"]
    bad = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {VARIANTS}")
    batches = [int(b) for b in args.batches.split(",")]
    cfg = load_config(args.config, overrides)
    m, p = cfg.model, args.prompt_len
    if m.moe is None:
        raise SystemExit(f"{args.config} has no model.moe; give an MoE config")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.config} "
          f"{' '.join(overrides)}; prompt {p}, chunks of {STEPS} steps", flush=True)
    params = decode_params(build_model(m, rngs=nnx.Rngs(0)), cfg)
    jax.block_until_ready(params)
    e, d, f, k = m.moe.num_experts, m.d_model, m.moe.expert_mlp_dim, m.moe.top_k
    for rows in [p * k] + [b * k for b in batches]:
        lhs = jax.ShapeDtypeStruct((rows, d), jnp.dtype(m.dtype))
        rhs = jax.ShapeDtypeStruct((e, d, f), jnp.dtype(m.dtype))
        print(f"grouped matmul, {rows} rows: auto picks "
              f"{pick('gmm', 'auto', lhs, rhs, jax.ShapeDtypeStruct((e,), jnp.int32)).name}")

    lowered, t0 = {}, time.perf_counter()
    for v in variants:
        need = {"new": ("prefill", *batches), "narrow": tuple(batches),
                "prefill64": ("prefill",)}[v]
        with variant_of_gmm(v):
            lowered[v] = lower_programs(params, cfg, batches, p, need)
    jobs = [(v, name) for v in lowered for name in lowered[v]]
    with ThreadPoolExecutor(min(8, len(jobs))) as pool:  # XLA compiles in parallel
        done = pool.map(lambda job: lowered[job[0]][job[1]].compile(), jobs)
        programs = collections.defaultdict(dict)
        for (v, name), c in zip(jobs, done):
            programs[v][name] = c
    print(f"lowered and compiled {len(jobs)} programs in {time.perf_counter() - t0:.0f} s",
          flush=True)
    infos, rows = [], []
    for v, name in jobs:
        prog = "prefill B=1" if name == "prefill" else f"decode B={name}"
        infos.append({"variant": v, **describe(prog, programs[v][name])})
        print(infos[-1], flush=True)
    own = lambda v, name: programs[v].get(name, programs["new"].get(name))
    for v in variants:
        if 1 in batches:  # TTFT: the prompt of one row, the first decode chunk queued
            r = {"variant": v, "batch": 1, **measure_ttft(params, cfg, own(v, "prefill"),
                                                         own(v, 1), p)}
            rows.append(r)
            print(r, flush=True)
        for b in batches:
            if b in programs[v]:
                r = {"variant": v, "batch": b, **measure_tpot(params, cfg, programs[v][b], b,
                                                              p, args.chunks)}
                rows.append(r)
                print(r, flush=True)
    write_json(args.json, rows, programs=infos)
    print_table(infos, title="compiled programs: grouped-matmul kernels and while loops")
    print_table(rows, ["variant", "batch", "prefill ms", "TTFT ms", "TTFT no overlap ms",
                       "TPOT ms", "chunk dispatch ms"],
                title=f"MoE prefill (prompt {p}) and decode, {args.config}")
    return rows


if __name__ == "__main__":
    main()
