"""Serving under load: TTFT, TPOT, ITL, E2E and throughput of the OpenAI-compatible server,
against static batches of the same requests.

    # start the server on a free port, load it, then run the same requests as static batches
    PYTHONPATH=. python benchmarks/serve.py --run DIR [--num-requests 512] [--rate inf]
        [--prompt-len 32:2048] [--output-len 16:512] [--shared-prefix 0] [--seed 0]
        [--max-concurrency N] [--compare-static 64 | --no-static] [--compare-prefix-cache]
        [--server-args "inference.engine.num_pages=256 ..."] [--json PATH]
    # against a server already running (nothing started, no static batches unless --run)
    PYTHONPATH=. python benchmarks/serve.py --url http://127.0.0.1:8000 --vocab 32000
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/serve.py --run DIR --quick   # smoke test

Workload (`make_workload`): N requests whose prompt and output lengths are drawn uniformly
from the --prompt-len and --output-len ranges (inclusive), or read from a JSONL --dataset
(lines {"prompt_len", "output_len"} or {"prompt": [ids], "output_len"}). Prompt ids are
uniform in [0, vocab). With --shared-prefix L every prompt starts with the same L tokens,
followed by its own drawn tokens (the drawn length is the part after the prefix). Arrivals
are a Poisson process at --rate requests/s (`inf`: all at once). Lengths, ids and arrivals
come from separate generators of one seed, so a different rate keeps the same requests.

Every request is streamed (`stream_options.include_usage`), greedy, with `ignore_eos` and
max_tokens = its output length, so every output runs to its length; each has a
--request-timeout, and a failed one is counted, not fatal. Metrics as vLLM defines them
(jaxllm/inference/metrics.py). --warmup requests of a second workload (another seed: other
ids and another shared prefix, the same lengths) go first, untimed, so that compilation
falls outside the figures; preemptions and prefix-cache hits are read from the server's
/metrics around the timed run.

Static batches (--compare-static B, on by default with --run / --hf): after the server is
stopped, the model is loaded in-process and the same requests run as batches of B in arrival
order through `generate_ids` (greedy, no EOS: every row runs to the batch's longest output).
A batch starts when the previous one is done and its last request has arrived; each request
counts its own output length, its TTFT is the batch's first token - its arrival and its E2E
the batch's end - its arrival (a batch returns at once: no ITL). The batches run back to
back on the device and the arrivals are laid on that timeline, so idle waits are not slept.
Compilation is excluded (generate_ids compiles each batch's shapes before timing it).

--compare-prefix-cache runs the workload against two servers, prefix caching on and off
(`inference.engine.prefix_caching=...`), and reports the ratio of their median TTFTs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import add_args, fill_defaults, print_table, write_json
from jaxllm.inference.metrics import RequestTiming, format_table, summarize

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(num_requests=512, prompt_len="32:2048", output_len="16:512", compare_static=64,
            warmup=16)
QUICK = dict(num_requests=8, prompt_len="8:64", output_len="4:16", compare_static=4, warmup=2)
METRIC_NAMES = {"preemptions": "jaxllm_preemptions_total",
                "prefix_hits": "jaxllm_prefix_cache_hits_total",
                "prefix_queries": "jaxllm_prefix_cache_queries_total"}


# ---------------------------------------------------------------------------------------
# the workload


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    output_len: int
    arrival: float  # seconds after the benchmark's start


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'32:2048' -> (32, 2048); '64' -> (64, 64)."""
    try:
        lo, hi = (int(x) for x in text.split(":")) if ":" in text else (int(text),) * 2
    except ValueError:
        raise ValueError(f"{name}={text!r} must be N or LO:HI (integers), e.g. 32:2048") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}={text!r} needs 1 <= LO <= HI")
    return lo, hi


def read_dataset(path: str) -> list[dict]:
    """JSONL lines {"prompt_len", "output_len"} or {"prompt": [ids], "output_len"}."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "output_len" not in row or ("prompt" not in row and "prompt_len" not in row):
            raise ValueError(f"{path} line {i + 1}: {line[:80]!r} needs output_len and one of "
                             f"prompt_len or prompt (a list of token ids)")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no requests")
    return rows


def make_workload(n: int, *, vocab: int, prompt_len: tuple[int, int] = (32, 2048),
                  output_len: tuple[int, int] = (16, 512), shared_prefix: int = 0,
                  rate: float = math.inf, seed: int = 0,
                  dataset: list[dict] | None = None) -> list[Req]:
    """`n` requests (the first n of `dataset`, cycled, when one is given), in arrival order;
    the same arguments give the same requests."""
    if n < 1 or vocab < 1 or shared_prefix < 0:
        raise ValueError(f"n={n} and vocab={vocab} must be >= 1, shared_prefix={shared_prefix} "
                         f">= 0")
    if not rate > 0:
        raise ValueError(f"rate={rate} must be > 0 requests/s (inf: all at once)")
    lens_rng, ids_rng, arrival_rng = (np.random.default_rng(s)
                                      for s in np.random.SeedSequence(seed).spawn(3))
    if dataset is None:
        p_lens = lens_rng.integers(prompt_len[0], prompt_len[1] + 1, n).tolist()
        o_lens = lens_rng.integers(output_len[0], output_len[1] + 1, n).tolist()
        given = [None] * n
    else:
        rows = [dataset[i % len(dataset)] for i in range(n)]
        given = [[int(t) for t in r["prompt"]] if "prompt" in r else None for r in rows]
        p_lens = [len(g) if g is not None else int(r["prompt_len"]) for g, r in zip(given, rows)]
        o_lens = [int(r["output_len"]) for r in rows]
    prefix = ids_rng.integers(0, vocab, shared_prefix).tolist()
    prompts = [prefix + (g if g is not None else ids_rng.integers(0, vocab, p).tolist())
               for g, p in zip(given, p_lens)]
    if any(len(p) == 0 for p in prompts) or min(o_lens) < 1:
        raise ValueError("every request needs a prompt of >= 1 token and output_len >= 1")
    if math.isinf(rate):
        arrivals = np.zeros(n)
    else:  # the first at 0, then exponential gaps of mean 1 / rate
        arrivals = np.concatenate([[0.0], np.cumsum(arrival_rng.exponential(1 / rate, n - 1))])
    return [Req(p, o, float(a)) for p, o, a in zip(prompts, o_lens, arrivals)]


def check_fits(reqs: list[Req], max_seq_len: int) -> None:
    longest = max(len(r.prompt) + r.output_len for r in reqs)
    if longest > max_seq_len:
        raise ValueError(f"a request of prompt + output {longest} tokens exceeds the model's "
                         f"max_seq_len={max_seq_len}; lower --prompt-len / --output-len / "
                         f"--shared-prefix")


# ---------------------------------------------------------------------------------------
# the client


async def send(session, url: str, req: Req, timeout: float) -> RequestTiming:
    """One streamed completion; any failure is recorded in the timing, never raised."""
    import aiohttp

    body = {"model": "jaxllm", "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    t = RequestTiming(start=time.perf_counter(), prompt_tokens=len(req.prompt))
    chunks, usage, done = 0, None, False
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return t
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                now = time.perf_counter()
                choice = (msg.get("choices") or [{}])[0]
                if choice.get("text") or choice.get("token_ids"):
                    t.chunk_times.append(now)
                    chunks += 1
                if msg.get("usage"):
                    usage = msg["usage"]
        t.end = time.perf_counter()
    except (asyncio.TimeoutError, TimeoutError):
        t.error = f"timed out after {timeout} s"
        return t
    except Exception as e:  # noqa: BLE001  a failed request is counted, not fatal
        t.error = f"{type(e).__name__}: {e}"
        return t
    if not done or not chunks:
        t.error = "stream ended without [DONE]" if not done else "no tokens streamed"
        return t
    t.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        t.prompt_tokens = int(usage["prompt_tokens"])
    t.ok = True
    return t


async def run_load(url: str, reqs: list[Req], *, timeout: float,
                   max_concurrency: int | None) -> tuple[list[RequestTiming], float]:
    """Send every request at its arrival time. -> (timings in request order, wall seconds)."""
    import aiohttp

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # limit=0: no connection cap of the client's own (it would cap concurrency unseen)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def one(req):
            await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
            if limit is None:
                return await send(session, url, req, timeout)
            async with limit:
                return await send(session, url, req, timeout)
        timings = await asyncio.gather(*(one(r) for r in reqs))
        return list(timings), time.perf_counter() - t0


def read_counters(url: str) -> dict:
    """The server's Prometheus counters of METRIC_NAMES (summed over labels); {} if none."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0].strip()
        for key, metric in METRIC_NAMES.items():
            if name == metric:
                found[key] = found.get(key, 0.0) + float(value)
    return found


# ---------------------------------------------------------------------------------------
# the server


class Server:
    """`python -m jaxllm.serve` on 127.0.0.1 and a free port, its log in a temporary file."""

    def __init__(self, source: list[str], args: list[str], wait_s: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="jaxllm_serve_", suffix=".log",
                                               delete=False)
        cmd = [sys.executable, "-m", "jaxllm.serve", *source, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        print(f"starting: {shlex.join(cmd)} (log {self.log.name})", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        try:
            self.wait_ready(wait_s)
        except BaseException:
            self.stop()
            raise

    def tail(self, n: int = 40) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, wait_s: float) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before "
                                   f"it was ready; the end of its log:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"the server was not ready (GET /health) within {wait_s:.0f} s "
                           f"(--server-wait); the end of its log:\n{self.tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------
# one configuration: warm-up, the timed load, the server's counters


def bench_server(url: str, reqs: list[Req], warm: list[Req], args) -> dict:
    if warm:
        warm_t, _ = asyncio.run(run_load(url, warm, timeout=args.request_timeout,
                                         max_concurrency=args.max_concurrency))
        bad = [t.error for t in warm_t if not t.ok]
        print(f"warm-up: {len(warm) - len(bad)}/{len(warm)} ok"
              + (f"; first error: {bad[0]}" if bad else ""), flush=True)
    before = read_counters(url)
    timings, duration = asyncio.run(run_load(url, reqs, timeout=args.request_timeout,
                                             max_concurrency=args.max_concurrency))
    after = read_counters(url)
    summary = summarize(timings, duration)
    for key in METRIC_NAMES:
        summary[key] = after[key] - before.get(key, 0.0) if key in after else None
    errors = sorted({t.error for t in timings if not t.ok})
    summary["errors"] = errors[:5]
    return summary


def bench_static(reqs: list[Req], args, overrides: list[str]) -> dict:
    """The requests as static batches of args.compare_static through generate_ids."""
    import jax

    from jaxllm.inference.generate import generate_ids
    from jaxllm.inference.params import decode_params

    model, cfg = load_model(args, overrides)
    params = decode_params(model, cfg)
    del model
    b = args.compare_static
    clock, timings, compile_s = 0.0, [], 0.0
    for i in range(0, len(reqs), b):
        batch = reqs[i:i + b]
        _, info = generate_ids(params, [r.prompt for r in batch],
                               max_new_tokens=max(r.output_len for r in batch),
                               temperature=0.0, eos_id=None, chunk=cfg.inference.decode_chunk,
                               warmup=True)
        start = max(clock, batch[-1].arrival)
        wall = info["generated_tokens"] / info["tokens_per_s"]  # prefill + decode, timed
        clock = start + wall
        compile_s += info["compile_s"]
        for r in batch:
            timings.append(RequestTiming(start=r.arrival, chunk_times=[start + info["ttft_s"]],
                                         end=clock, output_tokens=r.output_len,
                                         prompt_tokens=len(r.prompt), ok=True))
        print(f"static batch {i // b + 1}/{-(-len(reqs) // b)}: {len(batch)} requests, "
              f"{wall:.2f} s (compile {info['compile_s']:.1f} s)", flush=True)
    del params
    jax.clear_caches()
    summary = summarize(timings, clock)
    summary["compile_s"] = compile_s
    return summary


# ---------------------------------------------------------------------------------------
# the model's config (vocab, max_seq_len) and weights


def model_source(args) -> list[str]:
    return ["--run", args.run] if args.run else ["--hf", args.hf] if args.hf else []


def load_cfg(args, overrides: list[str]):
    """The model's config without its weights."""
    if args.run:
        from jaxllm.config import load_config

        return load_config(Path(args.run) / "config.yaml", overrides)
    from jaxllm.config import apply_overrides, config_from_dict
    from jaxllm.hf import model_section

    section = model_section(json.loads((Path(args.hf) / "config.json").read_text()))
    raw = {"model": section, "train": {"seq_len": section["max_seq_len"]}}
    return config_from_dict(apply_overrides(raw, overrides))


def load_model(args, overrides: list[str]):
    if args.run:
        from jaxllm.checkpoint import load_model as load_run

        model, cfg, _ = load_run(args.run, overrides=overrides)
        return model, cfg
    from jaxllm import hf

    return hf.load(args.hf, overrides)


# ---------------------------------------------------------------------------------------


ROW_COLUMNS = ["config", "ok", "failed", "req/s", "out tok/s", "total tok/s", "TTFT med ms",
               "TTFT p99 ms", "TPOT med ms", "ITL med ms", "E2E med ms", "E2E p99 ms",
               "preempt", "prefix hit %"]


def table_row(name: str, s: dict) -> dict:
    hits, queries = s.get("prefix_hits"), s.get("prefix_queries")
    return {"config": name, "ok": s["completed"], "failed": s["failed"],
            "req/s": s["request_throughput"], "out tok/s": s["output_throughput"],
            "total tok/s": s["total_token_throughput"],
            "TTFT med ms": s["median_ttft_ms"], "TTFT p99 ms": s["p99_ttft_ms"],
            "TPOT med ms": s["median_tpot_ms"], "ITL med ms": s["median_itl_ms"],
            "E2E med ms": s["median_e2e_ms"], "E2E p99 ms": s["p99_e2e_ms"],
            "preempt": None if s.get("preemptions") is None else int(s["preemptions"]),
            "prefix hit %": 100 * hits / queries if hits is not None and queries else None}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_argument_group("the server and the model")
    src.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000); "
                                   "otherwise one is started from --run / --hf")
    src.add_argument("--run", help="a run directory (the server's model; static batches)")
    src.add_argument("--hf", help="an HF model directory (instead of --run)")
    src.add_argument("--server-args", default="",
                     help="passed to python -m jaxllm.serve, e.g. config overrides "
                          "\"inference.engine.num_pages=256\" (overrides also apply to the "
                          "static batches)")
    src.add_argument("--server-wait", type=float, default=900.0,
                     help="seconds to wait for the server's /health")
    src.add_argument("--vocab", type=int, help="prompt ids lie in [0, vocab) (default: the "
                                               "model's vocab_size; needed with --url alone)")
    wl = ap.add_argument_group("the workload")
    wl.add_argument("--quick", action="store_true",
                    help=f"a tiny workload for the CPU: {QUICK}")
    wl.add_argument("--num-requests", type=int, help=f"default {FULL['num_requests']}")
    wl.add_argument("--prompt-len", help=f"LO:HI, uniform (default {FULL['prompt_len']})")
    wl.add_argument("--output-len", help=f"LO:HI, uniform (default {FULL['output_len']})")
    wl.add_argument("--dataset", help="JSONL: {prompt_len, output_len} or {prompt, output_len}")
    wl.add_argument("--shared-prefix", type=int, default=0,
                    help="every prompt starts with the same L random tokens")
    wl.add_argument("--rate", type=float, default=math.inf,
                    help="Poisson arrivals, requests/s (default inf: all at once)")
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    wl.add_argument("--request-timeout", type=float, default=1800.0, help="seconds a request")
    wl.add_argument("--warmup", type=int, help=f"untimed requests first (default "
                                               f"{FULL['warmup']})")
    cmp = ap.add_argument_group("comparisons")
    cmp.add_argument("--compare-static", type=int, metavar="B",
                     help=f"static batch size (default {FULL['compare_static']}; "
                          f"with --run / --hf)")
    cmp.add_argument("--no-static", action="store_true", help="skip the static batches")
    cmp.add_argument("--compare-prefix-cache", action="store_true",
                     help="two servers, prefix caching on and off (with --run / --hf)")
    args = add_args(ap, rounds=None).parse_args(argv)
    fill_defaults(args, FULL, QUICK)
    if args.run and args.hf:
        ap.error("give one of --run and --hf")
    if not (args.url or args.run or args.hf):
        ap.error("give --url (a running server) or --run / --hf (one is started)")
    if args.compare_prefix_cache and (args.url or not (args.run or args.hf)):
        ap.error("--compare-prefix-cache starts its own servers: give --run / --hf, no --url")
    if args.no_static or not (args.run or args.hf):
        args.compare_static = 0
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    server_args = shlex.split(args.server_args)
    overrides = [a for a in server_args if "=" in a and not a.startswith("-")]
    cfg = load_cfg(args, overrides) if (args.run or args.hf) else None
    vocab = args.vocab or (cfg.model.vocab_size if cfg else None)
    if vocab is None:
        raise ValueError("--url alone does not say the model's vocabulary: pass --vocab N "
                         "(or --run / --hf)")
    dataset = read_dataset(args.dataset) if args.dataset else None
    shape = dict(vocab=vocab, prompt_len=parse_range(args.prompt_len, "--prompt-len"),
                 output_len=parse_range(args.output_len, "--output-len"),
                 shared_prefix=args.shared_prefix, rate=args.rate, dataset=dataset)
    reqs = make_workload(args.num_requests, seed=args.seed, **shape)
    # the warm-up: fresh ids of the same lengths, so it leaves nothing in the prefix cache
    # that the timed requests could hit
    warm_rows = dataset and [
        {"prompt_len": len(r["prompt"]) if "prompt" in r else r["prompt_len"],
         "output_len": r["output_len"]} for r in dataset]
    warm = (make_workload(args.warmup, seed=args.seed + 1,
                          **dict(shape, rate=math.inf, dataset=warm_rows)) if args.warmup else [])
    if cfg is not None:
        check_fits(reqs + warm, cfg.model.max_seq_len)
    n_prompt = sum(len(r.prompt) for r in reqs)
    n_out = sum(r.output_len for r in reqs)
    print(f"{len(reqs)} requests, {n_prompt} prompt / {n_out} output tokens, rate {args.rate} "
          f"req/s, shared prefix {args.shared_prefix}, seed {args.seed}", flush=True)

    if args.compare_prefix_cache:
        servers = {"server, prefix cache on": ["inference.engine.prefix_caching=true"],
                   "server, prefix cache off": ["inference.engine.prefix_caching=false"]}
    else:
        servers = {"server": []}
    summaries = {}
    for name, extra in servers.items():
        if args.url:
            summaries[name] = bench_server(args.url.rstrip("/"), reqs, warm, args)
        else:
            server = Server(model_source(args), server_args + extra, args.server_wait)
            try:
                summaries[name] = bench_server(server.url, reqs, warm, args)
            finally:
                server.stop()
        print(format_table(summaries[name], name), flush=True)
        if summaries[name]["errors"]:
            print(f"errors: {summaries[name]['errors']}")
    served = next(iter(summaries.values()))
    static = None
    if args.compare_static:
        name = f"static B={args.compare_static}"
        static = summaries[name] = bench_static(reqs, args, overrides)
        print(format_table(static, name), flush=True)

    rows = [table_row(name, s) for name, s in summaries.items()]
    ratios = {}
    if static is not None and static["output_throughput"]:
        ratios["server / static output tok/s"] = (served["output_throughput"]
                                                  / static["output_throughput"])
    if args.compare_prefix_cache:
        on, off = (summaries[k]["median_ttft_ms"] for k in servers)
        if on and off:
            ratios["prefix cache off / on median TTFT"] = off / on
    write_json(args.json, rows, summaries=summaries, ratios=ratios,
               workload={"num_requests": len(reqs), "prompt_tokens": n_prompt,
                         "output_tokens": n_out, "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "dataset": args.dataset,
                         "shared_prefix": args.shared_prefix, "rate": args.rate,
                         "seed": args.seed, "max_concurrency": args.max_concurrency,
                         "warmup": args.warmup, "server_args": args.server_args})
    lengths = (f"dataset {args.dataset}" if args.dataset else
               f"prompts {args.prompt_len}, outputs {args.output_len}")
    print_table(rows, ROW_COLUMNS, title=f"serving, {len(reqs)} requests, {lengths}, shared "
                                         f"prefix {args.shared_prefix}, rate {args.rate}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    return {"rows": rows, "summaries": summaries, "ratios": ratios}


if __name__ == "__main__":
    main()
