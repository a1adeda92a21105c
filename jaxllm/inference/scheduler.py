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

When a running request needs a page and none is free, the newest running request is
preempted: its pages are freed and it goes back to the front of the queue with its
generated tokens kept, to be recomputed (prompt + output) when there is room. Nothing is
lost, and a request that fits the pool alone always completes.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque

import numpy as np

from jaxllm.inference.cache import OutOfPagesError, PageAllocator
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
    computed: int = 0  # tokens whose K/V are in its pages
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache (first admission)
    admitted: bool = False
    preemptions: int = 0
    # tokens sampled for it by dispatched steps but not yet on the host (the next step feeds
    # the last of them from the device at position len(tokens) + pending - 1)
    pending: int = 0
    sample_slot: int = -1  # its sequence slot in the step that samples the pending token
    seed_words: tuple[int, int] = (0, 0)  # its sampling seed as two uint32 words
    table: np.ndarray | None = None  # its block-table row (the engine's), for `table_seq`
    table_seq: int | None = None
    table_len: int = 0

    def __post_init__(self):
        self.tokens = list(self.prompt) + list(self.output)

    @property
    def known(self) -> int:
        """Tokens it has, the pending one included."""
        return len(self.tokens) + self.pending

    @property
    def to_compute(self) -> int:
        return self.known - self.computed

    @property
    def wants_more(self) -> bool:
        """Whether another token could be needed: the pending one (if any) is not its last
        by the length limit."""
        return len(self.output) + self.pending < self.params.max_tokens


@dataclasses.dataclass
class Scheduled:
    """A request's share of a step: `n` tokens from position `start`, at pool `slots` (an int
    for one token);
    `sample`: the step reaches the end of its known tokens, so it draws the next one;
    `window`: in a decode window, the tokens it runs and draws (n == 1: the first of them)."""
    request: Request
    start: int
    n: int
    slots: np.ndarray
    sample: bool
    window: int = 1


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
    def schedule(self) -> list[Scheduled]:
        budget, out = self.budget, []
        preemptions = self.preemptions
        order = sorted(self.running, key=lambda r: (r.to_compute > 1, r.number))
        for req in order:
            if budget == 0:
                break
            if req.seq is None or (req.pending and not req.wants_more):
                continue  # preempted in this pass, or its pending token is its last
            n = min(req.to_compute, budget)
            slots = self._reserve_or_preempt(req, n)
            if self.preemptions != preemptions:  # drop what the preempted had been given
                kept = [s for s in out if s.request.seq is not None]
                budget += sum(s.n for s in out) - sum(s.n for s in kept)
                out = kept
            if slots is None:  # req itself was preempted: the pool is as full as it gets
                break
            out.append(self._scheduled(req, n, slots))
            budget -= n
        preempted = self.preemptions != preemptions
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            if req.pending:  # preempted with a token on its way: admit it once it is here
                break
            if self.prefix_caching:
                seq, cached = self.allocator.allocate_prefix(req.tokens)
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
            out.append(self._scheduled(req, n, slots))
            budget -= n
        return out

    def schedule_window(self, k: int) -> list[Scheduled] | None:
        """A decode window of up to k steps, or None when this step cannot be one: some
        running request has more than one token to compute, a waiting request could be
        admitted, or the free pages do not hold every
        request's window (then `schedule` runs a step, preempting as it must)."""
        if k < 2 or not self.running or (self.waiting
                                         and len(self.running) < self.max_num_seqs):
            return None
        rows, pages = [], 0
        a = self.allocator
        for req in sorted(self.running, key=lambda r: r.number):
            if req.pending and not req.wants_more:
                continue  # its pending token is its last
            p = req.params
            done = len(req.output) + req.pending
            if req.to_compute != 1 or req.seq is None:
                return None
            w = min(k, p.max_tokens - done)
            have = a.length(req.seq)
            pages += -(-(have + w) // a.page_size) - -(-have // a.page_size)
            rows.append((req, w))
        if not rows or pages > a.num_free:
            return None
        out = []
        for req, w in rows:
            (slots,), copies = a.append([req.seq], [w])
            assert not copies, "the engine never writes a shared page"
            out.append(Scheduled(req, req.computed, 1, int(slots[0]), True, w))
        return out

    def dispatched(self, scheduled: list[Scheduled]) -> None:
        """The step is on its way: its tokens count as computed (the device runs steps in
        order), and each sampling request has its tokens pending."""
        for i, s in enumerate(scheduled):
            s.request.computed = s.start + s.n + s.window - 1
            if s.sample:
                s.request.pending += s.window
                s.request.sample_slot = i

    def register(self, requests) -> None:
        """Key the pages the requests' known tokens have filled (prefix caching)."""
        if self.prefix_caching:
            for r in requests:
                if r.seq is not None:
                    self.allocator.register(r.seq, r.tokens)

    # ---- internals ----
    def _scheduled(self, req: Request, n: int, slots) -> Scheduled:
        if n == 1 and not isinstance(slots, int):
            slots = int(slots[0])
        return Scheduled(req, req.computed, n, slots,
                         req.computed + n == req.known and req.wants_more)

    def _reserve_or_preempt(self, req: Request, n: int):
        while True:
            try:
                if n == 1:
                    return self.allocator.append_one(req.seq)
                (slots,), copies = self.allocator.append([req.seq], [n])
                assert not copies, "the engine never writes a shared page"
                return slots
            except OutOfPagesError:
                victim = max(self.running, key=lambda r: r.number)
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
