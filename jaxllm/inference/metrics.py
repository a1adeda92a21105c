"""Serving latency metrics, defined as vLLM's serving benchmark defines them.

One `RequestTiming` per request, in seconds of one clock (time.perf_counter):

    TTFT  time to first token: the first streamed chunk's arrival - the send time
    E2E   end to end: the end of the response - the send time
    TPOT  time per output token after the first: (E2E - TTFT) / (output tokens - 1);
          undefined for a 1-token output, which the TPOT statistics leave out
    ITL   inter-token latency: the gaps between consecutive chunks of one request; the
          statistics pool the gaps of every request (a long output weighs more than a
          short one, unlike TPOT, which is one figure per request)

A streamed chunk can carry more than one token, so ITL and TPOT need not agree: TPOT
divides by tokens, ITL measures chunks. `summarize` takes the completed requests only;
failed ones are counted and otherwise left out. Throughputs are over the benchmark's wall
time: requests/s, output tokens/s, and (prompt + output) tokens/s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "median", "p99", "std")


@dataclass
class RequestTiming:
    """One request's timeline. `chunk_times`: the arrival time of every streamed chunk that
    carried text or tokens; `output_tokens` as the server counts them (its usage report)."""

    start: float  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None  # when the response was complete
    output_tokens: int = 0
    prompt_tokens: int = 0
    ok: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()


def _stats(values: list[float]) -> dict:
    """mean / median / p99 (linear interpolation) / std (population) in ms; None when empty."""
    if not values:
        return dict.fromkeys(STATS)
    ms = 1e3 * np.asarray(values, np.float64)
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            "p99": float(np.percentile(ms, 99)), "std": float(ms.std())}


def summarize(timings: list[RequestTiming], duration_s: float) -> dict:
    """The figures of one benchmark run that took `duration_s` of wall time.

    Keys: completed, failed, duration_s, prompt_tokens, output_tokens,
    request_throughput (requests/s), output_throughput and total_token_throughput
    (tokens/s), and `{stat}_{metric}_ms` for stat in mean / median / p99 / std and metric in
    ttft / tpot / itl / e2e (None where no request defines the metric)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s={duration_s} must be > 0 (the run's wall time)")
    done = [t for t in timings if t.ok]
    samples = {
        "ttft": [t.ttft for t in done if t.ttft is not None],
        "tpot": [t.tpot for t in done if t.tpot is not None],
        "itl": [gap for t in done for gap in t.itl],
        "e2e": [t.e2e for t in done if t.e2e is not None],
    }
    prompt = sum(t.prompt_tokens for t in done)
    output = sum(t.output_tokens for t in done)
    out = {"completed": len(done), "failed": len(timings) - len(done),
           "duration_s": duration_s, "prompt_tokens": prompt, "output_tokens": output,
           "request_throughput": len(done) / duration_s,
           "output_throughput": output / duration_s,
           "total_token_throughput": (prompt + output) / duration_s}
    for metric in METRICS:
        for stat, v in _stats(samples[metric]).items():
            out[f"{stat}_{metric}_ms"] = v
    return out


_TITLES = {"ttft": "time to first token", "tpot": "time per output token (after the 1st)",
           "itl": "inter-token latency", "e2e": "end-to-end latency"}


def format_table(summary: dict, title: str = "serving benchmark") -> str:
    """A summary as aligned text lines, one figure a line."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [("completed requests", num(summary["completed"], "d")),
             ("failed requests", num(summary["failed"], "d")),
             ("duration (s)", num(summary["duration_s"], ".2f")),
             ("prompt tokens", num(summary["prompt_tokens"], "d")),
             ("output tokens", num(summary["output_tokens"], "d")),
             ("request throughput (req/s)", num(summary["request_throughput"], ".2f")),
             ("output token throughput (tok/s)", num(summary["output_throughput"], ".1f")),
             ("total token throughput (tok/s)", num(summary["total_token_throughput"], ".1f"))]
    sections = [(None, lines)]
    for metric in METRICS:
        sections.append((_TITLES[metric], [
            (f"{stat} {metric.upper()} (ms)", num(summary.get(f"{stat}_{metric}_ms"), ".2f"))
            for stat in STATS]))
    width = max(len(k) for _, rows in sections for k, _ in rows) + 2
    vwidth = max(len(v) for _, rows in sections for _, v in rows)
    rule = "=" * (width + vwidth)
    text = [f" {title} ".center(width + vwidth, "="), ]
    for head, rows in sections:
        if head:
            text.append(f" {head} ".center(width + vwidth, "-"))
        text += [k.ljust(width) + v.rjust(vwidth) for k, v in rows]
    text.append(rule)
    return "\n".join(text)
