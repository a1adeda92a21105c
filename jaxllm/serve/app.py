"""The OpenAI-compatible HTTP API over an AsyncEngine.

    app = create_app(aeng, tokenizer, "my-model", cfg)   # a FastAPI app; serve it with uvicorn

Each request becomes engine requests (one per prompt) whose RequestOutput deltas become a
JSON reply, or SSE chunks when `stream` is set. A request whose client goes away is
aborted, so its KV pages return to the pool. Errors are OpenAI-shaped: 400 for a bad field
(named in `param`), 404 for an unknown model, 429 when the engine's queue is full, 503 when
the engine thread has died.
"""
from __future__ import annotations

import asyncio
import json
import re

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxllm.inference.requests import QueueFullError
from jaxllm.serve.metrics import CONTENT_TYPE, Metrics
from jaxllm.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, new_id,
                                   now, usage)

# how often a non-streamed request checks whether its client is still there
DISCONNECT_POLL_S = 0.25


def create_app(aeng, tokenizer, model_name: str, cfg) -> FastAPI:
    """The app serving `aeng` (an AsyncEngine, started by the caller) as `model_name`."""
    app = FastAPI(title="jaxllm", docs_url=None, redoc_url=None)
    server = _Server(aeng, tokenizer, model_name, cfg)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return JSONResponse(_validation_api_error(e).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(),
                            status_code=e.status_code)

    @app.get("/health")
    async def health():
        if not aeng.healthy:
            return JSONResponse(_dead(aeng).body(), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": server.created, "owned_by": "jaxllm",
            "max_model_len": server.engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat_completions(body, request)

    return app


class _Server:
    def __init__(self, aeng, tokenizer, model_name, cfg):
        self.aeng, self.engine, self.tokenizer = aeng, aeng.engine, tokenizer
        self.model_name, self.cfg = model_name, cfg
        self.metrics = Metrics(self.engine)
        self.created = now()
        try:
            from jaxllm import chat
            self.chat_template, self.no_template = chat.template_of(tokenizer), None
        except ValueError as e:
            self.chat_template, self.no_template = None, str(e)

    # --- the endpoints

    async def completions(self, body: CompletionRequest, request: Request):
        self._check(body)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty: give a text, a list of token ids, or a list "
                                "of either", param="prompt")
        ids = []
        for p in prompts:
            if isinstance(p, str):
                ids.append(self.tokenizer.encode_prompt(p))
            elif p and all(isinstance(t, int) for t in p):
                ids.append(list(p))
            else:
                raise APIError(400, f"prompt: {p!r} is empty (give at least one token id)",
                               param="prompt")
        max_tokens = body.max_tokens
        if max_tokens is None:  # null: the room the longest prompt leaves
            max_tokens = self._room(max(ids, key=len), "prompt")
        params = self._params(body, max_tokens, "max_tokens")
        streams = await self._submit(ids, params, "prompt", "max_tokens")
        rid = new_id("cmpl")
        if body.stream:
            return _sse(self._completion_chunks(rid, streams, body), streams)
        outs = await self._collect(streams, request)
        return {"id": rid, "object": "text_completion", "created": now(),
                "model": self.model_name,
                "choices": [{"index": i, "text": o.text, "logprobs": None,
                             "finish_reason": o.finish_reason,
                             **({"token_ids": o.token_ids} if body.return_token_ids else {})}
                            for i, o in enumerate(outs)],
                "usage": _usage(outs)}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        from jaxllm import chat

        self._check(body)
        if self.chat_template is None:
            raise APIError(400, f"this model cannot chat: {self.no_template}",
                           param="messages", code="chat_template_missing")
        messages = [m.as_dict(i) for i, m in enumerate(body.messages)]
        try:
            ids = chat.encode(self.tokenizer, messages, template=self.chat_template)
        except ValueError as e:  # the template refused the conversation
            raise APIError(400, str(e), param="messages") from e
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if field == "max_completion_tokens" \
            else body.max_tokens
        if max_tokens is None:  # the room left in the context
            max_tokens = self._room(ids, "messages")
        params = self._params(body, max_tokens, field)
        streams = await self._submit([ids], params, "messages", field)
        rid = new_id("chatcmpl")
        if body.stream:
            return _sse(self._chat_chunks(rid, streams[0], body), streams)
        (out,) = await self._collect(streams, request)
        return {"id": rid, "object": "chat.completion", "created": now(),
                "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "logprobs": None, "finish_reason": out.finish_reason}],
                "usage": _usage([out])}

    # --- requests in

    def _check(self, body) -> None:
        if not self.aeng.healthy:
            raise _dead(self.aeng)
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        for name, value in body.unsupported().items():
            raise APIError(400, f"{name}={value!r} is not supported by this server"
                                + (" (n=1 only)" if name == "n" else ""), param=name,
                           code="unsupported")

    def _room(self, ids: list[int], what: str) -> int:
        room = self.engine.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"the {what} ({len(ids)} tokens) leaves no room in the model's "
                                f"context of {self.engine.max_model_len} tokens", param=what)
        return room

    def _params(self, body, max_tokens: int, max_tokens_field: str):
        try:
            return body.sampling_params(max_tokens)
        except ValueError as e:
            param = _field_named(str(e)) or _field_in(str(e)) or "max_tokens"
            message = str(e)
            if param == "max_tokens" and max_tokens_field != "max_tokens":
                param, message = max_tokens_field, message.replace("max_tokens", max_tokens_field)
            raise APIError(400, message, param=param) from e

    async def _submit(self, ids: list[list[int]], params, prompt_field: str,
                      max_tokens_field: str) -> list:
        """The engine streams of `ids` (every prompt checked before any is queued)."""
        for p in ids:
            try:
                self.engine.check_request(p, params)
            except ValueError as e:
                message = str(e)
                if "max_tokens" in message:
                    param = max_tokens_field
                    message = message.replace("max_tokens", max_tokens_field)
                else:
                    param = _field_named(message) or _field_in(message) or prompt_field
                raise APIError(400, message, param=param) from e
        streams = []
        try:
            for p in ids:
                streams.append(self.aeng.add_request(p, params))
        except (ValueError, QueueFullError, RuntimeError) as e:
            for s in streams:
                await _abort(s)
            if isinstance(e, QueueFullError):
                raise APIError(429, f"the server is busy: {e}", code="queue_full") from e
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param=_field_named(str(e)) or prompt_field) from e
            raise _dead(self.aeng) if not self.aeng.healthy else e
        return streams

    # --- responses out

    async def _merged(self, streams):
        """(index, RequestOutput) from all streams as they arrive; streams left unfinished
        when this ends (the client went away, or the task was cancelled) are aborted."""
        finished = [False] * len(streams)
        try:
            if len(streams) == 1:
                async for out in streams[0]:
                    finished[0] = out.finished
                    if out.finished:
                        self.metrics.observe(out)
                    yield 0, out
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, s):
                try:
                    async for out in s:
                        queue.put_nowait((i, out))
                except Exception as e:  # handed to the reader, who raises it
                    queue.put_nowait((i, e))

            tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
            try:
                while not all(finished):
                    i, out = await queue.get()
                    if isinstance(out, BaseException):
                        raise out
                    finished[i] = out.finished
                    if out.finished:
                        self.metrics.observe(out)
                    yield i, out
            finally:
                for t in tasks:
                    t.cancel()
        finally:
            for s, done in zip(streams, finished):
                if not done:
                    await _abort(s)

    async def _collect(self, streams, request: Request) -> list:
        """The final output of each stream; aborts them all if the client disconnects."""
        outs = [None] * len(streams)

        async def consume():
            merged = self._merged(streams)
            try:
                async for i, out in merged:
                    if out.finished:
                        outs[i] = out
            finally:
                with anyio.CancelScope(shield=True):
                    await merged.aclose()

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    break
        finally:
            if not task.done():
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as e:
                raise self._engine_error(e) from e
        if any(o is None for o in outs):  # the client is gone: nobody reads this reply
            raise APIError(499, "the client disconnected", code="client_disconnected")
        return outs

    def _engine_error(self, e: Exception) -> APIError:
        if not self.aeng.healthy:
            return _dead(self.aeng)
        if isinstance(e, QueueFullError):  # refused when it reached the engine
            return APIError(429, f"the server is busy: {e}", code="queue_full")
        if isinstance(e, ValueError):
            return APIError(400, str(e), param=_field_named(str(e)) or _field_in(str(e)))
        return APIError(500, f"the request failed in the engine: {e!r}", code="engine_error")

    async def _completion_chunks(self, rid, streams, body):
        created = now()
        finals = {}

        def chunk(choices, **extra):
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": self.model_name, "choices": choices, **extra}

        merged = self._merged(streams)
        try:
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
                ids = body.return_token_ids and out.new_token_ids
                if out.new_text or out.finished or ids:
                    choice = {"index": i, "text": out.new_text, "logprobs": None,
                              "finish_reason": out.finish_reason if out.finished else None}
                    if body.return_token_ids:
                        choice["token_ids"] = out.new_token_ids
                    yield chunk([choice])
        except Exception as e:
            yield self._engine_error(e).body()
            return
        finally:  # a generator left in its loop is not closed by leaving it
            with anyio.CancelScope(shield=True):
                await merged.aclose()
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=_usage([finals[i] for i in sorted(finals)]))

    async def _chat_chunks(self, rid, stream, body):
        created = now()
        final = None

        def chunk(choices, **extra):
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": choices, **extra}

        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
        merged = self._merged([stream])
        try:
            async for _, out in merged:
                if out.finished:
                    final = out
                if out.new_text or out.finished:
                    delta = {"content": out.new_text} if out.new_text else {}
                    yield chunk([{"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": out.finish_reason if out.finished else None}])
        except Exception as e:
            yield self._engine_error(e).body()
            return
        finally:  # a generator left in its loop is not closed by leaving it
            with anyio.CancelScope(shield=True):
                await merged.aclose()
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=_usage([final]))


class _SSEResponse(StreamingResponse):
    """Closes its chunk generator and aborts its engine streams however the response ends (a
    failed send included, or one before the first chunk), so a request whose client went
    away is aborted at once, not when the generator is collected."""

    def __init__(self, content, streams, **kwargs):
        super().__init__(content, **kwargs)
        self.streams = streams

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                for s in self.streams:  # a no-op for a finished stream
                    await s.abort()


def _sse(chunks, streams) -> StreamingResponse:
    async def events():
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()

    return _SSEResponse(events(), streams, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _abort(stream) -> None:
    with anyio.CancelScope(shield=True):  # also when the caller is being cancelled
        await stream.abort()


def _usage(outs) -> dict:
    return usage(sum(o.prompt_tokens for o in outs), sum(o.completion_tokens for o in outs),
                 sum(o.cached_tokens for o in outs))


def _dead(aeng) -> APIError:
    why = f"the engine has stopped ({aeng.error!r})" if aeng.error is not None else \
        "the engine thread is not running"
    return APIError(503, f"{why}; restart the server", code="engine_dead")


def _field_named(message: str) -> str | None:
    """The field a ValueError of SamplingParams or the engine names first (`name=value`)."""
    m = re.match(r"\s*(\w+)=", message)
    return m.group(1) if m else None


_FIELDS = ("min_tokens", "stop_token_ids", "stop", "ignore_eos", "temperature", "top_p",
           "top_k", "seed")


def _field_in(message: str) -> str | None:
    """The sampling field a message mentions first."""
    found = [(m.start(), name) for name in _FIELDS
             if (m := re.search(rf"\b{name}\b", message))]
    return min(found)[1] if found else None


def _validation_api_error(e: RequestValidationError) -> APIError:
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('msg', '')}")
    param = loc[0] if loc else None
    path = ".".join(loc) or "body"
    message = f"{path}: {first.get('msg', 'invalid')}"
    if "input" in first and first.get("type") != "missing":
        message += f" (got {first['input']!r})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more problem(s)"
    return APIError(400, message, param=param)
