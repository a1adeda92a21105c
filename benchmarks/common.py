"""What every benchmark shares: timing (one implementation, or several in interleaved
rounds), a table on stdout, and a JSON file with the run's metadata.

Interleaved rounds: every implementation of a shape is timed once a round, the order
reversed every other round, so slow and fast spells of the device fall on all of them
alike; a figure is the median over rounds, and a ratio between two implementations the
median of their per-round ratios (steadier than a ratio of two separate timings).

    from benchmarks.common import (add_args, interleaved, meta, print_table, speedup, time_fn,
                                   write_json)

Memory-bound work (decoding) is also read against the device's datasheet HBM bandwidth:
`hbm_bandwidth()`, and `roofline_pct(bytes, seconds)` for the share of it a step reaches.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax


def time_fn(fn, *args, target_s: float = 0.03, batches: int = 5) -> float:
    """Median seconds per call of fn(*args); each batch runs calls back to back, then
    synchronises. The first call (compilation, warm-up) is not timed."""
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    n = int(min(200, max(3, target_s / max(time.perf_counter() - t, 1e-6))))
    times = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def interleaved(timers: dict, rounds: int, on_error=None) -> dict:
    """timers: key -> a function returning seconds. -> key -> [seconds, one per round].

    A timer that raises is dropped from the rounds and reported as on_error(key, e)
    (raised again when no on_error is given)."""
    samples = {k: [] for k in timers}
    order = list(timers)
    for r in range(rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            if k not in samples:
                continue
            try:
                samples[k].append(timers[k]())
            except Exception as e:  # noqa: BLE001  one failing timer must not sink the rest
                if on_error is None:
                    raise
                on_error(k, e)
                del samples[k]
    return samples


def speedup(ref_times, times) -> float:
    """Median over rounds of ref time / time: the throughput of `times` relative to `ref`."""
    return statistics.median(r / t for r, t in zip(ref_times, times))


# Datasheet HBM bandwidth in bytes/s, by a name found in jax's device_kind.
HBM_DATASHEET = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def hbm_bandwidth() -> float | None:
    """The datasheet HBM bandwidth of device 0 in bytes/s; None when unknown (e.g. the CPU)."""
    kind = jax.devices()[0].device_kind
    return next((bw for name, bw in HBM_DATASHEET.items() if name in kind), None)


def roofline_pct(nbytes: float, seconds: float) -> float | None:
    """100 x (time to move `nbytes` at the datasheet bandwidth) / seconds; None when the
    bandwidth is unknown."""
    bw = hbm_bandwidth()
    return 100 * nbytes / bw / seconds if bw else None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def print_table(rows: list[dict], columns: list[str] | None = None, title: str | None = None,
                markdown: bool = False):
    """rows as a plain-text table, or a Markdown one (unpadded, to paste into the docs);
    `columns` picks and orders the keys (default: all, in first-seen order). Missing values
    print as '-'."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    if title:
        print(f"\n{title}")
    if markdown:
        for line in [columns, ["---"] * len(columns)] + cells:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def meta() -> dict:
    """Date, device, jax version, commit (with '+dirty' for a changed tree) and command."""
    root = Path(__file__).resolve().parent.parent

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "devices": jax.device_count(), "jax": jax.__version__, "commit": commit,
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}


def add_args(parser: argparse.ArgumentParser, rounds: int | None = 5) -> argparse.ArgumentParser:
    """The options every benchmark takes: --rounds (unless rounds is None: a benchmark that
    times one run of each case) and --json."""
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds,
                            help="interleaved timing rounds (median reported)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and metadata here")
    return parser


def fill_defaults(args: argparse.Namespace, full: dict, quick: dict,
                  quick_overrides: list[str] | None = None) -> argparse.Namespace:
    """Options left unset (None) take their preset: `quick`'s under --quick, else `full`'s.
    Under --quick, `quick_overrides` go before the config overrides given (args.overrides)."""
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.quick and quick_overrides:
        args.overrides = list(quick_overrides) + args.overrides
    return args


def write_json(path: str | None, rows: list[dict], **extra) -> None:
    """{"meta": meta(), "rows": rows, **extra} to `path` (nothing when path is None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"meta": meta(), "rows": rows, **extra}, indent=1,
                                         default=str))
        print(f"wrote {path}")
