"""The serving engine's scheduler: which tokens of which requests run in the next step.

Host-side and pure Python, as vLLM v1 schedules: each step has a token budget
(`max_num_batched_tokens`). Running requests come first, those decoding (one token to
run) before those still prefilling, oldest first; a prefill takes what is left of the
budget, so long prompts are chunked and share steps with decode rows. Then waiting
requests are admitted, first come first served, while the budget, the sequence limit
(`max_num_seqs`) and the free pages allow; with prefix caching a new request starts after
the cached pages of its prompt.

When every running request is decoding and no waiting one could be admitted, a step can be
a decode window (`schedule_window`): each request runs up to k tokens on the device, each
the sample of the one before, with pages reserved for all of them, so the host schedules
once for k tokens.

A step's decode rows cost one pass over the running requests and one array operation of the
allocator, which reserves all their pages at once (`PageAllocator.extend`); only when the
free pages do not hold them all does the step go row by row, preempting as it must. The
step comes out as arrays (`ScheduledStep`), the form the engine builds the device batch
from.

When a running request needs a page and none is free, the newest running request is
preempted: its pages are freed and it goes back to the front of the queue with its
generated tokens kept, to be recomputed (prompt + output) when there is room. Nothing is
lost, and a request that fits the pool alone always completes.
"""
from __future__ import annotations

import dataclasses
import operator
import time
from collections import deque

import numpy as np

from jaxllm.inference.pages import OutOfPagesError, PageAllocator
from jaxllm.inference.prefix_cache import PrefixCachingAllocator
from jaxllm.inference.requests import SamplingParams


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    number: int  # arrival order
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    output: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + output
    seq: int | None = None  # the allocator's sequence while it holds pages
    computed: int = 0  # tokens whose K/V are in its pages (its sequence's length)
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache (first admission)
    admitted: bool = False
    preemptions: int = 0
    # tokens sampled for it by dispatched steps but not yet on the host (the next step feeds
    # the last of them from the device at position len(tokens) + pending - 1)
    pending: int = 0
    sample_slot: int = -1  # its sequence slot in the step that samples the pending token
    seed_words: tuple[int, int] = (0, 0)  # its sampling seed as two uint32 words
    prompt_array: np.ndarray | None = None  # the prompt as int64 ids, where the caller has it

    def __post_init__(self):
        self.tokens = list(self.prompt) + list(self.output)

    @property
    def known(self) -> int:
        """Tokens it has, the pending one included."""
        return len(self.tokens) + self.pending

    @property
    def prefix_tokens(self):
        """Its tokens for a prefix-cache lookup: the prompt's int64 array while it has no
        output (hashed as it is, without converting the list), else the token list."""
        return self.tokens if self.output or self.prompt_array is None else self.prompt_array

    @property
    def to_compute(self) -> int:
        return self.known - self.computed

    @property
    def wants_more(self) -> bool:
        """Whether another token could be needed: the pending one (if any) is not its last
        by the length limit."""
        return len(self.output) + self.pending < self.params.max_tokens


@dataclasses.dataclass(eq=False)
class ScheduledStep:
    """One step's work, a row a request, decode rows first: requests[i] runs counts[i]
    tokens from position starts[i] of its sequence seqs[i]; their flat pool slots follow
    one another in `slots` (a decode window: each row's first slot, the rest follow in its
    block table). previous[i] >= 0: the row's last token is the request's pending one, to
    be taken from that sequence slot of the previous step's samples (all others are in
    its `tokens`). sample[i]: the step reaches the end of the request's known tokens, so
    it draws the next one. windows[i]: in a decode window, the tokens the row runs and
    draws (its count is 1); 1 in an ordinary step."""
    requests: list[Request]
    seqs: np.ndarray  # int64 [n]
    starts: np.ndarray  # int64 [n]
    counts: np.ndarray  # int64 [n]
    slots: np.ndarray  # int32 [sum(counts)]
    previous: np.ndarray  # int64 [n]
    sample: np.ndarray  # bool [n]
    windows: np.ndarray  # int64 [n]
    is_window: bool = False

    def __len__(self) -> int:
        return len(self.requests)


@dataclasses.dataclass
class _DecodeRows:
    """The running requests with one token to run, oldest first, as parallel lists (their
    pool slots once reserved)."""
    requests: list[Request] = dataclasses.field(default_factory=list)
    seqs: list[int] = dataclasses.field(default_factory=list)
    starts: list[int] = dataclasses.field(default_factory=list)
    previous: list[int] = dataclasses.field(default_factory=list)
    slots: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))

    def take(self, keep) -> "_DecodeRows":
        """The rows where `keep` (a slice, or booleans a row) holds."""
        if isinstance(keep, slice):
            pick = lambda xs: xs[keep]  # noqa: E731
        else:
            pick = lambda xs: [x for x, k in zip(xs, keep) if k]  # noqa: E731
        slots = self.slots[keep] if len(self.slots) else self.slots
        return _DecodeRows(pick(self.requests), pick(self.seqs), pick(self.starts),
                           pick(self.previous), slots)


_NUMBER = operator.attrgetter("number")


class Scheduler:
    def __init__(self, *, num_pages: int, page_size: int, max_pages_per_seq: int,
                 max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool):
        cls = PrefixCachingAllocator if prefix_caching else PageAllocator
        self.allocator = cls(num_pages, page_size, max_pages_per_seq)
        self.prefix_caching = prefix_caching
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ---- requests in and out ----
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Drop a request wherever it is and free its pages at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    @property
    def pages_used(self) -> int:
        a = self.allocator
        return a.num_pages - a.num_free

    # ---- one step ----
    def schedule(self) -> ScheduledStep | None:
        """The next step (None: nothing to run): running requests first, those decoding
        before those prefilling, oldest first, within the token budget; then waiting ones."""
        decode, rest = self._split_running()
        budget = self.budget
        decode = decode.take(slice(budget))
        if decode.requests:
            try:
                decode.slots = self.allocator.extend(decode.seqs, 1)
            except OutOfPagesError:  # not all of them fit: row by row, preempting
                decode, rest = _DecodeRows(), decode.requests + rest
        rows = []  # (request, start, count, slots) of the rows after the decode block
        budget -= len(decode.requests)
        preemptions = self.preemptions
        for req in rest:
            if budget == 0:
                break
            if req.seq is None:
                continue  # preempted in this pass
            n, start = min(req.to_compute, budget), req.computed
            slots = self._reserve_or_preempt(req, n)
            if self.preemptions != preemptions:  # drop what the preempted had been given
                keep = [r.seq is not None for r in decode.requests]
                if not all(keep):
                    decode = decode.take(np.asarray(keep))
                rows = [row for row in rows if row[0].seq is not None]
                budget = self.budget - len(decode.requests) - sum(row[2] for row in rows)
            if slots is None:  # req itself was preempted: the pool is as full as it gets
                break
            rows.append((req, start, n, slots))
            budget -= n
        if self.preemptions == preemptions:
            budget = self._admit(rows, budget)
        if not decode.requests and not rows:
            return None
        return self._step(decode, rows)

    def schedule_window(self, k: int) -> ScheduledStep | None:
        """A decode window of up to k steps, or None when this step cannot be one: some
        running request has more than one token to compute, a waiting request could be
        admitted, or the free pages do not hold every request's window (then `schedule`
        runs a step, preempting as it must)."""
        if k < 2 or not self.running or (self.waiting
                                         and len(self.running) < self.max_num_seqs):
            return None
        decode, rest = self._split_running()
        if rest or not decode.requests:
            return None
        windows = np.fromiter((min(k, r.params.max_tokens - len(r.output) - r.pending)
                               for r in decode.requests), np.int64, len(decode.requests))
        try:
            decode.slots = self.allocator.extend(decode.seqs, windows)
        except OutOfPagesError:
            return None
        step = self._step(decode, [])
        step.windows, step.is_window = windows, True
        return step

    def dispatched(self, step: ScheduledStep) -> None:
        """The step is on its way: its tokens count as computed (the device runs steps in
        order), and each sampling request has its tokens pending."""
        computed = (step.starts + step.counts + step.windows - 1).tolist()
        for i, (r, c, s, w) in enumerate(zip(step.requests, computed, step.sample.tolist(),
                                             step.windows.tolist())):
            r.computed = c
            if s:
                r.pending += w
                r.sample_slot = i

    def register(self, step: ScheduledStep) -> None:
        """Key the pages the step's requests' known tokens have filled (prefix caching)."""
        if not self.prefix_caching:
            return
        live = [r for r in step.requests if r.seq is not None]
        a = self.allocator
        for i in a.unkeyed([r.seq for r in live], [len(r.tokens) for r in live]).tolist():
            a.register(live[i].seq, live[i].tokens)

    # ---- internals ----
    def _split_running(self) -> tuple[_DecodeRows, list[Request]]:
        """The running requests that have a token to run, oldest first: (those decoding,
        the others). One whose pending token is its last has none."""
        decode, rest = _DecodeRows(), []
        requests, seqs, starts, previous = (decode.requests, decode.seqs, decode.starts,
                                            decode.previous)
        for r in sorted(self.running, key=_NUMBER):
            pending = r.pending
            if pending and len(r.output) + pending >= r.params.max_tokens:
                continue
            if len(r.tokens) + pending - r.computed == 1:
                requests.append(r)
                seqs.append(r.seq)
                starts.append(r.computed)
                previous.append(r.sample_slot if pending else -1)  # its one token is pending
            else:
                rest.append(r)
        return decode, rest

    def _admit(self, rows: list, budget: int) -> int:
        """Admit waiting requests, first come first served, while the budget, the sequence
        limit and the free pages allow; their rows go to `rows`. Returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.pending:  # preempted with a token on its way: admit it once it is here
                break
            if self.prefix_caching:
                seq, cached = self.allocator.allocate_prefix(req.prefix_tokens)
            else:
                seq, cached = self.allocator.allocate(), 0
            n = min(len(req.tokens) - cached, budget)
            try:
                (slots,), _ = self.allocator.append([seq], [n])
            except OutOfPagesError:
                self.allocator.free(seq)
                break
            self.waiting.popleft()
            if not req.admitted:  # counted once, not again after a preemption
                self.prefix_queries += len(req.prompt)
                self.prefix_hits += cached
                req.cached_tokens, req.admitted = cached, True
            req.seq, req.computed = seq, cached
            self.running.append(req)
            rows.append((req, cached, n, slots))
            budget -= n
        return budget

    def _step(self, decode: _DecodeRows, rows: list) -> ScheduledStep:
        """The decode rows, then the others' (request, start, count, slots)."""
        requests = decode.requests + [row[0] for row in rows]
        n, d = len(requests), len(decode.requests)
        counts = np.ones(n, np.int64)
        counts[d:] = [row[2] for row in rows]
        slots = (np.concatenate([decode.slots] + [row[3] for row in rows]) if rows
                 else decode.slots)
        previous = decode.previous + [r.sample_slot if start + cnt > len(r.tokens) else -1
                                      for r, start, cnt, _ in rows]
        sample = np.ones(n, bool)  # a decode row reaches its known tokens' end
        sample[d:] = [start + cnt == r.known and r.wants_more for r, start, cnt, _ in rows]
        return ScheduledStep(requests, np.asarray(decode.seqs + [r.seq for r, *_ in rows]),
                             np.asarray(decode.starts + [row[1] for row in rows], np.int64),
                             counts, slots.astype(np.int32, copy=False),
                             np.asarray(previous, np.int64), sample, np.ones(n, np.int64))

    def _reserve_or_preempt(self, req: Request, n: int):
        while True:
            try:
                (slots,), copies = self.allocator.append([req.seq], [n])
                assert not copies, "the engine never writes a shared page"
                return slots
            except OutOfPagesError:
                victim = max(self.running, key=_NUMBER)
                self._preempt(victim)
                if victim is req:
                    return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.computed, req.preemptions = 0, req.preemptions + 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.seq is not None:
            self.allocator.free(req.seq)
            req.seq = None
