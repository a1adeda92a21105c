"""Mixture-of-experts feed-forward blocks (DeepSeek-V3, Qwen3-MoE, Mixtral), training form.

    router logits [T, E] -> route(): the top_k experts of each token and their weights
    expert_ffn(): each token through its experts (dropless: every assignment computed)
    + a dense SwiGLU of the shared experts, which every token takes

`expert_ffn` is the dispatch-compute-combine step on one device: the T x top_k
assignments sorted by expert, the tokens gathered in that order, the experts' SwiGLUs as
grouped matmuls (`sharding.experts.expert_mlp` over `kernels.grouped_matmul`: expert e
multiplies its rows only), and the outputs
gathered back to their tokens and summed with the router's weights. Expert parallelism
replaces this one function by an all-to-all form; routing and balancing stay as they are.

Balancing (model.moe.balance): "aux_loss" adds the Switch Transformer's loss
E * sum_e f_e P_e (f_e: fraction of assignments to expert e, P_e: its mean router
probability; 1 when balanced) to the objective. "bias" is DeepSeek-V3's auxiliary-loss-free
balancing: an `ExpertBias` per layer and expert, added to the scores when choosing the top
k (never in the weights), moved after every step by rate x sign(mean load - load) by
`update_expert_bias`; it is no parameter of the optimizer. Every MoE block returns its
`stats` (per-expert load, aux loss, router entropy) for both.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import MoEConfig
from jaxllm.model.layers import MLP, param
from jaxllm.sharding import experts

BIAS_KEY = "expert_bias"  # the bias's name in a parameter tree


class ExpertBias(nnx.Variable):
    """The per-expert selection bias of "bias" balancing: state set by the training loop
    (update_expert_bias), not an optimized parameter."""


def route(logits, bias, cfg: MoEConfig):
    """Top-k routing. logits float32 [T, E]; bias [E] or None (selection only).

    Returns (ids int32 [T, k], weights float32 [T, k], probs float32 [T, E]): the experts
    of each token, their weights (the unbiased scores of the chosen experts, renormalised
    with norm_topk_prob, times routed_scaling) and the router's probabilities (scores
    normalised over the experts) for the balancing statistics.
    """
    t, e = logits.shape
    scores = (jax.nn.softmax(logits, axis=-1) if cfg.router == "softmax"
              else jax.nn.sigmoid(logits))
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if cfg.n_groups > 1:  # keep the topk_groups groups of highest top-2 sums
        grouped = choice.reshape(t, cfg.n_groups, e // cfg.n_groups)
        top2 = jax.lax.top_k(grouped, min(2, e // cfg.n_groups))[0].sum(-1)  # [T, G]
        kept = jax.lax.top_k(top2, cfg.topk_groups)[1]  # [T, topk_groups]
        mask = jnp.zeros((t, cfg.n_groups), bool).at[jnp.arange(t)[:, None], kept].set(True)
        choice = jnp.where(mask[:, :, None], grouped, -jnp.inf).reshape(t, e)
    ids = jax.lax.top_k(choice, cfg.top_k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    probs = scores if cfg.router == "softmax" else scores / scores.sum(-1, keepdims=True)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling, probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, order, inv, k: int):
    """x [T, d] -> [T k, d]: row r is the token of assignment order[r]. Its gradient is a
    gather too (row t sums its k rows, found through the inverse permutation `inv`), not
    the scatter-add XLA would make of the gather's transpose."""
    return jnp.take(x, order // k, axis=0)


def _dispatch_fwd(x, order, inv, k):
    return _dispatch(x, order, inv, k), (order, inv)


def _dispatch_bwd(k, res, g):
    order, inv = res
    rows = jnp.take(g, inv, axis=0).astype(jnp.float32)  # [T k, d] in (token, slot) order
    return rows.reshape(-1, k, g.shape[-1]).sum(1).astype(g.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _permute(x, perm, inv):
    """x[perm] for a permutation `perm` with inverse `inv`; the gradient is g[inv]."""
    return jnp.take(x, perm, axis=0)


_permute.defvjp(lambda x, perm, inv: (_permute(x, perm, inv), (perm, inv)),
                lambda res, g: (jnp.take(g, res[1], axis=0), None, None))


def expert_ffn(x, ids, weights, gate, up, down, *, impl: str = "auto"):
    """Each token through its experts, dropless. x [T, d]; ids int [T, k]; weights [T, k];
    gate, up [E, d, f] and down [E, f, d], the stacked SwiGLU experts -> [T, d] in x's dtype,
    sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # [T k]
    order = jnp.argsort(flat, stable=True)  # assignments sorted by expert
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)  # rows per expert
    inv = jnp.argsort(order)  # the row of each assignment
    xs = _dispatch(x, order, inv, k)  # [T k, d], each assignment's token
    ys = experts.expert_mlp(xs, gate, up, down, sizes, impl=impl)  # [T k, d]
    ys = _permute(ys, inv, order).reshape(t, k, -1)  # back to (token, slot)
    return jnp.einsum("tkd,tk->td", ys.astype(jnp.float32), weights).astype(x.dtype)


def routing_stats(ids, probs, num_experts: int) -> dict:
    """Balancing statistics of one layer's routing: `load` [E] (each expert's fraction of
    the assignments), `prob` [E] (each expert's mean router probability), `aux_loss`
    (Switch: E * sum_e load_e * prob_e) and `entropy` (the router's mean entropy in nats).
    All but `aux_loss` are means over the tokens, so the means of equal-sized parts'
    figures are the whole's (the pipeline's microbatches); `switch_loss` recomputes
    `aux_loss` from them."""
    load = jnp.bincount(ids.reshape(-1), length=num_experts) / ids.size
    prob = probs.mean(0)
    entropy = -jnp.sum(probs * jnp.log(probs + 1e-20), axis=-1).mean()
    return {"load": load, "prob": prob, "aux_loss": switch_loss(load, prob), "entropy": entropy}


def switch_loss(load, prob):
    """The Switch Transformer's balancing loss E * sum_e load_e * prob_e over [..., E]."""
    return load.shape[-1] * jnp.sum(load * prob, axis=-1)


class MoE(nnx.Module):
    """The MoE feed-forward block: x (B, S, d) -> ((B, S, d), stats of routing_stats)."""

    def __init__(self, d_model: int, cfg: MoEConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
                 std: float, out_std: float):
        e, f = cfg.num_experts, cfg.expert_mlp_dim
        self.router = param(rngs, (d_model, e), ("embed", None), param_dtype, std=std)
        self.expert_bias = (ExpertBias(jnp.zeros((e,), jnp.float32), out_sharding=(None,),
                                       eager_sharding=False)
                            if cfg.balance == "bias" else None)
        self.gate = param(rngs, (e, d_model, f), ("experts", "embed", "mlp"), param_dtype, std=std)
        self.up = param(rngs, (e, d_model, f), ("experts", "embed", "mlp"), param_dtype, std=std)
        self.down = param(rngs, (e, f, d_model), ("experts", "mlp", "embed"), param_dtype,
                          std=out_std)
        self.shared = (MLP(d_model, cfg.num_shared_experts * f, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs, std=std, out_std=out_std)
                       if cfg.num_shared_experts else None)
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, x):
        b, s, d = x.shape
        x2 = x.reshape(b * s, d).astype(self.dtype)  # (T, d)
        logits = jnp.dot(x2, self.router[...].astype(self.dtype),
                         preferred_element_type=jnp.float32)  # (T, E)
        bias = None if self.expert_bias is None else self.expert_bias[...]
        ids, weights, probs = route(logits, bias, self.cfg)
        y = experts.expert_ffn(x2, ids, weights, self.gate[...], self.up[...], self.down[...],
                               local=expert_ffn, impl=self.cfg.gmm_impl)  # ep > 1: all-to-all
        y = y.reshape(b, s, d)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, routing_stats(ids, probs, self.cfg.num_experts)


def update_expert_bias(params, before, load, rate: float):
    """DeepSeek-V3's bias update after a step: `params` (the step's result) with every
    `expert_bias` leaf set to its value in `before` (the step's input, so nothing the
    optimizer did to it counts) + rate * sign(mean load - load). `load` [L + D, E] is the
    step's: rows 0..L-1 the main stack's MoE layers (its bias [L, E]), row L + k the block
    of MTP module k (its bias [E], at mtp/layers/k/block/mlp)."""
    step = rate * jnp.sign(load.mean(-1, keepdims=True) - load)
    n = before["blocks"]["mlp"][BIAS_KEY].shape[0]

    def one(path, w, w0):
        keys = [getattr(p, "key", None) for p in path]
        if keys[-1] != BIAS_KEY:
            return w
        rows = step[n + keys[2]] if keys[0] == "mtp" else step[:n]
        return (w0 + rows).astype(w0.dtype)

    return jax.tree_util.tree_map_with_path(one, params, before)


def load_max_over_mean(load, per_layer: bool = False):
    """Max over the experts of the expert load divided by its mean: 1 when balanced, E when
    one expert takes every assignment. `load` [..., E] holds each expert's token count (or
    fraction; only the ratios matter), per layer on the leading axes. Returns the figure
    of each layer ([...]) with per_layer, else of the worst layer (a scalar)."""
    load = jnp.asarray(load, jnp.float32)
    ratio = load.max(-1) / load.mean(-1)
    return ratio if per_layer else ratio.max()


def moe_metrics(stats: dict) -> dict:
    """Scalars to log from the stacked stats of the MoE layers (each [L, ...]): the max
    over layers of max/mean expert load, the mean router entropy and aux loss."""
    return {"moe_load_max": load_max_over_mean(stats["load"]),
            "moe_entropy": stats["entropy"].mean(), "moe_aux_loss": stats["aux_loss"].mean()}


def balance_aux(objective, stats: dict, cfg: MoEConfig) -> tuple:
    """(objective, aux entries) with the stacked stats of the MoE layers: the logged
    `moe_metrics`, `expert_load` [L, E] (for `update_expert_bias`), and, with
    balance "aux_loss", aux_loss_weight x their mean aux loss added to the objective."""
    aux = {**moe_metrics(stats), "expert_load": stats["load"]}
    if cfg.balance == "aux_loss":
        objective = objective + cfg.aux_loss_weight * aux["moe_aux_loss"]
    return objective, aux
