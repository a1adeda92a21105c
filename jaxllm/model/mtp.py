"""Multi-token prediction (MTP) modules, DeepSeek-V3's layout.

`model.mtp_depth = D` sequential modules. Module k (1-based) at position i combines the
previous depth's output h^{k-1}_i with the embedding of token t_{i+k}:

    h^0 = final_norm(main model's last hidden state)          # what the main head reads
    x   = W [rmsnorm(embed(t_{i+k})) ; rmsnorm(h^{k-1}_i)]   # 2d -> d, the embedding first
    h^k = rmsnorm(Block(x))                                   # the module's own final norm
    logits = head(h^k)                                        # the main model's head

so h^k predicts t_{i+k+1}. The block is one causal transformer block of the model's own
kind: its attention (grouped-query or MLA, model.attention) and, in an MoE model, an MoE
feed-forward part like the main stack's (DeepSeek-V3's MTP layer is an MoE layer; its
routing statistics join the main layers' for balancing). The embedding and the output
head are the main model's. This is DeepSeek-V3's MTP layer as its checkpoints store it
(enorm, hnorm, eh_proj over [embedding; hidden], a decoder layer, shared_head.norm), so
hf/deepseek.py maps it one to one. Training adds `train.mtp_weight` x the mean of the D
losses (`mtp_losses`, `mtp_objective`); with pp > 1 the modules run on the last pipeline
stage, beside the head (sharding/pipeline.py). Decoding uses the chain of modules as a
drafter for speculative decoding (inference/speculative.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.block import Block
from jaxllm.model.layers import Linear, RMSNorm, as_dtype


class MTPModule(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype, pdtype = as_dtype(cfg.dtype), as_dtype(cfg.param_dtype)
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.e_norm = RMSNorm(cfg.d_model, **norm)
        self.h_norm = RMSNorm(cfg.d_model, **norm)
        self.proj = Linear((2 * cfg.d_model,), (cfg.d_model,), (None, "embed"), "bsc,cd->bsd",
                           dtype=dtype, param_dtype=pdtype, rngs=rngs, std=cfg.init_std)
        self.block = Block(cfg, rngs=rngs, moe=cfg.moe is not None)
        self.final_norm = RMSNorm(cfg.d_model, **norm)

    def __call__(self, h, e, positions):
        """h (B, S, d) the previous depth's output, e (B, S, d) embeddings of the tokens k
        ahead -> (this depth's output (B, S, d), normed for the head; the block's MoE
        routing statistics, {} if dense)."""
        x = self.proj(jnp.concatenate([self.e_norm(e), self.h_norm(h)], axis=-1))
        x, stats = self.block(x, positions)
        return self.final_norm(x), stats


class MTPHeads(nnx.Module):
    """The D modules, applied in sequence (D is small: a Python loop, no scan)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.layers = nnx.List([MTPModule(cfg, rngs=rngs) for _ in range(cfg.mtp_depth)])

    def __len__(self) -> int:
        return len(self.layers)


def shift_left(x, k: int, fill=0):
    """x (B, S) -> y with y[:, i] = x[:, i + k], `fill` past the end."""
    return jnp.concatenate([x[:, k:], jnp.full((x.shape[0], k), fill, x.dtype)], axis=1)


def mtp_losses(model, h, targets):
    """Per-depth cross-entropy and accuracy of the MTP modules.

    h (B, S, d): the main model's last hidden state (before its final norm) at input
    positions 0..S-1; targets (B, S): targets[:, i] = t_{i+1}. Depth k at position i
    embeds t_{i+k} (= targets[:, i+k-1]) and predicts t_{i+k+1} (= targets[:, i+k]),
    defined for i < S - k; the last k positions are masked. Returns (losses [D],
    accuracies [D], stats): stats are the MTP blocks' MoE routing statistics, each
    stacked [D, ...] as the main stack's are [L, ...] ({} in a dense model).
    """
    b, s = targets.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    h = model.final_norm(h)
    losses, accs, stats = [], [], []
    for k, module in enumerate(model.mtp.layers, start=1):
        h, st = module(h, model.embed(shift_left(targets, k - 1)), positions)
        stats.append(st)
        logits = model.head_logits(h)  # (B, S, V) float32
        tgt = shift_left(targets, k)
        mask = (jnp.arange(s) < s - k)[None, :].astype(jnp.float32)  # (1, S)
        lse = jax.nn.logsumexp(logits, axis=-1)
        # the target's logit by a one-hot select-and-sum, as trainer.cross_entropy: it
        # partitions over a vocab-sharded axis, also inside the pipeline's shard_map
        hit = tgt[..., None] == jnp.arange(logits.shape[-1], dtype=tgt.dtype)
        nll = lse - jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        count = jnp.maximum(mask.sum() * b, 1.0)
        losses.append(jnp.sum(nll * mask) / count)
        accs.append(jnp.sum((jnp.argmax(logits, -1) == tgt) * mask) / count)
    return jnp.stack(losses), jnp.stack(accs), jax.tree.map(lambda *x: jnp.stack(x), *stats)


def mtp_objective(objective, losses, accs, weight: float):
    """(objective + weight x the mean of the D losses, the aux entries mtp1_loss,
    mtp1_acc, ..., mtpD_acc) from `mtp_losses`' losses and accuracies [D]."""
    aux = {}
    for k in range(losses.shape[0]):
        aux[f"mtp{k + 1}_loss"], aux[f"mtp{k + 1}_acc"] = losses[k], accs[k]
    return objective + weight * jnp.mean(losses), aux
