"""Interleaved timing rounds, shared by the kernel benchmarks.

Every implementation of a shape is timed once a round, the order reversed every other
round, so slow and fast spells of the device fall on all of them alike; a figure is then
the median over rounds, and a ratio between two implementations the median of their
per-round ratios (steadier than a ratio of two separate timings).
"""
from __future__ import annotations

import statistics


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
