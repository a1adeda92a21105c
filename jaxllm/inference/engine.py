"""The serving engine: continuous batching over the paged KV cache.

    engine = Engine(model, cfg)                       # pool sized from inference.engine
    rid = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=64))
    outputs = engine.step()                           # RequestOutput of each advanced request
    for out in engine.generate(prompts, params): ...  # all requests to the end, streamed

A pipeline of three parts, as vLLM v1 has it: the scheduler (inference/scheduler.py: token
budget, chunked prefill, prefix cache, preemption) picks each step's tokens; the model
runner (inference/runner.py: one compiled step per token bucket, and decode windows of
several steps in one call when every running request is decoding) runs them; the output
processing here turns sampled ids into text, applies stop ids and stop strings, and frees a
finished request's pages at once. `AsyncEngine` (inference/async_engine.py, re-exported
here) drives an engine from a thread for asyncio callers (the HTTP server), streaming each
request's outputs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import time
import uuid
from typing import Iterator

import jax
import numpy as np

from jaxllm.config import Config
from jaxllm.inference.params import DecodeParams, decode_params
from jaxllm.inference.requests import QueueFullError, RequestOutput, SamplingParams
from jaxllm.inference.runner import MAX_BANNED, ModelRunner, StepBatch
from jaxllm.inference.scheduler import Request, Scheduled, Scheduler

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILED = [0]  # backend compiles in this process (any jit), counted by the listener below


def _on_event(event: str, duration: float, **_) -> None:
    if event == _COMPILE_EVENT:
        _COMPILED[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """XLA backend compiles so far in this process."""
    return _COMPILED[0]


@dataclasses.dataclass(eq=False)
class _Live:
    """A request's output state: text so far, the part already sent, its stop strings."""
    request: Request
    decode: object  # the tokenizer's stream decoder
    text: str = ""
    sent: int = 0  # characters of `text` already handed out
    sent_tokens: int = 0
    first_token_time: float | None = None


class Engine:
    """Continuous batching of requests over one model (see the module docstring).

    `overrides` replace fields of the config's inference.engine section (page_size,
    num_pages, max_num_seqs, max_num_batched_tokens, prefix_caching, max_waiting). With
    `warm_up` (the default) every step shape is compiled here, so serving never compiles.
    """

    def __init__(self, model, cfg: Config, *, tokenizer=None, params: DecodeParams | None = None,
                 seed: int = 0, warm_up: bool = True, **overrides):
        from jaxllm.tokenizer import load_tokenizer

        self.config = ecfg = dataclasses.replace(cfg.inference.engine, **overrides)
        m = model.cfg if model is not None else params.cfg
        if m.sliding_window is not None:
            raise ValueError(f"model.sliding_window={m.sliding_window}: the engine's paged "
                             f"cache has no sliding-window attention; use jaxllm.generate")
        self.model_config = m
        self.params = params if params is not None else decode_params(model, cfg)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.data.tokenizer)
        self.eos_ids = tuple(self.tokenizer.eos_ids)
        self.max_model_len = m.max_seq_len
        self.seed = seed
        self.max_pages_per_seq = math.ceil(self.max_model_len / ecfg.page_size)
        self.num_pages = ecfg.num_pages or self._pages_that_fit()
        self.scheduler = Scheduler(
            num_pages=self.num_pages, page_size=ecfg.page_size,
            max_pages_per_seq=self.max_pages_per_seq, max_num_seqs=ecfg.max_num_seqs,
            max_num_batched_tokens=ecfg.max_num_batched_tokens,
            prefix_caching=ecfg.prefix_caching)
        self.runner = ModelRunner(
            self.params, num_pages=self.num_pages, page_size=ecfg.page_size,
            max_num_seqs=ecfg.max_num_seqs, max_num_batched_tokens=ecfg.max_num_batched_tokens,
            max_pages_per_seq=self.max_pages_per_seq, window_steps=ecfg.decode_window)
        t0 = time.perf_counter()
        if warm_up:
            self.runner.warm_up()
        self.warm_up_s = time.perf_counter() - t0
        self._compiles_at_start = compile_count()
        self._live: dict[str, _Live] = {}
        self._inflight = None  # (scheduled, sampled tokens on the device) of the last step
        self._numbers = itertools.count()
        # host seconds scheduling + dispatching, waiting for the device, and processing outputs
        self.totals = dict(prompt_tokens=0, generation_tokens=0, requests_finished=0, steps=0,
                           windows=0, dispatch_s=0.0, wait_s=0.0, collect_s=0.0)

    # ---- requests ----
    def check_request(self, prompt_ids, params: SamplingParams) -> None:
        """Raise ValueError, naming the problem, for a request the engine cannot serve."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams; got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        if len(prompt_ids) == 0:
            raise ValueError("the prompt must hold at least one token")
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"the prompt's {len(prompt_ids)} tokens + max_tokens "
                             f"{params.max_tokens} exceed the model's context of "
                             f"{self.max_model_len} tokens; shorten the prompt or lower "
                             f"max_tokens to {max(self.max_model_len - len(prompt_ids), 0)}")
        pages = math.ceil(total / self.config.page_size)
        if pages > self.num_pages:
            raise ValueError(f"the request needs {pages} KV pages but the pool holds "
                             f"{self.num_pages}; raise inference.engine.num_pages")
        if params.min_tokens and len(self._banned(params)) > MAX_BANNED:
            raise ValueError(f"min_tokens with {len(self._banned(params))} EOS / stop token ids: "
                             f"at most {MAX_BANNED} can be held back")

    def add_request(self, prompt_ids, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError for a bad request and
        QueueFullError when inference.engine.max_waiting requests already wait."""
        params = SamplingParams() if params is None else params
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, params)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting "
                                 f"(inference.engine.max_waiting={self.config.max_waiting})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, prompt_ids, params, next(self._numbers))
        req.seed_words = self._seed(req)
        self._live[request_id] = _Live(req, self.tokenizer.stream_decoder())
        self.scheduler.add(req)
        self.totals["prompt_tokens"] += len(prompt_ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; its last output (finish_reason "abort"), or
        None if it is unknown or already finished."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        self.scheduler.finish(live.request)
        return self._output(live, finished=True, reason="abort", now=time.perf_counter())

    def has_unfinished(self) -> bool:
        return bool(self._live) or self._inflight is not None

    # ---- steps ----
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that got a token.

        Steps overlap with the host: the next step is scheduled and dispatched before this
        one's tokens are read (a decode row takes its input token from the device), so the
        host's scheduling and output work runs while the device computes. A request that
        stops at a step has one more (discarded) row in the step already dispatched."""
        if self._inflight is None:
            self._inflight = self._dispatch()
            if self._inflight is None:
                return []
        nxt = self._dispatch()
        outputs = self._collect(*self._inflight)
        self._inflight = nxt
        return outputs

    def _dispatch(self):
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule_window(self.config.decode_window)
        if scheduled:
            tokens = self.runner.run_window(self._batch(scheduled))
            self.totals["windows"] += 1
        else:
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return None
            tokens = self.runner.run(self._batch(scheduled))
        self.scheduler.dispatched(scheduled)
        self.totals["steps"] += 1
        self.totals["dispatch_s"] += time.perf_counter() - t0
        return scheduled, tokens

    def _collect(self, scheduled: list[Scheduled], tokens) -> list[RequestOutput]:
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)  # waits for the step: [N], or [k, N] for a window
        now, outputs = time.perf_counter(), []
        self.totals["wait_s"] += now - t0
        rows = tokens.T.tolist() if tokens.ndim == 2 else tokens[:, None].tolist()
        for i, s in enumerate(scheduled):
            if not s.sample:
                continue
            req = s.request
            req.pending -= s.window
            live = self._live.get(req.request_id)
            if live is None or live.request is not req:  # aborted meanwhile
                continue
            outputs.append(self._append(live, rows[i][:s.window], now))
        self.scheduler.register(s.request for s in scheduled)
        self.totals["collect_s"] += time.perf_counter() - now
        return outputs

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> Iterator[RequestOutput]:
        """Add every prompt (token ids) and step until all finish, yielding each output as
        it comes (deltas; the last of each request has finished=True)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.finished:
                    pending.discard(out.request_id)
                yield out

    def stats(self) -> dict:
        s = self.scheduler
        return dict(running=len(s.running), waiting=len(s.waiting), pages_used=s.pages_used,
                    pages_total=self.num_pages, preemptions=s.preemptions,
                    prefix_queries=s.prefix_queries, prefix_hits=s.prefix_hits,
                    compiles_since_start=compile_count() - self._compiles_at_start,
                    **self.totals)

    # ---- internals ----
    def _pages_that_fit(self) -> int:
        """inference.engine.memory_fraction of the device's free memory, at most two full
        contexts per sequence slot; on a device without memory figures (the CPU), one full
        context per sequence slot."""
        c = self.model_config
        per_page = (2 * c.n_layers * c.n_kv_heads * self.config.page_size
                    * c.resolved_head_dim * np.dtype(self.params.embed.dtype).itemsize)
        full = self.config.max_num_seqs * self.max_pages_per_seq
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return full
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        pages = int(self.config.memory_fraction * free // per_page)
        if pages < self.max_pages_per_seq:
            raise ValueError(f"only {pages} KV pages fit in free device memory, fewer than one "
                             f"context of {self.max_model_len} tokens; set "
                             f"inference.engine.num_pages or lower model.max_seq_len")
        return min(pages, 2 * full)

    def _banned(self, p: SamplingParams) -> list[int]:
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids)))

    def _seed(self, req: Request) -> tuple[int, int]:
        if req.params.seed is not None:
            s = req.params.seed
        else:  # from the engine's seed and the request's number
            digest = hashlib.blake2b(f"{self.seed}:{req.number}".encode(), digest_size=8)
            s = int.from_bytes(digest.digest(), "little") >> 1
        return s & 0xFFFFFFFF, s >> 32

    def _batch(self, scheduled: list[Scheduled]) -> StepBatch:
        """The step's arrays: built as Python lists and written once per field (a step of
        hundreds of decode rows is host work on every token)."""
        n_seqs = len(scheduled)
        lengths = [s.n for s in scheduled]
        b = self.runner.empty_batch(self.runner.bucket(sum(lengths)))
        tokens, slots, starts, previous = [], [], [], []
        for s in scheduled:
            r = s.request
            starts.append(s.start)
            if s.n == 1:  # a decode row (the common case)
                slots.append(s.slots)
                if s.start < len(r.tokens):
                    tokens.append(r.tokens[s.start])
                    continue
                tokens.append(0)
            else:
                slots.extend(s.slots.tolist())
                known = r.tokens[s.start:s.start + s.n]
                tokens.extend(known)
                if len(known) == s.n:
                    continue
                tokens.append(0)
            previous.append((len(tokens) - 1, r.sample_slot))  # the pending token, sampled
        t = len(tokens)                                     # by the step before
        b.tokens[:t], b.slots[:t] = tokens, slots
        ends = np.cumsum(lengths)
        b.q_starts[1:n_seqs + 1], b.q_starts[n_seqs + 1:] = ends, t
        b.positions[:t] = np.arange(t) + np.repeat(np.asarray(starts) - (ends - lengths),
                                                   lengths)
        b.kv_lens[:n_seqs] = np.asarray(starts) + lengths
        b.sample_at[:n_seqs] = ends - 1
        b.window[:n_seqs] = [s.window for s in scheduled]
        if previous:
            rows, from_slots = zip(*previous)
            b.from_previous[list(rows)] = from_slots
        self._tables(scheduled, b.block_tables)
        for i, s in enumerate(scheduled):
            if s.sample:
                self._sampling_row(b, i, s.request, s.request.params)
        return b

    def _tables(self, scheduled: list[Scheduled], out: np.ndarray) -> None:
        """Block-table rows, kept per request and extended as its pages grow (a running
        request's pages only grow: writes never go to shared pages, nothing is truncated)."""
        a = self.scheduler.allocator
        for i, s in enumerate(scheduled):
            r = s.request
            pages = a.pages_view(r.seq)
            if r.table is None or r.table_seq != r.seq:
                r.table = np.full(self.max_pages_per_seq, self.num_pages, np.int32)
                r.table_seq, r.table_len = r.seq, 0
            if len(pages) > r.table_len:
                r.table[r.table_len:len(pages)] = pages[r.table_len:]
                r.table_len = len(pages)
            out[i] = r.table

    def _sampling_row(self, b: StepBatch, i: int, r: Request, p: SamplingParams) -> None:
        if p.temperature > 0:  # greedy rows keep the batch's zeros
            b.temperature[i], b.top_k[i], b.top_p[i] = p.temperature, p.top_k, p.top_p
            b.seed[i] = r.seed_words
        b.draw[i] = len(r.output) + r.pending
        if len(r.output) + r.pending < p.min_tokens:
            banned = self._banned(p)
            b.banned[i, :len(banned)] = banned
            b.ban_steps[i] = p.min_tokens - len(r.output) - r.pending

    def _append(self, live: _Live, tokens: list[int], now: float) -> RequestOutput:
        """Sampled tokens, in order, each through the stop ids, the length limit, then its
        text and stop strings; those after the one that finishes the request are dropped."""
        req, p = live.request, live.request.params
        if live.first_token_time is None:
            live.first_token_time = now
        stop_ids = p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *self.eos_ids)
        for token in tokens:
            self.totals["generation_tokens"] += 1
            if token in stop_ids:
                return self._finish(live, "stop", now)  # the stop id is not in the output
            req.output.append(token)
            req.tokens.append(token)
            before = len(live.text)
            live.text += live.decode([token])
            if p.stop:  # a stop string that ends in the new text starts at most this far back
                start = max(0, before - max(map(len, p.stop)) + 1)
                cut = min((i for i in (live.text.find(s, start) for s in p.stop) if i >= 0),
                          default=-1)
                if cut >= 0:
                    live.text = live.text[:cut]
                    return self._finish(live, "stop", now)
            if len(req.output) >= p.max_tokens or len(req.tokens) >= self.max_model_len:
                return self._finish(live, "length", now)
        return self._output(live, finished=False, reason=None, now=now)

    def _finish(self, live: _Live, reason: str, now: float) -> RequestOutput:
        self._live.pop(live.request.request_id, None)
        self.scheduler.finish(live.request)
        self.totals["requests_finished"] += 1
        return self._output(live, finished=True, reason=reason, now=now)

    def _output(self, live: _Live, *, finished: bool, reason: str | None,
                now: float) -> RequestOutput:
        req = live.request
        hold = 0 if finished or not req.params.stop else max(map(len, req.params.stop)) - 1
        upto = max(live.sent, len(live.text) - hold)
        new_text, live.sent = live.text[live.sent:upto], upto
        new_ids, live.sent_tokens = req.output[live.sent_tokens:], len(req.output)
        return RequestOutput(
            request_id=req.request_id, prompt_tokens=len(req.prompt), new_token_ids=new_ids,
            new_text=new_text, token_ids=list(req.output), text=live.text[:upto],
            finished=finished, finish_reason=reason, cached_tokens=req.cached_tokens,
            arrival_time=req.arrival_time, first_token_time=live.first_token_time,
            finish_time=now if finished else None)


# asyncio callers (the HTTP server): an engine driven from a thread
from jaxllm.inference.async_engine import AsyncEngine, RequestStream  # noqa: E402,F401

__all__ = ["Engine", "AsyncEngine", "RequestStream", "SamplingParams", "RequestOutput",
           "QueueFullError", "compile_count"]
