"""What a caller hands the serving engine and what it gets back.

`SamplingParams` are one request's options (OpenAI's names where OpenAI has them);
`RequestOutput` is one request's progress after an engine step: the new tokens and text
since the last output (the delta a stream sends) and the totals so far.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort")


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (inference.engine.max_waiting): try again later."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 and top_p 1 turn those masks off. `seed` makes a
    sampled request reproducible whatever it is batched with (None: drawn from the engine's
    seed and the request's number). A request stops at `max_tokens` generated tokens, at an
    EOS id of the tokenizer (unless `ignore_eos`), at one of `stop_token_ids`, or when its text
    contains one of the `stop` strings (the text is cut before it); not before `min_tokens`."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # lists (as JSON gives them) become tuples, so params stay hashable
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must lie in [0, max_tokens="
                             f"{self.max_tokens}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={list(self.stop)!r}: stop strings must be non-empty strings")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed={self.seed} must lie in [0, 2**63)")

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclass
class RequestOutput:
    """One request after a step. `new_token_ids` / `new_text`: what this step added (text
    held back while it could still be the start of a stop string, or an unfinished UTF-8
    character); `token_ids` / `text`: all of it so far, sliced when read from the
    request's own token list and text (which only grow), so a step costs the same for a
    request's first token and its ten-thousandth. Times are `time.perf_counter()` seconds:
    arrival, first generated token, finish."""

    request_id: str
    prompt_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    completion_tokens: int = 0  # len(token_ids)
    # the request's own token list and text, shared and growing: read token_ids / text
    all_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    all_text: str = field(default="", repr=False, compare=False)
    text_len: int = 0  # len(text)

    @property
    def token_ids(self) -> list[int]:
        return self.all_ids[:self.completion_tokens]

    @property
    def text(self) -> str:
        return self.all_text[:self.text_len]
