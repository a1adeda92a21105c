"""Serving metrics (TTFT, TPOT, ITL, E2E as vLLM defines them) on hand-made timelines, the
load generator's workload, and its streaming client against a small SSE server."""
import asyncio
import json
import math
import statistics
import threading
import time

import numpy as np
import pytest

from benchmarks.serve import Req, make_workload, read_counters, run_load
from jaxllm.inference.metrics import RequestTiming, format_table, summarize


def p99(values):
    """The 99th percentile, interpolating linearly between the two nearest ranks."""
    xs = sorted(values)
    pos = 0.99 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def timeline():
    rng = np.random.default_rng(0)
    timings = []
    for i in range(6):
        start = float(rng.uniform(0, 2))
        n_chunks = int(rng.integers(1, 7))
        chunk_times = (start + np.cumsum(rng.uniform(0.01, 0.3, n_chunks))).tolist()
        end = chunk_times[-1] + float(rng.uniform(0, 0.01))
        tokens_per_chunk = 1 + i % 2  # odd requests stream two tokens a chunk
        timings.append(RequestTiming(start, chunk_times, end, n_chunks * tokens_per_chunk,
                                     int(rng.integers(5, 50)), ok=True))
    # a 1-token request: TTFT and E2E, no TPOT, no ITL
    timings.append(RequestTiming(1.0, [1.4], 1.5, 1, 7, ok=True))
    # failed requests: left out of every figure, even with chunks already received
    timings.append(RequestTiming(0.5, [0.6, 0.7], None, 0, 9, error="timed out"))
    timings.append(RequestTiming(0.2, [], None, 0, 3, error="HTTP 500"))
    return timings


def test_request_timing_definitions():
    t = RequestTiming(start=10.0, chunk_times=[10.2, 10.25, 10.45], end=10.5, output_tokens=5,
                      ok=True)
    assert t.ttft == pytest.approx(0.2)
    assert t.e2e == pytest.approx(0.5)
    assert t.tpot == pytest.approx(0.3 / 4)  # per token after the first, not per chunk
    assert t.itl == pytest.approx([0.05, 0.2])
    one = RequestTiming(start=0.0, chunk_times=[0.3], end=0.3, output_tokens=1, ok=True)
    assert one.tpot is None and one.itl == [] and one.ttft == pytest.approx(0.3)


def test_summarize_against_hand_computed_figures():
    timings = timeline()
    duration = 3.7
    s = summarize(timings, duration)
    ok = [t for t in timings if t.ok]
    assert (s["completed"], s["failed"]) == (7, 2)

    ms = lambda xs: [1e3 * x for x in xs]  # noqa: E731
    ttft = ms(t.chunk_times[0] - t.start for t in ok)
    e2e = ms(t.end - t.start for t in ok)
    tpot = ms((t.end - t.chunk_times[0]) / (t.output_tokens - 1) for t in ok
              if t.output_tokens > 1)
    itl = ms(b - a for t in ok for a, b in zip(t.chunk_times, t.chunk_times[1:]))
    assert len(tpot) == 6  # the 1-token request has none
    # pooled over requests: every gap counts once, not the mean of per-request means
    assert len(itl) == sum(len(t.chunk_times) - 1 for t in ok)
    for name, xs in {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}.items():
        assert s[f"mean_{name}_ms"] == pytest.approx(statistics.fmean(xs)), name
        assert s[f"median_{name}_ms"] == pytest.approx(statistics.median(xs)), name
        assert s[f"p99_{name}_ms"] == pytest.approx(p99(xs)), name
        assert s[f"std_{name}_ms"] == pytest.approx(statistics.pstdev(xs)), name

    out_tokens = sum(t.output_tokens for t in ok)
    prompt_tokens = sum(t.prompt_tokens for t in ok)
    assert s["output_tokens"] == out_tokens and s["prompt_tokens"] == prompt_tokens
    assert s["request_throughput"] == pytest.approx(7 / duration)
    assert s["output_throughput"] == pytest.approx(out_tokens / duration)
    assert s["total_token_throughput"] == pytest.approx((out_tokens + prompt_tokens) / duration)

    text = format_table(s, "run")
    assert f"{s['median_ttft_ms']:.2f}" in text and "failed requests" in text


def test_summarize_small_cases():
    # a known answer: TPOT from two requests, the 1-token one left out
    timings = [RequestTiming(0.0, [0.1, 0.2, 0.4], 0.4, 3, 4, ok=True),
               RequestTiming(0.0, [0.2], 0.2, 1, 4, ok=True)]
    s = summarize(timings, 1.0)
    assert s["mean_tpot_ms"] == pytest.approx(150.0)  # (400 - 100) / 2
    assert s["median_itl_ms"] == pytest.approx(150.0)  # gaps 100 and 200
    assert s["median_ttft_ms"] == pytest.approx(150.0)  # 100 and 200
    # nothing completed: counts, and no latency figures
    s = summarize([RequestTiming(0.0, error="refused")], 2.0)
    assert (s["completed"], s["failed"], s["output_throughput"]) == (1 - 1, 1, 0.0)
    assert s["median_ttft_ms"] is None and s["p99_itl_ms"] is None
    assert "-" in format_table(s)
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0)


def test_workload_is_deterministic_and_shaped():
    opts = dict(vocab=100, prompt_len=(3, 9), output_len=(2, 5), shared_prefix=4, rate=20.0)
    a = make_workload(300, seed=1, **opts)
    assert a == make_workload(300, seed=1, **opts)
    assert a != make_workload(300, seed=2, **opts)
    prefix = a[0].prompt[:4]
    for r in a:
        assert r.prompt[:4] == prefix
        assert 3 <= len(r.prompt) - 4 <= 9 and 2 <= r.output_len <= 5
        assert all(0 <= t < 100 for t in r.prompt)
    assert {len(r.prompt) - 4 for r in a} == set(range(3, 10))  # the range's both ends
    arrivals = np.array([r.arrival for r in a])
    assert arrivals[0] == 0 and (np.diff(arrivals) >= 0).all()
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.15)  # Poisson: exponential gaps
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.2)
    # another rate moves the arrivals only; inf sends everything at once
    b = make_workload(300, seed=1, **dict(opts, rate=math.inf))
    assert [r.prompt for r in b] == [r.prompt for r in a]
    assert [r.output_len for r in b] == [r.output_len for r in a]
    assert all(r.arrival == 0 for r in b)


def test_workload_from_dataset():
    rows = [{"prompt_len": 5, "output_len": 3}, {"prompt": [7, 8, 9], "output_len": 2}]
    w = make_workload(4, vocab=50, seed=0, dataset=rows, shared_prefix=2)
    assert [r.output_len for r in w] == [3, 2, 3, 2]  # cycled
    assert [len(r.prompt) for r in w] == [7, 5, 7, 5]
    assert w[1].prompt[2:] == [7, 8, 9] and w[1].prompt[:2] == w[0].prompt[:2]
    assert w == make_workload(4, vocab=50, seed=0, dataset=rows, shared_prefix=2)
    with pytest.raises(ValueError, match="rate"):
        make_workload(4, vocab=50, rate=0.0)


# ---------------------------------------------------------------------------------------
# the streaming client against an SSE server of known timing

FIRST_S, GAP_S = 0.08, 0.02


@pytest.fixture(scope="module")
def sse_server():
    """Streams max_tokens tokens, two a chunk: the first chunk FIRST_S after the request,
    then one every GAP_S; a usage chunk and [DONE]. A prompt starting with -1 gets HTTP 500."""
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        if body["prompt"][0] == -1:
            return web.Response(status=500, text="boom")
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        await asyncio.sleep(FIRST_S)
        for i in range(0, n, 2):
            if i:
                await asyncio.sleep(GAP_S)
            chunk = {"choices": [{"index": 0, "text": "ab"[:min(2, n - i)]}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                          "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def metrics(request):
        return web.Response(text="# TYPE jaxllm_preemptions_total counter\n"
                                 "jaxllm_preemptions_total 3.0\n"
                                 'jaxllm_prefix_cache_hits_total{model="m"} 5.0\n')

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/metrics", metrics)])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_client_times_a_stream(sse_server):
    reqs = [Req([1, 2, 3], 6, 0.0), Req([4] * 5, 1, 0.0), Req([-1], 4, 0.05)]
    before = time.perf_counter()  # the load's clock starts after this
    timings, duration = asyncio.run(run_load(sse_server, reqs, timeout=30,
                                             max_concurrency=None))
    six, one, bad = timings
    assert six.ok and one.ok and not bad.ok and "500" in bad.error
    assert (six.output_tokens, six.prompt_tokens, len(six.chunk_times)) == (6, 3, 3)
    assert one.output_tokens == 1 and len(one.chunk_times) == 1 and one.tpot is None
    assert FIRST_S <= six.ttft < FIRST_S + 0.5
    # each gap is the server's sleep, give or take the client's scheduling (a chunk read late
    # shortens the gap after it, so their sum can fall short of the sleeps); the last chunk
    # cannot come sooner after the start than all the sleeps together
    assert all(0 < g < GAP_S + 0.5 for g in six.itl)
    assert six.chunk_times[-1] - six.start >= (FIRST_S + 2 * GAP_S) * 0.99
    # TPOT per token: two tokens a chunk halve it against the chunk gaps
    assert six.tpot == pytest.approx((six.e2e - six.ttft) / 5)
    assert six.tpot < min(six.itl)
    # sent at its arrival, 0.05 s after the load's start (not after the first requests' starts,
    # which the client's first connections can delay)
    assert before + 0.05 - 0.01 <= bad.start < before + 0.05 + 0.5
    s = summarize(timings, duration)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 7)


def test_client_concurrency_cap_and_counters(sse_server):
    reqs = [Req([1], 2, 0.0) for _ in range(3)]
    timings, duration = asyncio.run(run_load(sse_server, reqs, timeout=30, max_concurrency=1))
    starts = sorted(t.start for t in timings)
    ends = sorted(t.end for t in timings)
    assert all(s >= e for s, e in zip(starts[1:], ends))  # one at a time
    assert duration >= 3 * FIRST_S
    assert read_counters(sse_server) == {"preemptions": 3.0, "prefix_hits": 5.0}
