"""Expert parallelism: the routed experts split over the `ep` mesh axis, tokens sent to them.

With ep devices in an expert group, device i holds experts [i E/ep, (i+1) E/ep) of every
MoE layer (the `experts` logical axis is on `ep`) and its share of the tokens (the flat
tokens of a layer are split over dp, fsdp, ep and cp). One MoE layer, inside `shard_map`:

    dispatch  each device sorts its T x top_k assignments by expert (hence by device) and
              sends every device the tokens routed to its experts (all-to-all over ep)
    compute   the received rows, sorted by local expert, through the local experts
              (`expert_mlp`: grouped matmuls, `kernels.grouped_matmul`)
    combine   the outputs go back the way they came (all-to-all) and each token sums its
              top_k outputs with the router's weights, as `model.moe.expert_ffn` does

Dropless: nothing is capped. A device may receive every assignment of its group (all
tokens routed to its experts), so its receive buffer holds ep x T_local x top_k rows.
Rows arrive in that buffer at a fixed place per source (source s at s x T_local x top_k),
the same for both exchanges, which therefore give identical results:

  ragged  `jax.lax.ragged_all_to_all`: only the routed rows travel (GPU, TPU)
  padded  `jax.lax.all_to_all` of a fixed T_local x top_k rows per peer, the unused rows
          zeros (the CPU, which has no ragged all-to-all)

With tp > 1 the expert width is split over tp as the dense MLP's is (gate and up by
columns, down by rows): every tp rank runs the same exchange on its part of the width and
the combined outputs are summed over tp. Parameters sharded by FSDP / ZeRO are gathered
on the way into `shard_map`. Gradients come from differentiating through it: the
transposes of the all-to-alls are the reverse exchanges.

With ep = 1 every device holds every expert and runs `model.moe.expert_ffn` on its own
tokens, inside the same kind of `shard_map` (GSPMD cannot split the sort of a sharded
token axis: left to it, each device would gather and compute every device's tokens).

For a dense model `ep` is another data-parallel axis (batch rows are split over it).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxllm.config import ConfigError
from jaxllm.kernels import grouped_matmul
from jaxllm.sharding.constrain import current

TOKEN_AXES = ("dp", "fsdp", "ep", "cp")  # the mesh axes a layer's flat tokens are split over
EXCHANGES = ("ragged", "padded")


def check_experts(num_experts: int | None, ep: int):
    """ConfigError unless ep divides the experts of an MoE model (None: a dense model,
    for which ep is a data-parallel axis)."""
    if num_experts is not None and num_experts % ep:
        raise ConfigError(f"model.moe.num_experts={num_experts} is not divisible by "
                          f"parallelism.ep={ep}; choose an ep that divides the experts")


def expert_ffn(x, ids, weights, gate, up, down, *, local, impl: str = "auto",
               exchange: str | None = None):
    """Each token through its experts: x [T, d], ids int [T, k], weights [T, k], gate / up
    [E, d, f], down [E, f, d] -> [T, d] in x's dtype.

    `local` (model.moe.expert_ffn, every expert on one device) runs alone outside a
    sharding context; on a mesh with ep == 1 it runs on each device's tokens (inside
    `shard_map`: sorting the assignments is no op GSPMD can split, so it would gather
    every device's tokens and run them all on each); with ep > 1 the all-to-all form.
    `exchange`: "ragged" or "padded" (default: padded on the CPU, ragged elsewhere).
    """
    ctx = current()
    if ctx is None:
        return local(x, ids, weights, gate, up, down, impl=impl)
    mesh = ctx.current_mesh()  # inside the pipeline's shard_map: pp is manual there
    ep, tp = mesh.shape["ep"], mesh.shape["tp"]
    e, f = gate.shape[0], gate.shape[2]
    check_experts(e, ep)
    if exchange is None:
        exchange = "padded" if ctx.mesh.devices.flat[0].platform == "cpu" else "ragged"
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} is unknown; one of {EXCHANGES}")
    tokens = tuple(a for a in TOKEN_AXES if mesh.shape[a] > 1)
    n_shards = math.prod(mesh.shape[a] for a in tokens)
    if x.shape[0] % n_shards:
        raise ValueError(f"{x.shape[0]} tokens are not divisible by the {n_shards} token "
                         f"shards of {tokens}; make batch x seq a multiple of it")
    width = "tp" if tp > 1 and f % tp == 0 else None  # else every tp rank runs all of f
    if not tokens and width is None:  # one device's work: nothing to split
        return local(x, ids, weights, gate, up, down, impl=impl)
    rows, owner = P(tokens, None), "ep" if ep > 1 else None  # owner: the experts' axis
    if ep == 1:
        body = functools.partial(_replicated_experts, local=local, impl=impl, width_axis=width)
    else:
        body = functools.partial(_local_experts, ep=ep, impl=impl,
                                 ragged=exchange == "ragged", width_axis=width)
    free = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)  # pp in the pipeline
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(rows, rows, rows, P(owner, None, width),
                                   P(owner, None, width), P(owner, width, None)),
                         out_specs=rows, axis_names=free)(x, ids, weights, gate, up, down)


def expert_mlp(xs, gate, up, down, sizes, *, impl: str = "auto"):
    """The SwiGLU experts over rows sorted by expert: xs [R, d] (expert e owns sizes[e] rows
    after those of experts < e), gate / up [E, d, f], down [E, f, d] (cast to xs's dtype)
    -> [R, d] in xs's dtype, one grouped matmul per projection."""
    dt = xs.dtype
    h = (jax.nn.silu(grouped_matmul(xs, gate.astype(dt), sizes, impl=impl))
         * grouped_matmul(xs, up.astype(dt), sizes, impl=impl))  # [R, f]
    return grouped_matmul(h, down.astype(dt), sizes, impl=impl)


def _replicated_experts(x, ids, weights, gate, up, down, *, local, impl, width_axis):
    """ep == 1, one device: its tokens through every expert (its part of their width)."""
    y = local(x, ids, weights, gate, up, down, impl=impl)
    if width_axis is not None:  # each tp rank has its part of the width: sum them
        y = lax.psum(y.astype(jnp.float32), width_axis).astype(x.dtype)
    return y


def _inverse(perm):
    """The inverse of a permutation: where each element of arange went."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def _local_experts(x, ids, weights, gate, up, down, *, ep, impl, ragged, width_axis):
    """One device: x [t, d], ids / weights [t, k] its tokens; gate / up [El, d, f'],
    down [El, f', d] its experts (f' = f / tp when the width is split)."""
    t, k = ids.shape
    n, el = ep, gate.shape[0]
    m = t * k  # assignments per device: the rows per source of a receive buffer
    i = lax.axis_index("ep")
    dt = x.dtype

    flat = ids.reshape(-1)  # [m]
    order = jnp.argsort(flat, stable=True)  # assignments by expert, hence by device
    rank = _inverse(order)  # each assignment's place in that order
    xs = jnp.take(x, order // k, axis=0)  # [m, d], the sorted assignments' tokens
    # counts[s, e]: assignments of source s to expert e, for every device of the group
    counts = lax.all_gather(jnp.bincount(flat, length=n * el).astype(jnp.int32), "ep")
    pairs = counts.reshape(n, n, el).sum(-1)  # [source, destination] rows
    starts = jnp.cumsum(pairs, axis=1) - pairs  # where each destination's rows begin
    sent, got = pairs[i], pairs[:, i]  # rows to each destination, from each source

    recv = _dispatch(xs, sent, starts[i], got, ragged=ragged)  # [n, m, d]
    # Source s's rows arrive sorted by expert: row p of its block is local expert
    # #{e : ends[s, e] <= p}, el for the unused rows past its count.
    mine = lax.dynamic_slice_in_dim(counts, i * el, el, axis=1)  # [n, el]
    ends = jnp.cumsum(mine, axis=1)
    slot = jnp.arange(m)
    local = (slot[None, :, None] >= ends[:, None, :]).sum(-1).reshape(-1)  # [n m]
    by_expert = jnp.argsort(local, stable=True)  # unused rows last: no group computes them
    sizes = mine.sum(0)  # [el]
    r = jnp.take(recv.reshape(n * m, -1), by_expert, axis=0)
    out = expert_mlp(r, gate, up, down, sizes, impl=impl)  # [n m, d]
    out = jnp.take(out, _inverse(by_expert), axis=0).reshape(n, m, -1)

    ys = _combine(out, sent, starts[:, i], got, ragged=ragged)  # [m, d], sorted order
    ys = jnp.take(ys, rank, axis=0).reshape(t, k, -1)  # back to (token, slot)
    y = jnp.einsum("tkd,tk->td", ys.astype(jnp.float32), weights)
    if width_axis is not None:  # each tp rank has its part of the width: sum them
        y = lax.psum(y, width_axis)
    return y.astype(dt)


def _dispatch(xs, sent, start, got, *, ragged):
    """xs [m, d] sorted by destination (`sent[j]` rows to device j from row `start[j]`)
    -> the receive buffer [n, m, d]: block s holds the `got[s]` rows of source s, zeros
    after them."""
    n, (m, d) = sent.shape[0], xs.shape
    if ragged:
        i = lax.axis_index("ep")
        buf = lax.ragged_all_to_all(xs, jnp.zeros((n * m, d), xs.dtype), start, sent,
                                    jnp.full((n,), i * m, jnp.int32), got, axis_name="ep")
        return buf.reshape(n, m, d)
    slot = jnp.arange(m)
    src = jnp.minimum(start[:, None] + slot, m - 1)  # [n, m]
    buf = jnp.where((slot < sent[:, None])[..., None], jnp.take(xs, src, axis=0), 0)
    return lax.all_to_all(buf, "ep", 0, 0, tiled=True)


def _combine(out, sent, offsets, got, *, ragged):
    """The reverse of `_dispatch`: out [n, m, d] (block s: results for source s's `got[s]`
    rows) -> this device's results [m, d] in its sorted order. `offsets[s]`: where this
    device's rows began in source s's sorted order."""
    n, m, d = out.shape
    if ragged:
        return lax.ragged_all_to_all(out.reshape(n * m, d), jnp.zeros((m, d), out.dtype),
                                     jnp.arange(n, dtype=jnp.int32) * m, got, offsets, sent,
                                     axis_name="ep")
    back = lax.all_to_all(out, "ep", 0, 0, tiled=True)  # block j: results from device j
    start = jnp.cumsum(sent) - sent
    q = jnp.arange(m)
    dest = jnp.searchsorted(jnp.cumsum(sent), q, side="right")  # each sorted row's device
    return jnp.take(back.reshape(n * m, d), dest * m + q - start[dest], axis=0)
