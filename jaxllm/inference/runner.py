"""The serving engine's model runner: one jitted step over a flat batch of tokens.

A step takes T new tokens from up to N sequences (decode rows of one token and prefill
chunks of many, in any mix), writes their K/V into the page pool, attends with
`kernels.ragged_paged_attention`, and samples one token for each sequence that reached the
end of its known tokens, with that request's own options. The pool is donated, so it is
updated in place. A multi-head latent attention model's pool holds its latents instead, one
row of kv_lora_rank + qk_rope_head_dim values a token and layer, and every new token
attends over it through `kernels.mla_decode` (the absorbed form, `RaggedLatentCache`).

A decode window runs several decode steps in one call: when every scheduled sequence has
one token to run, sequence s runs window[s] steps back to back on the device, each taking
the previous step's sample as its input, so the host's scheduling and dispatch are paid
once for them all (as vLLM's multi-step scheduling does).

Shapes are static: T is rounded up to a power of two (`token_buckets`), N is the smaller
of T and `max_num_seqs` (a sequence runs at least one token, so a step of T tokens has at
most T sequences; padding sequences have no tokens) and the block tables are
`max_pages_per_seq` wide, so the step compiles once per token bucket and the window once
per bucket up to N rows, all at start-up (`warm_up`), and never after. Each is compiled
twice: greedy (an argmax) and sampling (temperature, top-k, top-p), the host picking the
form from the rows' temperatures. Nothing in a step branches on the device: the GPU runtime
resolves a device-side branch (`lax.cond`) by reading its predicate back, which holds the
host until every kernel before the branch has run, and so would serialise the host's work
on the next step with the device's on this one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.inference.cache import RaggedLatentCache, RaggedPagedCache, token_slots
from jaxllm.inference.params import DecodeParams
from jaxllm.inference.sampling import sample_rows
from jaxllm.inference.step import hidden_states, logits
from jaxllm.model.layers import as_dtype

MAX_BANNED = 8  # token ids a row can ban at once (EOS / stop ids before min_tokens)
# XLA options of the compiled steps on a GPU: its matmuls on cuBLAS, not XLA's Triton GEMM
# fusions (1B, H100: a decode step of 64 rows 3.39 -> 3.30 ms, 32 rows 1.31 -> 1.18 ms,
# 512 rows 1.90 -> 1.82 ms; docs/experiments.md)
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def token_buckets(max_tokens: int, smallest: int = 16, step: int = 512) -> tuple[int, ...]:
    """Powers of two from `smallest` to `step`, then multiples of `step`, up to the first
    >= max_tokens (a step of decode rows plus one prompt pads less than to a power of two)."""
    out = [smallest]
    while out[-1] < max_tokens:
        out.append(out[-1] * 2 if out[-1] < step else out[-1] + step)
    return tuple(out)


@dataclasses.dataclass
class StepBatch:
    """One step's inputs on the host (numpy), padded to a bucket: tokens, positions, slots
    and from_previous [T] (a row >= 0 takes its token from that sequence slot of the
    previous step's samples, not yet on the host: a decode row scheduled before the step
    that samples its input has been read); block_tables [N, W], kv_lens [N], q_starts
    [N + 1]; per sequence: sample_at (the row whose logits it samples from), temperature,
    top_k, top_p, seed (uint32 [N, 2]), draw (the number of the token drawn, so a seeded
    request draws the same whatever it is batched with), banned ids [N, MAX_BANNED]
    (vocab size: none) and ban_steps (a window's steps that ban them: min_tokens) and, for a
    decode window, window [N] (the steps each sequence runs). The fields are views of one
    int32 buffer (`buffer`), which travels to the device as it is (`pack`); on the device
    `unpack` cuts it into the fields again."""
    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    from_previous: np.ndarray
    block_tables: np.ndarray
    kv_lens: np.ndarray
    q_starts: np.ndarray
    sample_at: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    draw: np.ndarray
    banned: np.ndarray
    ban_steps: np.ndarray
    window: np.ndarray
    buffer: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def pack(self) -> np.ndarray:
        """The int32 buffer the fields are views of."""
        return self.buffer

    def layout(self) -> tuple:
        """(name, shape, dtype) of each field: how `unpack` cuts the buffer."""
        return tuple((name, getattr(self, name).shape, getattr(self, name).dtype.str)
                     for name in _ARRAYS)


_ARRAYS = tuple(f.name for f in dataclasses.fields(StepBatch) if f.name != "buffer")


def unpack(buf, layout) -> StepBatch:
    """The StepBatch of a packed buffer: static slices, bitcast on the device; on the host
    (numpy) the fields are views of `buf`, which the batch keeps as its buffer."""
    host = isinstance(buf, np.ndarray)
    fields = {}
    for name, start, stop, shape, dtype in _cuts(layout):
        x = buf[start:stop]
        if dtype != np.int32:
            x = x.view(dtype) if host else jax.lax.bitcast_convert_type(x, dtype)
        fields[name] = x.reshape(shape)
    return StepBatch(**fields, buffer=buf if host else None)


@functools.lru_cache(maxsize=None)
def _cuts(layout) -> tuple:
    """(name, start, stop, shape, dtype) of each field of a layout in the buffer."""
    out, at = [], 0
    for name, shape, dtype in layout:
        n = math.prod(shape)
        out.append((name, at, at + n, shape, np.dtype(dtype)))
        at += n
    return tuple(out)


def pool_shapes(cfg, n_layers: int, num_pages: int, page_size: int) -> tuple[tuple, ...]:
    """The page pool's arrays: k and v [L, Hkv, P, page, D], or a multi-head latent
    attention model's one latent pool [L, P, page, kv_lora_rank + qk_rope_head_dim]."""
    if cfg.mla is not None:
        return ((n_layers, num_pages, page_size, cfg.mla.latent_dim),)
    return ((n_layers, cfg.n_kv_heads, num_pages, page_size, cfg.resolved_head_dim),) * 2


def _cache(params: DecodeParams, pools: tuple, b: StepBatch, max_q_len: int | None):
    if params.cfg.mla is not None:
        return RaggedLatentCache(pools[0], b.slots, b.block_tables, b.kv_lens, b.q_starts,
                                 rank=params.cfg.mla.kv_lora_rank)
    return RaggedPagedCache(*pools, b.slots, b.block_tables, b.kv_lens, b.q_starts,
                            max_q_len=max_q_len)


def _pools(cache) -> tuple:
    return (cache.c,) if isinstance(cache, RaggedLatentCache) else (cache.k, cache.v)


def _sample(params: DecodeParams, pools: tuple, tokens, b: StepBatch, banned, sampled: bool,
            max_q_len: int | None = None):
    """The tokens through the model, writing their K/V (or latents); one sample per sequence
    (the argmax of each when no row samples: `sampled` is the host's, so nothing branches on
    the device, where a branch would hold the host until the step's logits exist).
    max_q_len: no sequence runs more tokens (a decode window's steps: 1)."""
    h, cache = hidden_states(params, tokens[None], b.positions[None],
                             _cache(params, pools, b, max_q_len))
    out = logits(params, h[:, b.sample_at])[0]  # (N, V) float32
    rows = jnp.arange(out.shape[0])[:, None]
    out = out.at[rows, banned].set(-jnp.inf, mode="drop")
    if not sampled:
        return _pools(cache), jnp.argmax(out, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(
        jax.random.fold_in(jax.random.key(s[0]), s[1]), i))(b.seed, b.draw)
    return _pools(cache), sample_rows(out, keys, b.temperature, b.top_k, b.top_p)


def _inputs(b: StepBatch, previous):
    return jnp.where(b.from_previous >= 0, previous[jnp.maximum(b.from_previous, 0)], b.tokens)


def _as_last(samples, previous):
    """A step's samples [N] in the engine's `last` [max_num_seqs] (N may be smaller)."""
    return jnp.zeros_like(previous).at[:samples.shape[0]].set(samples)


def step_weights(params: DecodeParams) -> tuple[tuple, tuple]:
    """The parameters as the compiled steps take them, made once: the leaves of `params` in
    one flat tuple, the 1-D ones (norm scales, expert biases) of each shape and dtype stacked
    into one [n, size] array; and the static form `step_params` rebuilds them from. A call's
    host time grows with its number of arrays (each is flattened, checked and handed to the
    runtime: 99 -> 67 for a 16-layer dense model), while a stacked vector's row is read by
    the elementwise fusion that uses it, as the vector was: the device's work is the same."""
    leaves, treedef = jax.tree.flatten(params)
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        if x.ndim == 1:
            groups.setdefault((x.shape, x.dtype), []).append(i)
    # where each leaf comes from: (index in the tuple, row of that array or None)
    source = {i: (g, row) for g, rows in enumerate(groups.values()) for row, i in enumerate(rows)}
    plain = [i for i in range(len(leaves)) if i not in source]
    source.update((i, (at, None)) for at, i in enumerate(plain, start=len(groups)))
    weights = (tuple(jnp.stack([leaves[i] for i in rows]) for rows in groups.values())
               + tuple(leaves[i] for i in plain))
    return weights, (treedef, tuple(source[i] for i in range(len(leaves))))


def step_params(weights: tuple, form: tuple) -> DecodeParams:
    """DecodeParams from `step_weights`' arrays (inside the compiled step)."""
    treedef, source = form
    return jax.tree.unflatten(treedef, [weights[at] if row is None else weights[at][row]
                                        for at, row in source])


def _step(form, weights: tuple, pools: tuple, previous, buf, layout, sampled: bool):
    params = step_params(weights, form)
    b = unpack(buf, layout)
    banned = jnp.where(b.ban_steps[:, None] > 0, b.banned, params.cfg.vocab_size)
    pools, samples = _sample(params, pools, _inputs(b, previous), b, banned, sampled)
    return pools, _as_last(samples, previous)


def _window(form, weights: tuple, pools: tuple, previous, buf, layout, sampled: bool,
            steps: int):
    """`steps` decode steps; token row i is sequence i's one token. Sequence s advances
    window[s] of them (its later ones write nothing and are not read) -> the pools, the
    samples [steps, N] and each sequence's last sample [N]."""
    b = unpack(buf, layout)
    t, n = b.tokens.shape[0], b.kv_lens.shape[0]
    seq_of_row = jnp.minimum(jnp.arange(t), n - 1)
    row_window = jnp.where(jnp.arange(t) < b.q_starts[-1], b.window[seq_of_row], 0)
    tables = b.block_tables[seq_of_row]

    def body(carry, j):
        pools, tokens = carry
        params = step_params(weights, form)  # stacked vectors' rows read in the loop's fusions
        pos = b.positions + j
        live = j < row_window
        # a row past its window writes to the one-past-the-end slot, which is dropped
        slots = token_slots(tables, jnp.where(live, pos, -1)[:, None], pools[0].shape[-2],
                            pools[0].shape[-3])[:, 0]
        advance = jnp.minimum(j, jnp.maximum(b.window - 1, 0))
        bj = dataclasses.replace(b, positions=jnp.where(live, pos, b.positions), slots=slots,
                                 kv_lens=jnp.where(b.kv_lens > 0, b.kv_lens + advance, 0),
                                 draw=b.draw + j)
        banned = jnp.where(j < b.ban_steps[:, None], b.banned, params.cfg.vocab_size)
        pools, drawn = _sample(params, pools, tokens, bj, banned, sampled, max_q_len=1)
        return (pools, drawn[seq_of_row]), drawn

    (pools, _), samples = jax.lax.scan(body, (pools, _inputs(b, previous)), jnp.arange(steps))
    last = samples[jnp.maximum(b.window - 1, 0), jnp.arange(n)]
    return pools, samples, _as_last(last, previous)


class ModelRunner:
    """The page pool (`pools`: k and v [L, Hkv, num_pages, page_size, D], or the latent
    pool of an MLA model) and the compiled step per bucket (and, with window_steps > 1, the
    decode window per bucket of at most N rows)."""

    def __init__(self, params: DecodeParams, *, num_pages: int, page_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int,
                 window_steps: int = 1):
        c = params.cfg
        self.params = params
        self.num_pages, self.page_size = num_pages, page_size
        self.max_num_seqs, self.max_pages_per_seq = max_num_seqs, max_pages_per_seq
        self.buckets = token_buckets(max_num_batched_tokens, min(16, max_num_batched_tokens))
        self.window_steps = window_steps
        self.window_buckets = (self.buckets[:self.buckets.index(self.bucket(max_num_seqs)) + 1]
                               if window_steps > 1 else ())
        self.pools = tuple(jnp.zeros(shape, as_dtype(c.dtype))
                           for shape in pool_shapes(c, params.n_layers, num_pages, page_size))
        self.last = jnp.zeros(max_num_seqs, jnp.int32)  # the latest step's samples
        self.weights, form = step_weights(params)
        self._jit = jax.jit(functools.partial(_step, form), donate_argnums=(1,),
                            static_argnums=(4, 5))
        self._jit_window = jax.jit(functools.partial(_window, form), donate_argnums=(1,),
                                   static_argnums=(4, 5, 6))
        self._compiled: dict[tuple[str, int, bool], object] = {}
        self._empty: dict[int, StepBatch] = {}  # the padding batch of each bucket

    def programs(self) -> dict:
        """The compiled programs so far, {(kind "step" | "window", bucket, sampled): the
        compiled executable} (its memory_analysis(), cost_analysis(), ...)."""
        return dict(self._compiled)

    @property
    def pool_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def bucket(self, n_tokens: int) -> int:
        for t in self.buckets:
            if n_tokens <= t:
                return t
        raise ValueError(f"{n_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def empty_batch(self, t: int) -> StepBatch:
        """A batch of `t` padding tokens and no sequences (a step that changes nothing), its
        own buffer to fill in (one copy of the bucket's padding batch)."""
        empty = self._empty.get(t)
        if empty is None:
            n, w = min(t, self.max_num_seqs), self.max_pages_per_seq
            fields = dict(
                tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
                slots=np.full(t, self.num_pages * self.page_size, np.int32),
                from_previous=np.full(t, -1, np.int32),
                block_tables=np.full((n, w), self.num_pages, np.int32),
                kv_lens=np.zeros(n, np.int32), q_starts=np.zeros(n + 1, np.int32),
                sample_at=np.zeros(n, np.int32), temperature=np.zeros(n, np.float32),
                top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
                seed=np.zeros((n, 2), np.uint32), draw=np.zeros(n, np.int32),
                banned=np.full((n, MAX_BANNED), self.params.cfg.vocab_size, np.int32),
                ban_steps=np.zeros(n, np.int32), window=np.zeros(n, np.int32))
            buf = np.concatenate([fields[k].view(np.int32).reshape(-1) for k in _ARRAYS])
            empty = self._empty[t] = unpack(buf, StepBatch(**fields).layout())
        return unpack(empty.buffer.copy(), empty.layout())

    def _compile(self, key: tuple[str, int, bool]):
        kind, t, sampled = key
        batch = self.empty_batch(t)
        buf = jax.ShapeDtypeStruct(batch.pack().shape, jnp.int32)
        args = (self.weights, self.pools, self.last, buf, batch.layout(), sampled)
        lowered = (self._jit_window.lower(*args, self.window_steps) if kind == "window"
                   else self._jit.lower(*args))
        gpu = jax.default_backend() == "gpu"
        return lowered.compile(compiler_options=GPU_COMPILER_OPTIONS if gpu else None)

    def warm_up(self, threads: int | None = None) -> None:
        """Compile the step for every token bucket and the window for every bucket of at most
        N rows, each greedy and sampling (`threads` at once: default one a core, at most 8),
        then run each once."""
        keys = [(kind, t, sampled) for sampled in (False, True)
                for kind, buckets in (("step", self.buckets), ("window", self.window_buckets))
                for t in buckets]
        threads = min(8, os.cpu_count() or 1) if threads is None else threads
        with ThreadPoolExecutor(max(1, threads)) as pool:
            self._compiled.update(zip(keys, pool.map(self._compile, keys)))
        for kind, t, sampled in keys:  # first runs (allocations, autotuning) before timing
            (self.run_window if kind == "window" else self.run)(self.empty_batch(t), sampled)
        jax.block_until_ready(self.last)

    def _fn(self, kind: str, batch: StepBatch, sampled: bool | None):
        """The compiled program for the batch: its bucket, and greedy unless a row samples."""
        if sampled is None:
            sampled = bool(batch.temperature.any())
        key = (kind, batch.tokens.shape[0], sampled)
        fn = self._compiled.get(key)
        if fn is None:  # not warmed up (tests): compile on first use
            fn = self._compiled[key] = self._compile(key)
        return fn

    def run(self, batch: StepBatch, sampled: bool | None = None) -> jax.Array:
        """Dispatch one step (it runs after the steps before it); returns the sampled token
        of every sequence slot, int32 [max_num_seqs] on the device (the step's N first),
        also kept as `last`. `sampled`:
        whether to compile in sampling (default: whether a row has temperature > 0)."""
        fn = self._fn("step", batch, sampled)
        # the compiled step takes the dynamic arguments only (the layout is baked in)
        self.pools, self.last = fn(self.weights, self.pools, self.last, batch.pack())
        return self.last

    def run_window(self, batch: StepBatch, sampled: bool | None = None) -> jax.Array:
        """Dispatch a decode window (every sequence one token row, `batch.window` its steps);
        returns the samples int32 [window_steps, N] on the device; `last` holds each
        sequence's last one."""
        fn = self._fn("window", batch, sampled)
        self.pools, samples, self.last = fn(self.weights, self.pools, self.last,
                                            batch.pack())
        return samples
