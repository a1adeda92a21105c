"""Context parallelism: the sequence split over the `cp` mesh axis, attention by ring or all-gather.

With cp devices, each holds S/cp positions of every sequence; every layer but attention
is position-wise and needs no communication. Attention of the local queries over all
keys runs block by block inside `shard_map`, each block through the flash kernel's
`flash_attention_with_lse`, and the partial results are merged by their log-sum-exps:

    lse = logaddexp(lse_1, lse_2),   o = o_1 exp(lse_1 - lse) + o_2 exp(lse_2 - lse)

  ring       K/V blocks travel around the cp ring (`ppermute`), one neighbour hop per
             step, overlapping with the block computation; memory holds one remote block.
  allgather  K/V of the whole sequence are gathered once (`all_gather`) and the same block
             schedule runs over slices of it; one collective, better for few KV heads.

Load balance. A causal mask makes late queries see more keys. The decoder puts the
sequence in a balanced order before its blocks (`balance`) and back after (`unbalance`):
cut into 2·cp chunks, device i holds chunks i and 2·cp-1-i, so every device does the
same work: at each ring step exactly two of its four chunk pairs are visible.
Attention called outside that region (natural order: device i holds chunk i) is also
correct, just unbalanced.

Gradients come from differentiating through `shard_map`, `ppermute` (its transpose is
the reverse hop) and the kernels' own VJPs; the backward keeps each step's K/V block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxllm.config import ConfigError
from jaxllm.kernels import flash_attention, pick
from jaxllm.sharding.constrain import constrain, current


def attention_with_lse(impl: str, *inputs):
    """The `flash_attention_with_lse` of `impl` ("auto": the registry's choice among those
    that return the log-sum-exp, for `inputs` q, k, v when given)."""
    try:
        return pick("flash", impl, *inputs, need_lse=True).fn_with_lse
    except ValueError as e:
        raise ConfigError(f"context parallelism needs an attention impl that returns the "
                          f"log-sum-exp; model.attention_impl={impl!r}: {e}") from None


# ------------------------------------------------------------------ sequence order


def _cp_size() -> int:
    ctx = current()
    return 1 if ctx is None else ctx.mesh.shape["cp"]


def balanced_order(seq_len: int, cp: int) -> jax.Array:
    """Position held at each slot of the balanced order (device i: chunks i, 2cp-1-i)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 x cp = {2 * cp} "
                         f"for load-balanced context parallelism; change train.seq_len")
    c = seq_len // (2 * cp)
    chunks = [j for i in range(cp) for j in (i, 2 * cp - 1 - i)]
    return jnp.concatenate([jnp.arange(j * c, (j + 1) * c) for j in chunks])


def balance(x, positions):
    """x (B, S, d), positions (B, S) -> both in the balanced order; no-op unless cp > 1."""
    cp = _cp_size()
    if cp == 1:
        return x, positions
    order = balanced_order(x.shape[1], cp)
    current().balanced = True
    x = constrain(jnp.take(x, order, axis=1), ("batch", "seq", "embed"))
    return x, constrain(jnp.take(positions, order, axis=1), ("batch", "seq"))


def unbalance(h):
    """h (B, S, d) from the balanced order back to sequence order; no-op unless cp > 1."""
    cp = _cp_size()
    if cp == 1:
        return h
    inverse = jnp.argsort(balanced_order(h.shape[1], cp))
    current().balanced = False
    return constrain(jnp.take(h, inverse, axis=1), ("batch", "seq", "embed"))


# ------------------------------------------------------------------ attention


def causal_attention(q, k, v, *, impl: str = "auto"):
    """Causal self-attention over the whole sequence, q [B, S, Hq, D], k/v [B, S, Hkv, D].

    Without a sharding context: `kernels.flash_attention`. With one, the kernel runs
    per device inside `shard_map` on the local rows and heads (a Pallas kernel has no
    partitioning rule: left to GSPMD, its inputs would be gathered whole), and with
    cp > 1 as ring or all-gather attention over the sequence shards.
    """
    ctx = current()
    if ctx is None or ctx.mesh.size == 1:
        return flash_attention(q, k, v, causal=True, impl=impl)
    mesh, cp, tp = ctx.current_mesh(), ctx.mesh.shape["cp"], ctx.mesh.shape["tp"]
    hq, hkv = q.shape[2], k.shape[2]
    heads = "tp" if tp > 1 and hq % tp == 0 else None
    if heads and hkv % tp:  # too few KV heads to split: give each query head its own
        k, v = (jnp.repeat(x, hq // hkv, axis=2) for x in (k, v))
    batch = ctx.rules.activation_spec(("batch",), q.shape[:1])[0]
    spec = P(batch, "cp" if cp > 1 else None, heads, None)
    if cp == 1:
        body = functools.partial(flash_attention, causal=True, impl=impl)
    else:
        body = functools.partial(_local_attention, cp=cp, balanced=ctx.balanced,
                                 gather=ctx.cp_impl == "allgather",
                                 attn=attention_with_lse(impl, q, k, v))
    free = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)  # pp in the pipeline
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         axis_names=free, check_vma=False)(q, k, v)


def _merge(acc, new):
    """Merge two partial attentions (o f32 [b, s, h, d], lse [b, h, s]) by log-sum-exp."""
    (o1, lse1), (o2, lse2) = acc, new
    lse = jnp.logaddexp(lse1, lse2)
    w1 = jnp.exp(lse1 - lse).transpose(0, 2, 1)[..., None]  # (b, s, h, 1)
    w2 = jnp.exp(lse2 - lse).transpose(0, 2, 1)[..., None]
    return o1 * w1 + o2.astype(jnp.float32) * w2, lse


def _local_attention(q, k, v, *, cp, balanced, gather, attn):
    """One device's queries over every device's keys. q [b, L, h, d], L = S / cp."""
    i = lax.axis_index("cp")

    def full(qc, kc, vc):
        o, lse = attn(qc, kc, vc, causal=False)
        return o.astype(jnp.float32), lse

    def causal(qc, kc, vc):  # bottom-right aligned: qc are the last len(qc) of kc's positions
        o, lse = attn(qc, kc, vc, causal=True)
        return o.astype(jnp.float32), lse

    n = 2 if balanced else 1
    qs = jnp.split(q, n, axis=1)
    # Step 0: the device's own keys. Its chunks are in sequence order, so chunk a sees
    # all of the earlier own chunks and itself causally: one bottom-right causal call.
    acc = [causal(qs[a], k[:, :(a + 1) * q.shape[1] // n], v[:, :(a + 1) * q.shape[1] // n])
           for a in range(n)]

    if gather:
        k_all = lax.all_gather(k, "cp", axis=1, tiled=True)  # (b, S, h, d), device-major
        v_all = lax.all_gather(v, "cp", axis=1, tiled=True)
    kt, vt = k, v
    for t in range(1, cp):
        j = (i - t) % cp  # the device whose keys this step sees
        if gather:
            kt = lax.dynamic_slice_in_dim(k_all, j * k.shape[1], k.shape[1], axis=1)
            vt = lax.dynamic_slice_in_dim(v_all, j * v.shape[1], v.shape[1], axis=1)
        else:
            hop = [(s, (s + 1) % cp) for s in range(cp)]
            kt, vt = lax.ppermute(kt, "cp", hop), lax.ppermute(vt, "cp", hop)
        if balanced:
            # Own chunks (i, 2cp-1-i), remote chunks (j, 2cp-1-j), j != i: the late query
            # chunk sees the remote early chunk always; the early query chunk sees the
            # remote early chunk iff j < i; the late sees the remote late iff j > i.
            (ke, kl), (ve, vl) = jnp.split(kt, 2, axis=1), jnp.split(vt, 2, axis=1)
            acc[1] = _merge(acc[1], full(qs[1], ke, ve))
            acc = lax.cond(j < i,
                           lambda acc: [_merge(acc[0], full(qs[0], ke, ve)), acc[1]],
                           lambda acc: [acc[0], _merge(acc[1], full(qs[1], kl, vl))],
                           acc)
        else:
            acc = lax.cond(j < i, lambda acc: [_merge(acc[0], full(qs[0], kt, vt))],
                           lambda acc: acc, acc)
    return jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
