"""An Engine driven from a background thread, for asyncio callers (the HTTP server).

    aeng = AsyncEngine(engine).start()
    stream = aeng.add_request(prompt_ids, params)    # checked at once: ValueError, QueueFullError
    async for out in stream: ...                     # RequestOutput deltas; leaving aborts

The thread owns the engine: requests and aborts reach it as commands between steps, and
each step's outputs reach the event loop in one wake-up.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from jaxllm.inference.requests import QueueFullError, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from jaxllm.inference.engine import Engine


def _deliver(items) -> None:  # on the event loop
    for stream, out in items:
        stream._queue.put_nowait(out)


class RequestStream:
    """One request's outputs for an asyncio caller: `async for out in stream`. Leaving the
    loop early, `aclose()`, cancellation or `await stream.abort()` aborts the request."""

    def __init__(self, owner: "AsyncEngine", request_id: str):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.finished = False

    def _put(self, item) -> None:  # from the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self):
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self._owner.abort(self.request_id)

    async def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Runs an Engine's steps in a background thread; asyncio code adds requests and reads
    their outputs as streams. Requests and aborts reach the engine between steps."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.01):
        self.engine = engine
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._pending = 0  # added, not yet handed to the engine
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._thread: threading.Thread | None = None

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def start(self) -> "AsyncEngine":
        self._thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def add_request(self, prompt_ids, params: SamplingParams,
                    request_id: str | None = None) -> RequestStream:
        """Check and queue a request (call from the event loop): ValueError for a bad one,
        QueueFullError when the queue is full, RuntimeError once the engine has died."""
        if self.error is not None:
            raise RuntimeError(f"the engine has stopped: {self.error!r}")
        prompt_ids = [int(t) for t in prompt_ids]
        self.engine.check_request(prompt_ids, params)
        waiting = len(self.engine.scheduler.waiting) + self._pending
        if waiting >= self.engine.config.max_waiting:
            raise QueueFullError(f"{waiting} requests are waiting (inference.engine."
                                 f"max_waiting={self.engine.config.max_waiting})")
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._pending += 1
        self._commands.put(("add", request_id, prompt_ids, params))
        self._wake.set()
        return stream

    async def generate(self, prompt_ids, params: SamplingParams, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(prompt_ids, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params = cmd
                self._pending -= 1
                if rid not in self._streams:  # aborted before it reached the engine
                    continue
                try:
                    self.engine.add_request(ids, params, rid)
                except (ValueError, QueueFullError) as e:
                    self._streams.pop(rid)._put(e)
            else:
                self.engine.abort(cmd[1])

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                batches = {}  # one wake-up of each event loop a step, not one per output
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                        batches.setdefault(stream._loop, []).append((stream, out))
                for loop, items in batches.items():
                    loop.call_soon_threadsafe(_deliver, items)
        except BaseException as e:  # the engine died: every open stream hears of it
            self.error = e
            for stream in self._streams.values():
                stream._put(RuntimeError(f"the engine stopped: {e!r}"))
            self._streams.clear()
            raise
