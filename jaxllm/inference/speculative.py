"""Speculative decoding that keeps the target model's distribution exactly.

Each step a drafter proposes k tokens d_1..d_k, drawn from its distributions q_1..q_k;
the target scores [t, d_1..d_k] in one forward (t: the pending token) and `verify` keeps
a prefix of the drafts plus one token of its own, so every step emits 1..k+1 tokens for
one target forward. The rule (Leviathan et al. 2023; Chen et al. 2023) makes each emitted
token an exact sample of the target's distribution p, whatever q is.

Two drafters:
- "draft": a small model with the same vocabulary and its own KV cache (k steps);
- "mtp":   the target's multi-token-prediction modules (model/mtp.py): module i, fed the
  target's hidden state at the last accepted position and the tokens after it, drafts
  token i; one chain of k <= mtp_depth modules per step, no extra target forward.

Everything runs on the device in one `lax.while_loop`; rows accept different numbers of
drafts and carry their own position. K/V are written by position, so the entries of
rejected drafts are simply overwritten by the next step: no rollback.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.inference.cache import ContiguousCache
from jaxllm.inference.params import DecodeParams, decode_params
from jaxllm.inference.sampling import probabilities, sample
from jaxllm.inference.step import (eos_ids, forward, head_logits, init_cache, is_eos,
                                   mtp_forward, pad_prompts, rms_norm, round_up)
from jaxllm.model.mtp import shift_left


def verify(draft_tokens, draft_probs, target_probs, key):
    """The acceptance rule. draft_tokens (B, k) drawn from draft_probs (B, k, V);
    target_probs (B, k+1, V): the target's p at the k draft positions and one past them.

    Returns (tokens (B, k+1): the emitted tokens then -1, n_emitted (B,) in 1..k+1).
    """
    b, k = draft_tokens.shape
    k_accept, k_resample = jax.random.split(key)
    # Draft i is accepted with probability min(1, p(x)/q(x)): u < p/q, i.e. u q < p.
    # Greedy (one-hot p and q) accepts exactly the drafts that are the target's argmax.
    p_x = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], -1)[..., 0]
    q_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    accepted = jax.random.uniform(k_accept, (b, k)) * q_x < p_x
    n_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1)  # leading accepts, 0..k
    # At the first rejection j the next token is drawn from normalise(max(0, p_j - q_j)):
    # together with the accepts this gives exactly p_j. If all k are accepted, the bonus
    # token comes from p_{k+1} (q is zero-padded there, so the same formula gives p).
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    residual = jnp.maximum(target_probs - q_pad, 0.0)  # (B, k+1, V)
    residual = jnp.take_along_axis(residual, n_accepted[:, None, None], axis=1)[:, 0]
    p_at = jnp.take_along_axis(target_probs, n_accepted[:, None, None], axis=1)[:, 0]
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual, p_at)  # p == q up to rounding: p itself
    last = jax.random.categorical(k_resample, jnp.log(residual), axis=-1).astype(jnp.int32)
    j = jnp.arange(k + 1)[None]
    draft_pad = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)
    tokens = jnp.where(j < n_accepted[:, None], draft_pad,
                       jnp.where(j == n_accepted[:, None], last[:, None], -1))
    return tokens.astype(jnp.int32), n_accepted + 1


# -- drafters -------------------------------------------------------------------------


def draft_with_model(draft, cache, prev, token, pos, key, k, opts):
    """k autoregressive steps of the draft model from the pending `token` at `pos`.

    The first step also re-reads `prev`, the token at pos - 1: when the last step accepted
    every draft, the draft model never saw the last of them. Returns (drafts (B, k),
    their probabilities (B, k, V), cache).
    """
    x, start = jnp.stack([prev, token], axis=1), pos - 1
    drafts, probs = [], []
    for i in range(k):
        logits, cache, _ = forward(draft, x, cache, start)
        key, sub = jax.random.split(key)
        drafts.append(sample(logits[:, -1], sub, **opts))
        probs.append(probabilities(logits[:, -1], **opts))
        x, start = drafts[-1][:, None], pos + i + 1
    return jnp.stack(drafts, 1), jnp.stack(probs, 1), cache


def draft_with_mtp(params, h, next_tokens, last, cache, start, key, k, opts, prefill=False):
    """Chain the first k MTP modules to draft the k tokens after position start + last.

    h (B, W, d): the target's hidden states (before its final norm) at positions
    start..start+W-1; next_tokens (B, W): the token at each position + 1, known up to
    index `last` (B,). Module i runs over the whole window (filling its own cache),
    embedding the token i+1 ahead; at index `last` the tokens ahead are the drafts of
    modules 1..i, so its prediction there is draft i+1. (Positions just before `last` keep
    draft-fed entries in the caches of modules >= 2; they only shape later drafts, never
    what is emitted.)
    """
    b, w = next_tokens.shape
    rows = jnp.arange(b)
    h = rms_norm(h, params.final_norm, params.cfg.norm_eps)  # module 1 reads the head's input
    ext = jnp.concatenate([next_tokens, jnp.zeros((b, k), jnp.int32)], axis=1)  # (B, W+k)
    drafts, probs = [], []
    for i in range(k):
        h, cache = mtp_forward(params, i, h, ext[:, i:i + w], cache, start, prefill=prefill)
        logits = head_logits(params, h[rows, last][:, None])[:, 0]  # (B, V)
        key, sub = jax.random.split(key)
        drafts.append(sample(logits, sub, **opts))
        probs.append(probabilities(logits, **opts))
        ext = ext.at[rows, last + i + 1].set(drafts[-1])
    return jnp.stack(drafts, 1), jnp.stack(probs, 1), cache


# -- the device loop ------------------------------------------------------------------


class SpecState(NamedTuple):
    cache: ContiguousCache  # the target's
    draft_cache: ContiguousCache  # the draft model's, or the MTP modules'
    token: jax.Array  # (B,) pending token at `pos`: sampled, not yet in the caches
    prev: jax.Array  # (B,) the token at pos - 1
    pos: jax.Array  # (B,)
    drafts: jax.Array  # (B, k) MTP drafts for the next step (unused by "draft")
    draft_probs: jax.Array  # (B, k, V)
    out: jax.Array  # (B, max_new + k + 1) emitted ids, -1 past n_out
    n_out: jax.Array  # (B,)
    done: jax.Array  # (B,) bool
    key: jax.Array
    steps: jax.Array  # () verify steps summed over active rows
    accepted: jax.Array  # (k,) accepted drafts per position, summed over steps and rows


_STATIC = ("method", "k", "cache_len", "out_len", "temperature", "top_k", "top_p")


@functools.partial(jax.jit, static_argnames=_STATIC)
def spec_prefill(params, draft, tokens, lengths, key, *, method, k, cache_len, out_len,
                 temperature, top_k, top_p):
    """Prompts (B, P) right-padded, lengths (B,) -> (the loop's initial SpecState, the
    first tokens (B,) as an array of their own, readable while the loop holds the state).
    `draft`: the draft model's DecodeParams (method "draft"), else None."""
    opts = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    b = tokens.shape[0]
    rows, zeros, last = jnp.arange(b), jnp.zeros_like(lengths), lengths - 1
    k_first, k_draft, key = jax.random.split(key, 3)
    logits, cache, h = forward(params, tokens, init_cache(params, b, cache_len), zeros,
                               prefill=True)
    first = sample(logits[rows, last], k_first, **opts)
    if method == "draft":
        _, draft_cache, _ = forward(draft, tokens, init_cache(draft, b, cache_len), zeros,
                                    prefill=True)
        drafts = jnp.zeros((b, k), jnp.int32)
        draft_probs = jnp.zeros((b, k, logits.shape[-1]), jnp.float32)
    else:
        next_tokens = shift_left(tokens, 1).at[rows, last].set(first)
        draft_cache = init_cache(params, b, cache_len, n_layers=k)
        drafts, draft_probs, draft_cache = draft_with_mtp(
            params, h, next_tokens, last, draft_cache, zeros, k_draft, k, opts, prefill=True)
    out = jnp.full((b, out_len), -1, jnp.int32).at[:, 0].set(first)
    state = SpecState(cache, draft_cache, first, tokens[rows, last], lengths, drafts,
                      draft_probs, out, jnp.ones(b, jnp.int32), jnp.zeros(b, bool), key,
                      jnp.int32(0), jnp.zeros(k, jnp.int32))
    return state, first  # a second output buffer: the loop takes the state donated


@functools.partial(jax.jit, static_argnames=_STATIC + ("eos_id",), donate_argnames=("state",))
def spec_loop(params, draft, state, limit, *, method, k, cache_len, out_len, temperature, top_k,
              top_p, eos_id):
    """Speculative steps until every row has `limit` tokens or has emitted EOS (the state
    donated)."""
    opts = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    j = jnp.arange(k + 1)[None]

    def step(s: SpecState) -> SpecState:
        key, k_draft, k_verify = jax.random.split(s.key, 3)
        rows = jnp.arange(s.token.shape[0])
        # 1. Drafts d_1..d_k and the distributions q they were drawn from.
        if method == "draft":
            drafts, q, draft_cache = draft_with_model(draft, s.draft_cache, s.prev, s.token,
                                                      s.pos, k_draft, k, opts)
        else:  # drafted at the end of the previous step
            drafts, q, draft_cache = s.drafts, s.draft_probs, s.draft_cache
        # 2. The target scores [t, d_1..d_k] at pos..pos+k in one forward; verify.
        x = jnp.concatenate([s.token[:, None], drafts], axis=1)  # (B, k+1)
        logits, cache, h = forward(params, x, s.cache, s.pos)
        tokens, n = verify(drafts, q, probabilities(logits, **opts), k_verify)
        # 3. MTP: draft the next step's tokens from the target's hidden states.
        if method == "mtp":
            drafts, q, draft_cache = draft_with_mtp(params, h, jnp.maximum(tokens, 0), n - 1,
                                                    draft_cache, s.pos, k_draft, k, opts)
        # 4. Emit tokens[:, :n] after each active row's n_out tokens.
        active = ~s.done
        n = jnp.where(active, n, 0)
        idx = jnp.where(j < n[:, None], s.n_out[:, None] + j, out_len)  # out_len: dropped
        out = s.out.at[rows[:, None], idx].set(tokens, mode="drop")
        n_out = s.n_out + n
        done = s.done | (n_out >= limit)
        done |= jnp.any(is_eos(tokens, eos_id) & (j < n[:, None]), axis=1)
        last = jnp.maximum(n - 1, 0)
        return SpecState(
            cache, draft_cache,
            token=jnp.where(active, tokens[rows, last], s.token),
            prev=jnp.where(active, x[rows, last], s.prev),  # the token at the new pos - 1
            pos=s.pos + n, drafts=drafts, draft_probs=q, out=out, n_out=n_out, done=done,
            key=key, steps=s.steps + jnp.sum(active),
            accepted=s.accepted + jnp.sum(j[:, :k] < (n - 1)[:, None], axis=0))

    state = state._replace(done=state.done | (state.n_out >= limit)
                           | is_eos(state.token, eos_id))
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)


def resolve_draft(cfg, draft_model=None) -> DecodeParams | None:
    """The draft model's DecodeParams for `cfg`'s inference.speculative: `draft_model` when
    given, else the checkpoint at inference.speculative.draft (a run directory, or a config
    whose train.run_dir holds the checkpoints). None unless the method is "draft". The
    vocabularies must match."""
    from jaxllm.checkpoint import load_model
    from jaxllm.config import load_config

    path = cfg.inference.speculative.draft
    if cfg.inference.speculative.method != "draft":
        return None
    if draft_model is None:
        run_dir = path if Path(path).is_dir() else load_config(path).train.run_dir
        draft_model, _, _ = load_model(run_dir)
    if draft_model.cfg.vocab_size != cfg.model.vocab_size:
        raise ValueError(f"the draft model has vocab_size={draft_model.cfg.vocab_size} but the "
                         f"target has {cfg.model.vocab_size}; a draft model must share the "
                         f"target's vocabulary")
    return decode_params(draft_model, cfg.replace(model=draft_model.cfg))


def speculative_generate_ids(params: DecodeParams, prompts: list[list[int]], *, method: str,
                             k: int, draft: DecodeParams | None = None, max_new_tokens: int,
                             temperature: float, top_k: int = 0, top_p: float = 1.0,
                             seed: int = 0, eos_id: int | tuple[int, ...] | None = None,
                             on_tokens: Callable[[np.ndarray], None] | None = None,
                             warmup: bool = True):
    """Speculative decoding with the interface of `generate.generate_ids`.

    method "draft" takes `draft`, the DecodeParams of a model with the same vocabulary;
    "mtp" uses the target's own MTP modules (k <= model.mtp_depth). The whole generation
    is one device loop: `on_tokens` receives all ids at the end. Returns (ids per prompt,
    timings), the timings holding acceptance statistics too.
    """
    if method not in ("draft", "mtp"):
        raise ValueError(f"speculative method={method!r}; choose 'draft' or 'mtp'")
    if k <= 0:
        raise ValueError(f"speculative k={k} must be positive")
    if method == "draft" and draft is None:
        raise ValueError("method='draft' needs draft=, the DecodeParams of a draft model")
    if method == "mtp":
        depth = len(params.mtp)
        if k > depth:
            raise ValueError(f"speculative k={k} exceeds the model's mtp_depth={depth}")
    eos_id = eos_ids(eos_id)
    tokens, lengths = pad_prompts(prompts)
    plen = tokens.shape[1]
    draft = draft if method == "draft" else None
    static = dict(method=method, k=k, cache_len=round_up(plen + max_new_tokens + k + 1, 64),
                  out_len=max_new_tokens + k + 1, temperature=float(temperature),
                  top_k=int(top_k), top_p=float(top_p))
    key = jax.random.key(seed)
    args = (params, draft)

    compile_s = 0.0
    if warmup:  # compile both and run one step (limit 2), as the timed loop will
        t0 = time.perf_counter()
        state, _ = spec_prefill(*args, tokens, lengths, key, **static)
        jax.block_until_ready(spec_loop(*args, state, 2, eos_id=eos_id, **static))
        compile_s = time.perf_counter() - t0

    t_start = time.perf_counter()
    state, first = spec_prefill(*args, tokens, lengths, key, **static)
    # the loop is queued before the host waits for the first token
    state = spec_loop(*args, state, max_new_tokens, eos_id=eos_id, **static)
    first.block_until_ready()
    t_first = time.perf_counter()
    out = np.asarray(state.out)[:, :max_new_tokens]
    t_end = time.perf_counter()

    ids = []
    for row in out.tolist():
        cut = next((i for i, t in enumerate(row) if t < 0 or t in eos_id), len(row))
        ids.append(row[:cut])
    if on_tokens is not None:
        on_tokens(np.where(np.isin(out, eos_id), -1, out))
    n_gen = sum(len(r) for r in ids)
    steps = max(int(state.steps), 1)
    per_position = (np.asarray(state.accepted) / steps).tolist()
    timings = {
        "ttft_s": t_first - t_start,
        "tpot_s": (t_end - t_first) / max(max(len(r) for r in ids) - 1, 1),
        "tokens_per_s": n_gen / (t_end - t_start),
        "decode_steps": int(state.steps),
        "generated_tokens": n_gen,
        "compile_s": compile_s,
        # tokens per target forward (the bonus/correction token included), over active rows
        "mean_acceptance_length": 1.0 + float(np.sum(per_position)),
        "acceptance_rate": float(np.mean(per_position)),  # accepted drafts / drafts
        "acceptance_rate_per_position": per_position,  # P(draft i accepted), i = 1..k
    }
    return ids, timings

