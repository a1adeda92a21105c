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
finished request's pages at once. A step's host work is array operations over its rows
(the scheduler's decode rows, the allocator's page reservations and block tables, the step's
arrays in one buffer), then one visit per request that got tokens, for its output.
`AsyncEngine` (inference/async_engine.py, re-exported here) drives an engine from a thread
for asyncio callers (the HTTP server), streaming each request's outputs.
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
from jaxllm.inference.runner import MAX_BANNED, ModelRunner, StepBatch, pool_shapes
from jaxllm.inference.scheduler import Request, ScheduledStep, Scheduler

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILED = [0]  # backend compiles in this process (any jit), counted by the listener below


def _on_event(event: str, duration: float, **_) -> None:
    if event == _COMPILE_EVENT:
        _COMPILED[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """XLA backend compiles so far in this process."""
    return _COMPILED[0]


def _token_ids(prompt_ids) -> np.ndarray:
    """Token ids (a list or array of integers) as int64 [n]; ValueError for anything else."""
    ids = np.asarray(prompt_ids)
    if ids.ndim == 1 and (ids.dtype.kind in "iu" or ids.size == 0):
        return ids.astype(np.int64, copy=False)
    if ids.ndim == 1 and ids.dtype == object:  # Python ints past int64, or mixed objects
        try:
            return np.asarray([int(t) for t in prompt_ids], np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"prompt token ids must be integers: {e}") from None
    raise ValueError(f"prompt token ids must be a flat sequence of integers; got "
                     f"{ids.dtype} of shape {ids.shape}")


@dataclasses.dataclass(eq=False)
class _Live:
    """A request's output state: text so far, the part already sent; its stop ids, the
    characters held back while they could start a stop string, and the most tokens it may
    generate (max_tokens, or fewer by the model's context)."""
    request: Request
    decode: object  # the tokenizer's stream decoder
    stop_ids: frozenset[int]
    hold: int
    limit: int
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
        params = params if params is not None else decode_params(model, cfg)
        # the engine's steps never read MTP modules (its decoding is plain): none on the device
        self.params = params.replace(mtp=()) if params.mtp else params
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
        self._sampling = 0  # live requests that sample or hold stop ids back (min_tokens)
        self._inflight = None  # (scheduled, sampled tokens on the device) of the last step
        self._idle = True  # the device ran dry and has produced no token since
        self._numbers = itertools.count()
        # host seconds scheduling + dispatching (call_s: in the compiled call), waiting for
        # the device, and processing outputs
        self.totals = dict(prompt_tokens=0, generation_tokens=0, requests_finished=0, steps=0,
                           windows=0, dispatch_s=0.0, call_s=0.0, wait_s=0.0, collect_s=0.0)

    # ---- requests ----
    def check_request(self, prompt_ids, params: SamplingParams) -> None:
        """Raise ValueError, naming the problem, for a request the engine cannot serve."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams; got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        ids = _token_ids(prompt_ids)
        if len(ids) == 0:
            raise ValueError("the prompt must hold at least one token")
        bad = ids[(ids < 0) | (ids >= vocab)]
        if len(bad):
            raise ValueError(f"prompt token ids {bad[:5].tolist()} lie outside the vocabulary "
                             f"[0, {vocab})")
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
        ids = _token_ids(prompt_ids)
        self.check_request(ids, params)
        prompt_ids = ids.tolist()
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting "
                                 f"(inference.engine.max_waiting={self.config.max_waiting})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, prompt_ids, params, next(self._numbers),
                      prompt_array=ids.copy())  # the caller may reuse its array
        req.seed_words = self._seed(req)
        stop_ids = frozenset(params.stop_token_ids + (() if params.ignore_eos else self.eos_ids))
        hold = max(map(len, params.stop)) - 1 if params.stop else 0
        limit = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        self._live[request_id] = _Live(req, self.tokenizer.stream_decoder(), stop_ids, hold,
                                       limit)
        if params.temperature > 0 or params.min_tokens:
            self._sampling += 1
        self.scheduler.add(req)
        self.totals["prompt_tokens"] += len(prompt_ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; its last output (finish_reason "abort"), or
        None if it is unknown or already finished."""
        live = self._live.get(request_id)
        if live is None:
            return None
        self._drop(live)
        return self._output(live, True, "abort", time.perf_counter())

    def has_unfinished(self) -> bool:
        return bool(self._live) or self._inflight is not None

    # ---- steps ----
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that got a token.

        Steps overlap with the host: the next step is scheduled and dispatched before this
        one's tokens are read (a decode row takes its input token from the device), so the
        host's scheduling and output work runs while the device computes. A request that
        stops at a step has one more (discarded) row in the step already dispatched.
        After the device ran dry, the first step that samples tokens is read before the
        next one is dispatched: an idle engine's first tokens (its TTFT) wait for one
        dispatch, not two."""
        if self._inflight is None:
            self._inflight = self._dispatch()
            if self._inflight is None:
                self._idle = True
                return []
        if self._idle and self._inflight[0].sample.any():
            self._idle = False
            inflight, self._inflight = self._inflight, None
            return self._collect(*inflight)
        nxt = self._dispatch()
        outputs = self._collect(*self._inflight)
        self._inflight = nxt
        if nxt is None:
            self._idle = True
        return outputs

    def _dispatch(self):
        t0 = time.perf_counter()
        step = self.scheduler.schedule_window(self.config.decode_window)
        if step is None:
            step = self.scheduler.schedule()
            if step is None:
                return None
        batch = self._batch(step)
        t1 = time.perf_counter()
        tokens = (self.runner.run_window if step.is_window else self.runner.run)(batch)
        self.totals["call_s"] += time.perf_counter() - t1
        self.totals["windows"] += step.is_window
        self.scheduler.dispatched(step)
        self.totals["steps"] += 1
        self.totals["dispatch_s"] += time.perf_counter() - t0
        return step, tokens

    def _collect(self, step: ScheduledStep, tokens) -> list[RequestOutput]:
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)  # waits for the step: [N], or [k, N] for a window
        now, outputs = time.perf_counter(), []
        self.totals["wait_s"] += now - t0
        rows = (tokens.T if step.is_window else tokens[:, None]).tolist()  # [N][k]
        requests, windows, live_of = step.requests, step.windows.tolist(), self._live
        for i in np.flatnonzero(step.sample).tolist():
            req, w, row = requests[i], windows[i], rows[i]
            req.pending -= w
            live = live_of.get(req.request_id)
            if live is None or live.request is not req:  # aborted meanwhile
                continue
            outputs.append(self._append(live, row if len(row) == w else row[:w], now))
        self.scheduler.register(step)
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
        shapes = pool_shapes(c, c.n_layers, 1, self.config.page_size)
        per_page = sum(map(math.prod, shapes)) * np.dtype(self.params.embed.dtype).itemsize
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

    def _batch(self, step: ScheduledStep) -> StepBatch:
        """The step's arrays, written with array operations over its rows. Python visits
        the rows whose input tokens are on the host (prefill chunks; a decode row's is
        usually the one the step before samples, taken on the device), and the sampling
        options of the rows that sample, if any live request does."""
        n, counts, starts = len(step), step.counts, step.starts
        ends = np.cumsum(counts)
        t = int(ends[-1])
        b = self.runner.empty_batch(self.runner.bucket(t))
        first = ends - counts  # each row's first token
        b.q_starts[1:n + 1], b.q_starts[n + 1:] = ends, t
        b.positions[:t] = np.arange(t) + np.repeat(starts - first, counts)
        b.slots[:t] = step.slots
        b.kv_lens[:n] = starts + counts
        b.sample_at[:n] = ends - 1
        b.window[:n] = step.windows
        self.scheduler.allocator.block_tables(step.seqs, out=b.block_tables[:n])
        # tokens [start, start + count) of each row, the last one pending where previous >= 0
        requests, previous = step.requests, step.previous
        pending = previous >= 0
        b.from_previous[ends[pending] - 1] = previous[pending]
        for i in np.flatnonzero(counts > pending).tolist():  # rows with tokens on the host
            s, f = int(starts[i]), int(first[i])
            known = requests[i].tokens[s:s + int(counts[i]) - int(pending[i])]
            b.tokens[f:f + len(known)] = known
        if self._sampling:
            for i in np.flatnonzero(step.sample).tolist():
                self._sampling_row(b, i, requests[i], requests[i].params)
        return b

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
        """A request's sampled tokens, in order, each through the stop ids, its text and the
        stop strings, then the length limit; those after the one that finishes the request
        are dropped (a stop id is not part of the output; a stop string cuts the text
        before it). Without stop strings the tokens up to the first stop id or the limit
        go at once. The output: every step of every request comes this way."""
        if live.first_token_time is None:
            live.first_token_time = now
        req = live.request
        output, stop = req.output, req.params.stop
        reason, used, cut = None, 0, False
        if not stop:  # no stop strings: the tokens taken at once, their text in one call
            take = tokens[:live.limit - len(output)]
            used = len(take)
            if not live.stop_ids.isdisjoint(take):  # a stop id, not part of the output
                used = next(i for i, t in enumerate(take) if t in live.stop_ids)
                take, used, reason = take[:used], used + 1, "stop"
            output.extend(take)
            req.tokens.extend(take)
            if take:
                live.text += live.decode(take)
            if reason is None and len(output) >= live.limit:
                reason = "length"
        else:  # token by token: a stop string may end at any of them
            for token in tokens:
                used += 1
                if token in live.stop_ids:
                    reason = "stop"
                    break
                output.append(token)
                req.tokens.append(token)
                before = len(live.text)
                live.text += live.decode((token,))
                if self._cut(live, before):
                    reason, cut = "stop", True
                    break
                if len(output) >= live.limit:
                    reason = "length"
                    break
        self.totals["generation_tokens"] += used
        if reason is not None:
            if not cut:  # the text the decoder held back (an incomplete character)
                before = len(live.text)
                live.text += live.decode((), final=True)
                if stop:
                    self._cut(live, before)
            return self._finish(live, reason, now)
        return self._output(live, False, None, now)

    def _cut(self, live: _Live, before: int) -> bool:
        """Cut the text before the first stop string in it, if one ends in the text after
        `before` (it starts at most `hold` characters earlier)."""
        start = max(0, before - live.hold)
        cut = min((i for i in (live.text.find(s, start) for s in live.request.params.stop)
                   if i >= 0), default=-1)
        if cut >= 0:
            live.text = live.text[:cut]
        return cut >= 0

    def _finish(self, live: _Live, reason: str, now: float) -> RequestOutput:
        self._drop(live)
        self.totals["requests_finished"] += 1
        return self._output(live, True, reason, now)

    def _drop(self, live: _Live) -> None:
        """Forget a request and free its pages."""
        del self._live[live.request.request_id]
        p = live.request.params
        if p.temperature > 0 or p.min_tokens:
            self._sampling -= 1
        self.scheduler.finish(live.request)

    def _output(self, live: _Live, finished: bool, reason: str | None,
                now: float) -> RequestOutput:
        req, text = live.request, live.text
        upto = max(live.sent, len(text) - (0 if finished else live.hold))
        new_text, live.sent = text[live.sent:upto], upto
        new_ids, live.sent_tokens = req.output[live.sent_tokens:], len(req.output)
        # positional, in the order of RequestOutput's fields (a step makes hundreds); the
        # token list and the text are the request's own, sliced when read
        return RequestOutput(req.request_id, len(req.prompt), new_ids, new_text, finished,
                             reason, req.cached_tokens, req.arrival_time,
                             live.first_token_time, now if finished else None,
                             len(req.output), req.output, text, upto)


# asyncio callers (the HTTP server): an engine driven from a thread
from jaxllm.inference.async_engine import AsyncEngine, RequestStream  # noqa: E402,F401

__all__ = ["Engine", "AsyncEngine", "RequestStream", "SamplingParams", "RequestOutput",
           "QueueFullError", "compile_count"]
