"""Pipeline schedules as data: which microbatch and stage each device works on, tick by tick.

A schedule is a table `ops[tick, device] = (op, microbatch, stage)` with op one of IDLE,
FWD, BWD, built here in plain Python for p devices, m microbatches and v stages per
device. Stage s (0 .. p*v - 1) lives on device s % p; a tick is the time of one stage's
forward or one stage's backward (taken as equal), so the idle share of the table is the
pipeline bubble:

    gpipe     all forwards, then all backwards (mirrored)        (p - 1) / (m + p - 1)
    circular  gpipe over p*v stages, v per device, microbatches  (p - 1) / (v*m + p - 1)
              entering in groups of p (m a multiple of p)
    1f1b      after p - 1 - d warm-up forwards device d          (p - 1) / (m + p - 1)
              alternates one backward, one forward; at most p - d
              microbatches are between their forward and backward

`pipeline.py` executes these tables: gpipe and circular run the forward ticks and let
autodiff mirror them; 1f1b runs every tick of the table by hand.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IDLE, FWD, BWD = 0, 1, 2
SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclass(frozen=True)
class Schedule:
    kind: str
    p: int  # devices (pipeline stages per repeat)
    m: int  # microbatches
    v: int  # stages per device
    ops: np.ndarray  # int32 [ticks, p, 3]: (op, microbatch, stage); -1 where idle

    @property
    def ticks(self) -> int:
        return self.ops.shape[0]

    @property
    def bubble(self) -> float:
        """The idle share of all device-ticks, counted from the table."""
        return float(np.mean(self.ops[..., 0] == IDLE))

    def forward_ticks(self) -> np.ndarray:
        """[ticks', p, 2] (microbatch, stage) of the forward half of a mirrored schedule."""
        if self.kind == "1f1b":
            raise ValueError("1f1b interleaves forwards and backwards; it has no forward half")
        half = self.ops[: self.ticks // 2]
        assert not (half[..., 0] == BWD).any()
        return half[..., 1:]

    def render(self, width: int = 48) -> str:
        """One line per device: F3 / B3 (forward / backward of microbatch 3), '.' idle."""
        cells = {IDLE: lambda mb, s: ".", FWD: lambda mb, s: f"F{mb}", BWD: lambda mb, s: f"B{mb}"}
        lines = []
        for d in range(self.p):
            row = [cells[int(op)](mb, s) for op, mb, s in self.ops[:width, d]]
            lines.append(f"  device {d}: " + " ".join(f"{c:>3}" for c in row)
                         + (" ..." if self.ticks > width else ""))
        return "\n".join(lines)

    def describe(self) -> str:
        formula = expected_bubble(self.kind, self.p, self.m, self.v)
        return (f"pipeline {self.kind}: pp={self.p} x {self.v} stage(s) per device, "
                f"{self.m} microbatches, {self.ticks} ticks; bubble {self.bubble:.3f} "
                f"(formula {formula:.3f})\n" + self.render())


def expected_bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction of a schedule."""
    return (p - 1) / ((v if kind == "circular" else 1) * m + p - 1)


def build(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule table of `kind` for p devices, m microbatches, v stages per device."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}; one of {SCHEDULES}")
    if kind != "circular" and v != 1:
        raise ValueError(f"{kind} runs one stage per device; v={v} needs 'circular'")
    if kind == "circular" and m % p:
        raise ValueError(f"circular feeds microbatches in groups of p={p}; m={m} is not a "
                         f"multiple of it")
    if kind == "1f1b" and m < p:
        raise ValueError(f"1f1b needs at least m=p microbatches to fill p={p} stages; got m={m}")
    ops = _one_f_one_b(p, m) if kind == "1f1b" else _mirrored(p, m, v)
    return Schedule(kind, p, m, v, ops)


def _mirrored(p: int, m: int, v: int) -> np.ndarray:
    """GPipe (v = 1) and circular: microbatch i enters in group i // p, slot i % p, and
    moves one stage a tick, so its stage s runs at tick (i // p) p v + i % p + s; with
    v = 1 that is i + s. The backward half is the forward half reversed in time."""
    n_fwd = v * m + p - 1
    ops = np.full((2 * n_fwd, p, 3), -1, np.int32)
    ops[..., 0] = IDLE
    for i in range(m):
        for s in range(p * v):
            t = (i // p) * p * v + i % p + s if v > 1 else i + s
            assert ops[t, s % p, 0] == IDLE, (t, i, s)
            ops[t, s % p] = (FWD, i, s)
            ops[2 * n_fwd - 1 - t, s % p] = (BWD, i, s)
    return ops


def _one_f_one_b(p: int, m: int) -> np.ndarray:
    """1F1B by simulation: each tick a device runs the backward of its oldest microbatch
    whose output cotangent has arrived, else the forward of the next microbatch whose input
    has arrived while fewer than p - d are in flight, else idles. Results of tick t arrive
    at the neighbour for tick t + 1; the last stage's cotangent comes from its own loss."""
    fwd_done = np.full((p, m), -1)  # tick of F(i, d)
    bwd_done = np.full((p, m), -1)
    next_f, next_b = [0] * p, [0] * p
    rows = []
    t = 0
    while min(next_b) < m:
        row = []
        for d in range(p):
            i, j = next_f[d], next_b[d]
            b_ready = j < m and j < i and (0 <= (bwd_done[d + 1, j] if d < p - 1
                                                 else fwd_done[d, j]) < t)
            f_ready = i < m and (d == 0 or 0 <= fwd_done[d - 1, i] < t) and i - j < p - d
            if b_ready:
                bwd_done[d, j], next_b[d] = t, j + 1
                row.append((BWD, j, d))
            elif f_ready:
                fwd_done[d, i], next_f[d] = t, i + 1
                row.append((FWD, i, d))
            else:
                row.append((IDLE, -1, -1))
        rows.append(row)
        t += 1
    return np.asarray(rows, np.int32)


def slots(schedule: Schedule) -> tuple[int, int]:
    """1F1B's buffer slots (microbatch i in slot i % K) for stage inputs and for incoming
    cotangents: the fewest K for which no live microbatch is overwritten."""
    ops, p, m = schedule.ops, schedule.p, schedule.m
    f = {(int(mb), d): t for t, row in enumerate(ops) for d, (op, mb, _) in enumerate(row)
         if op == FWD}
    b = {(int(mb), d): t for t, row in enumerate(ops) for d, (op, mb, _) in enumerate(row)
         if op == BWD}
    # (written at the end of tick, last read at tick) per microbatch and device
    acts = [(i, d, f[i, d - 1], b[i, d]) for i in range(m) for d in range(1, p)]
    cots = [(i, d, b[i, d + 1], b[i, d]) for i in range(m) for d in range(p - 1)]
    return _fewest_slots(acts), _fewest_slots(cots)


def _fewest_slots(intervals) -> int:
    """The fewest K such that two microbatches in slot i % K of one device are never live
    together; (i, device, w, r): written at the end of tick w, last read at tick r."""
    by_dev: dict = {}
    for i, d, w, r in intervals:
        by_dev.setdefault(d, []).append((i, w, r))
    k = 1
    while True:
        ok = all(not (w1 < r2 and w2 < r1)
                 for rows in by_dev.values() for a, (i1, w1, r1) in enumerate(rows)
                 for i2, w2, r2 in rows[a + 1:] if (i1 - i2) % k == 0)
        if ok:
            return k
        k += 1
