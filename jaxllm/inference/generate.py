"""Autoregressive generation over a contiguous KV cache: the host loop.

Prefill runs the prompts through the model once (flash attention over the prompt, K/V
written to the cache). Decoding then runs on the device in chunks of `decode_chunk`
tokens (`lax.scan`, no host round trip inside a chunk); between chunks the host streams
the new text and stops once every row has produced EOS or the limit is reached. The next
chunk is queued on the device before the host reads the current one, so the host's work
between chunks overlaps the device's.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import Config
from jaxllm.inference.params import DecodeParams, decode_params
from jaxllm.inference.sampling import sample
from jaxllm.inference.speculative import resolve_draft, speculative_generate_ids
from jaxllm.inference.step import eos_ids, forward, init_cache, is_eos, pad_prompts, round_up


@dataclass
class GenerationResult:
    texts: list[str]
    tokens: list[list[int]]  # generated ids per prompt (EOS excluded)
    ttft_s: float  # time to first token (prefill + first sample), compile excluded
    tpot_s: float  # time per output token after the first, per sequence
    tokens_per_s: float  # generated tokens of all rows / decode wall time
    compile_s: float = 0.0
    stats: dict = field(default_factory=dict)


@functools.partial(jax.jit, static_argnames=("cache_len", "temperature", "top_k", "top_p"))
def prefill(params: DecodeParams, tokens, lengths, key, *, cache_len, temperature, top_k,
            top_p):
    """Prompts (B, P) right-padded, true lengths (B,) -> (cache, first tokens (B,))."""
    zeros = jnp.zeros_like(lengths)
    logits, cache, _ = forward(params, tokens, init_cache(params, tokens.shape[0], cache_len),
                               zeros, prefill=True)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return cache, sample(last, key, temperature, top_k, top_p)


@functools.partial(jax.jit, donate_argnames=("cache",),
                   static_argnames=("steps", "temperature", "top_k", "top_p", "eos_id"))
def decode_chunk(params: DecodeParams, cache, token, pos, done, key, *, steps, temperature,
                 top_k, top_p, eos_id):
    """`steps` decode steps on the device. token (B,) sits at pos (B,).

    Returns (cache, next token, next pos, done, key, emitted (B, steps)); rows already
    done emit -1.
    """
    def step(carry, _):
        cache, token, pos, done, key = carry
        key, sub = jax.random.split(key)
        logits, cache, _ = forward(params, token[:, None], cache, pos)
        nxt = sample(logits[:, 0], sub, temperature, top_k, top_p)
        emitted = jnp.where(done, -1, token)
        done = done | is_eos(token, eos_id)
        return (cache, nxt, pos + 1, done, key), emitted

    (cache, token, pos, done, key), out = jax.lax.scan(step, (cache, token, pos, done, key),
                                                       None, length=steps)
    return cache, token, pos, done, key, out.T


def generate_ids(params: DecodeParams, prompts: list[list[int]], *, max_new_tokens: int,
                 temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 eos_id: int | tuple[int, ...] | None = None, chunk: int = 16,
                 on_tokens: Callable[[np.ndarray], None] | None = None,
                 warmup: bool = True, overlap: bool = True) -> tuple[list[list[int]], dict]:
    """Generate up to `max_new_tokens` ids per prompt. Returns (ids per prompt, timings).

    A row stops at `eos_id`, or at any of several ids (a tuple).
    `on_tokens(ids (B, n))` is called with every newly generated block (-1 after a row's
    end), for streaming. With `warmup`, both functions are compiled before timing starts.

    With `overlap` (the default) the next chunk is dispatched before the host reads the
    current one's tokens (and the first chunk before the host waits for the first token),
    so the device never waits on the host between chunks. When every row has stopped at
    EOS, the one chunk already queued behind it still runs on the device, and its tokens
    are dropped. Without `overlap`, each chunk is dispatched after the previous one's
    tokens have reached the host.
    """
    b = len(prompts)
    eos_id = eos_ids(eos_id)
    tokens, lengths = pad_prompts(prompts)
    cache_len = round_up(tokens.shape[1] + max_new_tokens + chunk, 64)
    opts = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    step_opts = dict(opts, eos_id=eos_id, steps=chunk)
    key = jax.random.key(seed)
    k_prefill, k_decode = jax.random.split(key)

    compile_s = 0.0
    if warmup:
        t0 = time.perf_counter()
        cache, tok = prefill(params, tokens, lengths, k_prefill, cache_len=cache_len,
                                **opts)
        state = (cache, tok, lengths, jnp.zeros(b, bool), k_decode)
        for _ in range(2):  # the second call sees the first's outputs, as in the loop
            state = decode_chunk(params, *state, **step_opts)[:5]
        jax.block_until_ready(state)
        compile_s = time.perf_counter() - t0

    n_chunks = -(-max_new_tokens // chunk)
    t_start = time.perf_counter()
    cache, token = prefill(params, tokens, lengths, k_prefill, cache_len=cache_len,
                              **opts)
    state = (cache, token, lengths, jnp.zeros(b, bool), k_decode)
    queued = []  # dispatched chunks whose tokens the host has not read yet
    if overlap and n_chunks:
        queued.append(decode_chunk(params, *state, **step_opts))
    token.block_until_ready()
    t_first = time.perf_counter()
    blocks, n_steps, dispatched = [], 0, len(queued)
    while n_steps < max_new_tokens:
        if not queued:
            queued.append(decode_chunk(params, *state, **step_opts))
            dispatched += 1
        *state, emitted = queued.pop(0)
        if overlap and dispatched < n_chunks:  # the next chunk runs while the host reads
            queued.append(decode_chunk(params, *state, **step_opts))
            dispatched += 1
        emitted, done = jax.device_get((emitted, state[3]))
        emitted = emitted[:, :max_new_tokens - n_steps]
        n_steps += emitted.shape[1]
        blocks.append(emitted)
        if on_tokens is not None:
            on_tokens(np.where(np.isin(emitted, eos_id), -1, emitted))
        if bool(done.all()):  # every row has emitted EOS
            break
    t_end = time.perf_counter()

    allout = np.concatenate(blocks, axis=1)
    ids = []
    for row in allout:
        row = row.tolist()
        cut = len(row)
        for j, t in enumerate(row):
            if t < 0 or t in eos_id:
                cut = j
                break
        ids.append(row[:cut])
    n_gen = sum(len(r) for r in ids)
    steps_run = allout.shape[1]
    timings = {
        "ttft_s": t_first - t_start,
        "tpot_s": (t_end - t_first) / max(steps_run - 1, 1),
        "tokens_per_s": n_gen / (t_end - t_start),
        "decode_steps": steps_run,
        "generated_tokens": n_gen,
        "compile_s": compile_s,
    }
    return ids, timings


def check_prompts(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int) -> None:
    """Refuse token-id prompts that with `max_new_tokens` overrun model.max_seq_len."""
    longest = max(len(p) for p in prompts)
    room = max_seq_len - max_new_tokens
    if longest > room:
        raise ValueError(f"a prompt of {longest} tokens + max_new_tokens {max_new_tokens} "
                         f"exceeds model.max_seq_len={max_seq_len}; shorten the prompt to "
                         f"{max(room, 0)} tokens or lower max_new_tokens")


def generate(model, cfg: Config, prompts: list[str | list[int]], *,
             max_new_tokens: int | None = None, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, tokenizer=None,
             stream: Callable[[str], None] | None = None, return_result: bool = False,
             draft_model=None):
    """Generate text for each prompt (a text, or a list of token ids fed as they are, e.g. a
    rendered chat: jaxllm.chat). Options default to the config's `inference` section.

    `stream(text)` receives text as it is produced (for a single prompt). Returns the list
    of generated texts, or a GenerationResult with `return_result=True`. With
    inference.speculative.method != none, decoding is speculative (the same distribution;
    `draft_model` overrides the configured draft checkpoint) and the text arrives at once.
    """
    from jaxllm.tokenizer import load_tokenizer

    inf = cfg.inference
    tokenizer = tokenizer or load_tokenizer(cfg.data.tokenizer)
    if isinstance(prompts, str):
        prompts = [prompts]
    ids = [tokenizer.encode_prompt(p) if isinstance(p, str) else [int(t) for t in p]
           for p in prompts]
    max_new_tokens = inf.max_new_tokens if max_new_tokens is None else max_new_tokens
    check_prompts(ids, max_new_tokens, cfg.model.max_seq_len)
    params = decode_params(model, cfg)
    on_tokens = None
    if stream is not None and len(prompts) == 1:
        dec = tokenizer.stream_decoder()
        on_tokens = lambda block: stream(dec([t for t in block[0] if t >= 0]))
    options = dict(
        max_new_tokens=max_new_tokens,
        temperature=inf.temperature if temperature is None else temperature,
        top_k=inf.top_k if top_k is None else top_k,
        top_p=inf.top_p if top_p is None else top_p,
        seed=seed, eos_id=tokenizer.eos_ids, on_tokens=on_tokens)
    spec = inf.speculative
    if spec.method == "none":
        out, timings = generate_ids(params, ids, chunk=inf.decode_chunk, **options)
    else:  # the same distribution in fewer target forwards (inference/speculative.py)
        out, timings = speculative_generate_ids(
            params, ids, method=spec.method, k=spec.resolved_k(cfg.model.mtp_depth),
            draft=resolve_draft(cfg, draft_model), **options)
    if on_tokens is not None:  # what the stream decoder held back (an incomplete character)
        rest = dec((), final=True)
        if rest:
            stream(rest)
    texts = [tokenizer.decode(r) for r in out]
    if not return_result:
        return texts
    return GenerationResult(texts, out, timings["ttft_s"], timings["tpot_s"],
                            timings["tokens_per_s"], timings["compile_s"], timings)
