"""The serving engine in process: its decode step against the roofline, continuous batching
against static batches, prefix caching's TTFT, warm-up and compiles.

    PYTHONPATH=. python benchmarks/engine.py [--config configs/llama_1b.yaml] [--requests 512]
        [--batch 64] [--max-seqs 256] [--profile DIR] [--json PATH] [config overrides ...]
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/engine.py --quick     # smoke test
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/engine.py --quick --host-only --max-seqs 256

The config's model with random weights (speed does not depend on them), bf16 on a GPU.
- decode step: --batch sequences of ragged contexts (uniform in --context), one new token
  each, through the engine's compiled step: the wall time of a step as the engine runs it
  (host arrays in, sampled ids out) and the device time of back-to-back steps, against the
  roofline of its bytes (every weight but the embedding, the head, the live K/V) at the read
  bandwidth measured in the same run (a reduction over a large array).
- continuous vs static: (with inference.engine.decode_window > 1, first with one step a call,
  then with decode windows) --requests requests (prompt and output lengths uniform in
  --prompt-len and --output-len, seeded, all there at the start, greedy, no EOS) through
  `Engine.generate`, and as static batches of --batch through `generate_ids` (compile
  excluded: each batch is compiled before it is timed; a batch runs to its longest output
  and only each request's own output counts). Output tokens/s and median / p99 E2E.
- a page pool too small (--small-pool F, default 4): the same workload with a pool F times
  smaller than the pages its max_num_seqs longest requests hold at their full length; every
  request must complete ("complete" counts those that reached their length), preempted and
  recomputed as pages run out ("preemptions").
- prefix caching: --prefix-requests requests sharing a --prefix-len-token prefix, sent one
  after another, with prefix caching on and off: median TTFT.
- --host-only: the continuous-batching runs alone, through stand-in steps that skip the model
  (each sample is the sequence's last one + 1) but take the real step's arguments, so the
  engine's counters time the host's work a step (scheduling, the step's arrays, dispatch;
  outputs) on any machine, e.g. the CPU: the counters (wall clock) and the engine thread's
  CPU time in each, best of 3 runs; then the host's time in one call of a stand-in step
  (its argument handling: medians of 200) and the prefix-caching runs' TTFT and phases
  through the stand-ins (--prefix-len, --prefix-requests).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import os
import pstats
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import add_args, print_table, write_json
from jaxllm import build_model, load_config
from jaxllm.inference.engine import Engine
from jaxllm.inference.generate import generate_ids
from jaxllm.inference.requests import SamplingParams
from jaxllm.inference.scheduler import Request, ScheduledStep, Scheduler
from jaxllm.plan.memory import kv_bytes_per_token
from jaxllm.plan.serving import engine_figures

FULL = dict(config="configs/llama_1b.yaml", requests=512, batch=64, max_seqs=256,
            context="512:2048", prompt_len="32:2048", output_len="16:512", prefix_len=2048,
            prefix_requests=16)
QUICK = dict(config="configs/tiny.yaml", requests=8, batch=4, max_seqs=8,
             context="16:64", prompt_len="8:64", output_len="4:16", prefix_len=64,
             prefix_requests=3)
QUICK_OVERRIDES = ["model.n_layers=2", "model.max_seq_len=256"]


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(":"))
    return lo, hi


def read_bandwidth() -> float:
    """Bytes/s of a reduction over a large bf16 array (the HBM read rate)."""
    n = (1 << 31) if jax.default_backend() == "gpu" else (1 << 22)
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n / min(times)


def step_bytes(cfg, kv_tokens: int) -> int:
    """Bytes a decode step reads: the weights but the embedding, the head, and the live cache
    (GQA K and V, or MLA's latent and rotary key: `plan.memory.kv_bytes_per_token`)."""
    m = cfg.model
    weights = m.num_params(embeddings=False) + m.vocab_size * m.d_model
    return jnp.dtype(m.dtype).itemsize * weights + kv_bytes_per_token(m) * kv_tokens


def decode_step(engine: Engine, cfg, batch: int, context: tuple[int, int], bw: float,
                profile_dir: str | None = None) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(context[0], context[1] + 1, batch)
    a = engine.scheduler.allocator
    requests, slots = [], []
    window = engine.runner.window_steps
    for i, n in enumerate(lengths):  # sequences holding n tokens; the last one is new
        req = Request(f"d{i}", [0] * int(n), SamplingParams(temperature=0), i)
        req.seq = a.allocate()
        (s,), _ = a.append([req.seq], [int(n) + window - 1])  # pages for a window too
        requests.append(req)
        slots.append(s[int(n) - 1])
    ones = np.ones(batch, np.int64)
    step = ScheduledStep(requests, np.array([r.seq for r in requests]), lengths - 1, ones,
                         np.array(slots, np.int32), -ones, ones.astype(bool), ones)
    b = engine._batch(step)
    run = engine.runner
    for _ in range(3):
        np.asarray(run.run(b))
    walls = []
    for _ in range(20):  # one step at a time, its tokens read back: no overlap
        t = time.perf_counter()
        np.asarray(run.run(b))
        walls.append(time.perf_counter() - t)
    fn = run._fn("step", b, False)
    dev = jax.device_put(b.pack())
    pools, out = fn(run.weights, run.pools, run.last, dev)
    jax.block_until_ready(out)
    steps = 50
    t = time.perf_counter()
    for _ in range(steps):
        pools, out = fn(run.weights, pools, out, dev)
    jax.block_until_ready(out)
    device = (time.perf_counter() - t) / steps
    per_window_step = None
    if window > 1:  # the same rows as a decode window: the device time of one of its steps
        b.window[:batch] = window
        wfn, wdev = run._fn("window", b, False), jax.device_put(b.pack())
        pools, _, out = wfn(run.weights, pools, out, wdev)
        jax.block_until_ready(out)
        t = time.perf_counter()
        for _ in range(steps // window + 1):
            pools, _, out = wfn(run.weights, pools, out, wdev)
        jax.block_until_ready(out)
        per_window_step = (time.perf_counter() - t) / ((steps // window + 1) * window)
    if profile_dir:  # the kernels of a few steps
        from benchmarks.decode import busy_ns, gpu_kernels
        with jax.profiler.trace(profile_dir):
            for _ in range(5):
                pools, out = fn(run.weights, pools, out, dev)
            jax.block_until_ready(out)
        kernels = gpu_kernels(profile_dir)
        top = [{"kernel": n, "calls/step": c / 5, "us/step": d / 5e3}
               for n, c, d in kernel_totals(kernels)[:15]]
        print_table(top, title=f"decode step, batch {batch}: top kernels "
                               f"(busy {busy_ns(kernels) / 5e3:.0f} us/step)")
    run.pools, run.last = pools, out
    for r in requests:
        a.free(r.seq)
    roof = step_bytes(cfg, int(lengths.sum())) / bw
    wall = statistics.median(walls)
    row = {"case": f"decode step, batch {batch}, ctx {context[0]}-{context[1]}",
           "ms": 1e3 * device, "wall ms": 1e3 * wall, "roofline ms": 1e3 * roof,
           "x roofline": device / roof, "wall x roofline": wall / roof}
    if per_window_step is not None:
        row[f"ms in a window of {window}"] = 1e3 * per_window_step
        row["window x roofline"] = per_window_step / roof
    return row


def call_cost(engine: Engine, buckets=(16, 64, 512), n: int = 30) -> list[dict]:
    """The host's time in one call of a bucket's compiled step (the device idle before
    each): with the step's arrays as the numpy buffer the engine passes, as a device buffer
    made just before (untimed), and as the same device buffer every call; and the time of
    that buffer's transfer alone. Medians, ms."""
    run, rows = engine.runner, []
    for t in (t for t in buckets if t in run.buckets):
        b = run.empty_batch(t)
        fn = run._fn("step", b, False)
        host = b.pack()
        same = jax.device_put(host)
        times = {"numpy buffer": [], "fresh device buffer": [], "same device buffer": [],
                 "transfer alone": []}
        for _ in range(n):
            for case in times:
                jax.block_until_ready(run.last)
                arg = {"numpy buffer": host, "same device buffer": same}.get(case)
                if arg is None and case == "fresh device buffer":
                    arg = jax.device_put(host)
                    jax.block_until_ready(arg)
                t0 = time.perf_counter()
                if case == "transfer alone":
                    jax.block_until_ready(jax.device_put(host))
                else:
                    run.pools, run.last = fn(run.weights, run.pools, run.last, arg)
                times[case].append(time.perf_counter() - t0)
        rows.append({"bucket": t, "buffer KB": host.nbytes / 1024,
                     **{f"{k} ms": 1e3 * statistics.median(v) for k, v in times.items()}})
    jax.block_until_ready(run.last)
    print_table(rows, title="a step's call: the host's time")
    return rows


def workload(n: int, prompt_len, output_len, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, rng.integers(prompt_len[0], prompt_len[1] + 1)).tolist()
               for _ in range(n)]
    outputs = rng.integers(output_len[0], output_len[1] + 1, n).tolist()
    return prompts, outputs


def continuous(engine: Engine, prompts, outputs) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    t0 = time.perf_counter()
    e2e, n_out, complete = [], 0, 0
    before = engine.stats()
    for out in engine.generate(prompts, params):
        if out.finished:
            e2e.append(out.finish_time - t0)
            n_out += out.completion_tokens
            complete += out.finish_reason == "length"
    total = time.perf_counter() - t0
    after = engine.stats()
    steps = after["steps"] - before["steps"]
    host = {k: 1e3 * (after[k] - before[k]) / steps for k in ("dispatch_s", "wait_s", "collect_s")}
    print(f"engine: {steps} steps ({after['windows'] - before['windows']} decode windows of "
          f"up to {engine.config.decode_window}); per step: dispatch "
          f"{host['dispatch_s']:.2f} ms, wait {host['wait_s']:.2f} ms, outputs "
          f"{host['collect_s']:.2f} ms", flush=True)
    return {"case": f"continuous batching (engine, {engine.config.max_num_seqs} seqs, "
                    f"window {engine.config.decode_window})",
            "requests": len(prompts), "complete": complete, "steps": steps,
            "dispatch ms": host["dispatch_s"], "wait ms": host["wait_s"],
            "outputs ms": host["collect_s"],
            "output tok/s": n_out / total, "median E2E s": statistics.median(e2e),
            "p99 E2E s": float(np.percentile(e2e, 99)), "total s": total,
            "preemptions": after["preemptions"] - before["preemptions"],
            "compiles": after["compiles_since_start"] - before["compiles_since_start"]}


def fresh_scheduler(engine: Engine, num_pages: int | None = None,
                    prefix_caching: bool | None = None) -> None:
    """Give the engine a new scheduler (an empty prefix cache) over the first `num_pages`
    pages of its pool (default: all of them), with prefix caching on or off (default: as
    configured); the compiled steps are kept."""
    c = engine.config
    caching = c.prefix_caching if prefix_caching is None else prefix_caching
    engine.scheduler = Scheduler(
        num_pages=num_pages or engine.num_pages, page_size=c.page_size,
        max_pages_per_seq=engine.max_pages_per_seq, max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens, prefix_caching=caching)


def small_pool(engine: Engine, prompts, outputs, factor: int) -> dict:
    """The workload through a page pool `factor` times too small for it: the pages its
    max_num_seqs longest requests hold at their full length, divided by `factor` (at least
    one full request). Every request must still complete, by preemption and recompute."""
    page, n = engine.config.page_size, engine.config.max_num_seqs
    need = sorted((-(-(len(p) + o) // page) for p, o in zip(prompts, outputs)), reverse=True)
    pages = max(need[0], sum(need[:n]) // factor)
    fresh_scheduler(engine, pages)
    row = continuous(engine, prompts, outputs)
    row["case"] = (f"continuous, page pool {factor}x too small ({pages} of the {sum(need[:n])} "
                   f"pages the load holds)")
    fresh_scheduler(engine)
    return row


def static(params, prompts, outputs, batch: int) -> dict:
    clock, e2e, n_out = 0.0, [], 0
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i:i + batch], outputs[i:i + batch]
        opts = dict(max_new_tokens=max(os_), temperature=0.0, eos_id=None)
        _, t = generate_ids(params, ps, warmup=True, **opts)  # compiled, then timed
        clock += t["generated_tokens"] / t["tokens_per_s"]
        e2e += [clock] * len(ps)
        n_out += sum(os_)
    return {"case": f"static batches of {batch} (generate_ids)", "requests": len(prompts),
            "output tok/s": n_out / clock, "median E2E s": statistics.median(e2e),
            "p99 E2E s": float(np.percentile(e2e, 99)), "total s": clock}


def prefix_ttft(engine: Engine, cfg, prefix_len: int, n: int, caching: bool) -> dict:
    """Requests sharing a prefix, one at a time, through the engine (its compiled steps)
    with a fresh scheduler, prefix caching on or off: median TTFT, and the engine's counters
    over the call that returns the first token (its dispatch: from idle the step that
    samples the first token is read before the next is dispatched; the wait for the device;
    the output work)."""
    fresh_scheduler(engine, prefix_caching=caching)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, min(cfg.model.vocab_size, 32000), prefix_len).tolist()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ttft, phases = [], {"dispatch_s": [], "call_s": [], "wait_s": [], "collect_s": []}
    for i in range(n + 1):  # the first fills the cache and is not counted
        prompt = prefix + rng.integers(0, min(cfg.model.vocab_size, 1000), 32).tolist()
        rid = engine.add_request(prompt, sp)
        before, first = dict(engine.totals), None
        while first is None:
            first = next((o for o in engine.step() if o.request_id == rid), None)
        if i:
            ttft.append(first.first_token_time - first.arrival_time)
            for k, v in phases.items():
                v.append(engine.totals[k] - before[k])
        while engine.has_unfinished():
            engine.step()
    row = {"case": f"prefix caching {'on' if caching else 'off'}, {prefix_len}-token prefix",
           "requests": n, "median TTFT ms": 1e3 * statistics.median(ttft),
           "cached tokens": engine.stats()["prefix_hits"],
           **{f"first token: {k[:-2]} ms": 1e3 * statistics.median(v)
              for k, v in phases.items()}}
    fresh_scheduler(engine)
    return row


def stand_in_device(engine: Engine) -> None:
    """Replace the engine's compiled steps by stand-ins of the same signature that skip the
    model (a sequence's sample is its last one + 1), so its counters time the host alone.
    They keep every argument (none pruned as unused), so a call hands the runtime as many
    arrays as the real step does."""
    run, vocab = engine.runner, engine.model_config.vocab_size

    def step(params, pools, last, buf):
        return pools, (last + 1) % vocab

    def window(params, pools, last, buf):
        samples = (last[None] + jnp.arange(1, run.window_steps + 1)[:, None]) % vocab
        return pools, samples, samples[-1]

    keys = [("step", t) for t in run.buckets] + [("window", t) for t in run.window_buckets]
    for kind, t in keys:
        buf = jax.ShapeDtypeStruct(run.empty_batch(t).pack().shape, jnp.int32)
        fn = jax.jit(window if kind == "window" else step, donate_argnums=(1,), keep_unused=True)
        fn = fn.lower(run.weights, run.pools, run.last, buf).compile()
        run._compiled[(kind, t, False)] = run._compiled[(kind, t, True)] = fn


def cpu_timed(engine: Engine) -> dict:
    """Wrap the engine's dispatch and output processing to add up the calling thread's CPU
    time in each: the host's work, whatever else the machine runs meanwhile."""
    spent = {"dispatch": 0.0, "outputs": 0.0}
    for attr, key in (("_dispatch", "dispatch"), ("_collect", "outputs")):
        def timed(*args, _f=getattr(engine, attr), _key=key):
            t = time.thread_time()
            try:
                return _f(*args)
            finally:
                spent[_key] += time.thread_time() - t
        setattr(engine, attr, timed)
    return spent


def host_alone(model, cfg, params, engine_kw: dict, prompts, outputs, profile: bool,
               rounds: int = 3) -> list[dict]:
    """Continuous batching through stand-in steps, one step a call and with decode windows:
    the engine's counters and its thread's CPU time a step, each the best of `rounds` runs
    (a fresh engine each)."""
    rows, windows = [], sorted({1, cfg.inference.engine.decode_window})
    for w in windows:
        runs = []
        for r in range(rounds):
            engine = Engine(model, cfg, params=params, warm_up=False, decode_window=w,
                            **engine_kw)
            stand_in_device(engine)
            spent = cpu_timed(engine)
            with host_profile(profile and w == windows[-1] and r == rounds - 1,
                              "continuous batching, stand-in steps"):
                row = continuous(engine, prompts, outputs)
            row.update({f"{k} CPU ms": 1e3 * v / row["steps"] for k, v in spent.items()})
            runs.append(row)
        best = {k: min(run[k] for run in runs) if k.endswith("ms") else v
                for k, v in runs[0].items()}
        best["case"] += f", stand-in steps, best of {rounds}"
        rows.append(best)
        print(best, flush=True)
    return rows


def kernel_totals(kernels) -> list[tuple[str, int, int]]:
    """(name, calls, total ns) of each kernel name (its first 60 characters) in a trace's
    (name, start, duration) list, the longest total first."""
    agg: dict[str, list[int]] = {}
    for name, _, dur in kernels:
        c = agg.setdefault(name[:60], [0, 0])
        c[0], c[1] = c[0] + 1, c[1] + dur
    return sorted(((n, c, d) for n, (c, d) in agg.items()), key=lambda r: -r[2])


@contextlib.contextmanager
def device_trace(trace_dir: str | None, top: int = 12):
    """Trace the block's GPU kernels into trace_dir (when given); print the device's busy
    time against the wall clock and the kernels by their total time."""
    if not trace_dir:
        yield
        return
    from benchmarks.decode import busy_ns, gpu_kernels
    t = time.perf_counter()
    with jax.profiler.trace(trace_dir):
        yield
    wall, kernels = time.perf_counter() - t, gpu_kernels(trace_dir)
    totals = kernel_totals(kernels)
    total = sum(d for _, _, d in totals)
    if not total:
        print("continuous batching, traced: no GPU kernels in the trace")
        return
    rows = [{"kernel": n, "calls": c, "s": d / 1e9, "% of kernel time": 100 * d / total}
            for n, c, d in totals[:top]]
    busy = busy_ns(kernels) / 1e9
    print_table(rows, title=f"continuous batching, traced: the device busy {busy:.2f} s of "
                            f"{wall:.2f} s (traced, the host launches every kernel itself, "
                            f"outside XLA's command buffers), {len(kernels)} kernels")


@contextlib.contextmanager
def host_profile(on: bool, title: str, top: int = 18):
    """cProfile the block when `on`; print its functions by own time."""
    if not on:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        print(f"host profile: {title}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def prefix_rows(engine: Engine, cfg, args) -> list[dict]:
    """Prefix caching on and off: median TTFT and the first token's host phases."""
    rows = []
    for caching in (True, False):
        with host_profile(args.host_profile and caching, "prefix caching on"):
            rows.append(prefix_ttft(engine, cfg, args.prefix_len, args.prefix_requests,
                                    caching))
        print(rows[-1], flush=True)
    rows[0]["x off"] = rows[1]["median TTFT ms"] / rows[0]["median TTFT ms"]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--batch", type=int, help="the decode step's and the static batches' size")
    ap.add_argument("--max-seqs", type=int, help="the engine's inference.engine.max_num_seqs")
    ap.add_argument("--context", help="decode-step contexts lo:hi")
    ap.add_argument("--prompt-len")
    ap.add_argument("--output-len")
    ap.add_argument("--prefix-len", type=int)
    ap.add_argument("--prefix-requests", type=int)
    ap.add_argument("--quick", action="store_true", help="a tiny CPU-sized run (smoke test)")
    ap.add_argument("--profile", metavar="DIR", help="trace the decode step and the last "
                    "continuous-batching run; print their kernels")
    ap.add_argument("--only-step", action="store_true", help="the decode step alone")
    ap.add_argument("--only-prefix", action="store_true",
                    help="the prefix-caching runs alone, or with --only-step after the decode "
                         "step")
    ap.add_argument("--small-pool", type=int, default=4, metavar="F",
                    help="also run the workload with a page pool F times too small for it "
                         "(0: not run; default 4)")
    ap.add_argument("--host-profile", action="store_true",
                    help="profile the host (cProfile) in the last continuous run and the "
                         "prefix-cache run; print the top functions")
    ap.add_argument("--host-only", action="store_true",
                    help="continuous batching alone, through stand-in steps that skip the model: "
                         "the host's time per step")
    ap.add_argument("overrides", nargs="*")
    add_args(ap, rounds=None)
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    overrides = (QUICK_OVERRIDES if args.quick else []) + args.overrides
    cfg = load_config(args.config, overrides)
    model = build_model(cfg.model, rngs=nnx.Rngs(0))
    from jaxllm.inference.params import decode_params
    params = decode_params(model, cfg)
    engine_kw = dict(max_num_seqs=args.max_seqs)
    if args.quick:  # a small pool and budget, unless inference.engine overrides set them
        # (the budget at least --max-seqs: every running sequence gets a token a step)
        quick = dict(num_pages=256, page_size=8,
                     max_num_batched_tokens=max(64, args.max_seqs))
        engine_kw.update({k: v for k, v in quick.items()
                          if not any(o.startswith(f"inference.engine.{k}=") for o in overrides)})

    prompts, outputs = workload(args.requests, span(args.prompt_len), span(args.output_len),
                                min(cfg.model.vocab_size, 32000))
    if args.host_only:
        rows = host_alone(model, cfg, params, engine_kw, prompts, outputs, args.host_profile)
        engine = Engine(model, cfg, params=params, warm_up=False, **engine_kw)
        stand_in_device(engine)
        call_cost(engine, n=200)
        rows += prefix_rows(engine, cfg, args)
        print_table(rows, title="serving engine (in process), stand-in steps: the host alone")
        write_json(args.json, rows)
        return
    t0 = time.perf_counter()
    engine = Engine(model, cfg, params=params, **engine_kw)
    rows = [{"case": "engine start-up (compile every bucket)", "total s": time.perf_counter() - t0,
             "buckets": len(engine.runner.buckets), "pages": engine.num_pages}]
    print(rows[-1], flush=True)
    kv_kind = "MLA latent + rotary key" if cfg.model.mla else "GQA K and V"
    held = engine_figures(engine).kv_bytes_per_token  # the pool's bytes / its token slots
    print(f"KV cache per token: the engine's pool {held:,.0f} bytes, the formula "
          f"{kv_bytes_per_token(cfg.model):,.0f} ({kv_kind}, {cfg.model.n_layers} "
          f"layers, {cfg.model.dtype})", flush=True)
    if args.only_step or not args.only_prefix:
        bw = read_bandwidth()
        print(f"read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
        rows.append(decode_step(engine, cfg, args.batch, span(args.context), bw, args.profile))
        print(rows[-1], flush=True)
        call_cost(engine)
    if args.only_step or args.only_prefix:
        if args.only_prefix:
            rows += prefix_rows(engine, cfg, args)
        print_table(rows, title="serving engine (in process)")
        return
    window = engine.config.decode_window
    if window > 1:  # the same engine with one step a call (its windows compiled but unused)
        engine.config = dataclasses.replace(engine.config, decode_window=1)
        rows.append(continuous(engine, prompts, outputs))
        print(rows[-1], flush=True)
        engine.config = dataclasses.replace(engine.config, decode_window=window)
        fresh_scheduler(engine)  # an empty prefix cache: the same prompts come again
    with host_profile(args.host_profile, "continuous batching"), \
            device_trace(args.profile and os.path.join(args.profile, "continuous")):
        rows.append(continuous(engine, prompts, outputs))
    print(rows[-1], flush=True)
    if args.small_pool:
        rows.append(small_pool(engine, prompts, outputs, args.small_pool))
        print(rows[-1], flush=True)
    prefix = prefix_rows(engine, cfg, args)
    del engine  # its page pool
    gc.collect()
    rows.append(static(params, prompts, outputs, args.batch))
    print(rows[-1], flush=True)
    for r in rows:
        if r["case"].startswith("continuous"):
            r["x static"] = r["output tok/s"] / rows[-1]["output tok/s"]
    rows += prefix
    print_table(rows, title="serving engine (in process)")
    write_json(args.json, rows, read_bandwidth=bw)


if __name__ == "__main__":
    main()
