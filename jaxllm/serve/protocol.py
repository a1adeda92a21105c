"""The OpenAI request bodies the server accepts, and the errors it answers with.

Requests are pydantic models with OpenAI's field names; the vLLM extensions `top_k`,
`min_tokens`, `stop_token_ids`, `ignore_eos` and `return_token_ids` (each choice, and each
streamed delta, also carries its generated token ids; a streamed step that adds tokens but
no text is then sent too) are accepted too. Fields of the OpenAI API
that the engine cannot honour are refused with a 400 naming them (never silently ignored);
fields that change nothing here (`user`, `metadata`, ...) are accepted and ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from jaxllm.inference.requests import SamplingParams


class APIError(Exception):
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
             500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The sampling fields both endpoints share (OpenAI's defaults when absent)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    min_tokens: StrictInt = 0
    n: StrictInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields the engine does not implement: any value but the neutral one is a 400
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> dict[str, Any]:
        """field -> value for each OpenAI feature asked for that the server does not offer."""
        out = {}
        if self.n != 1:
            out["n"] = self.n
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = self.logit_bias
        return out

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    # a text, a list of ids, or a list of either (one choice each)
    prompt: Union[str, list[StrictInt], list[Union[str, list[StrictInt]]]]
    max_tokens: StrictInt | None = 16
    echo: bool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None

    def unsupported(self) -> dict[str, Any]:
        out = super().unsupported()
        if self.echo:
            out["echo"] = True
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.best_of not in (None, 1):
            out["best_of"] = self.best_of
        if self.suffix:
            out["suffix"] = self.suffix
        return out

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):  # one prompt of ids
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_dict(self, index: int) -> dict:
        content = self.content
        if isinstance(content, list):  # text parts joined; any other part cannot be fed
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise APIError(400, f"messages[{index}].content: only text parts are "
                                    f"supported, got {bad[0]!r}", param=f"messages.{index}.content")
            content = "".join(p.text or "" for p in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    def unsupported(self) -> dict[str, Any]:
        out = super().unsupported()
        if self.logprobs:
            out["logprobs"] = True
        if self.top_logprobs:
            out["top_logprobs"] = self.top_logprobs
        if self.tools:
            out["tools"] = "[...]"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            out["response_format"] = self.response_format
        return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}

