"""Multi-token prediction (MTP) heads, DeepSeek-V3 style.

`model.mtp_depth = D` sequential modules. Module k (1-based) at position i combines the
previous depth's hidden state h^{k-1}_i (h^0 = the main model's last hidden state, before
the final norm) with the embedding of token t_{i+k}:

    x = W [rmsnorm(h^{k-1}_i) ; rmsnorm(embed(t_{i+k}))]      # 2d -> d
    h^k = Block(x)                                             # one causal transformer block
                                                               # (dense, also in MoE models)
    logits = Decoder.logits(h^k)                                # shared final norm + head

so h^k predicts t_{i+k+1}. The embedding and the output head are the main model's.
Training adds `train.mtp_weight` x the mean of the D losses (`mtp_losses`); decoding uses
the chain of modules as a drafter for speculative decoding (inference/speculative.py).
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
        self.h_norm = RMSNorm(cfg.d_model, **norm)
        self.e_norm = RMSNorm(cfg.d_model, **norm)
        self.proj = Linear((2 * cfg.d_model,), (cfg.d_model,), (None, "embed"), "bsc,cd->bsd",
                           dtype=dtype, param_dtype=pdtype, rngs=rngs, std=cfg.init_std)
        self.block = Block(cfg, rngs=rngs)

    def __call__(self, h, e, positions):
        """h (B, S, d) previous depth's hidden, e (B, S, d) embeddings of the tokens k ahead
        -> this depth's hidden (B, S, d)."""
        x = self.proj(jnp.concatenate([self.h_norm(h), self.e_norm(e)], axis=-1))
        return self.block(x, positions)[0]


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

    h (B, S, d): the main model's last hidden state at input positions 0..S-1;
    targets (B, S): targets[:, i] = t_{i+1}. Depth k at position i embeds t_{i+k}
    (= targets[:, i+k-1]) and predicts t_{i+k+1} (= targets[:, i+k]), defined for
    i < S - k; the last k positions are masked. Returns (losses [D], accuracies [D]).
    """
    b, s = targets.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    losses, accs = [], []
    for k, module in enumerate(model.mtp.layers, start=1):
        h = module(h, model.embed(shift_left(targets, k - 1)), positions)
        logits = model.logits(h)  # (B, S, V) float32
        tgt = shift_left(targets, k)
        mask = (jnp.arange(s) < s - k)[None, :].astype(jnp.float32)  # (1, S)
        lse = jax.nn.logsumexp(logits, axis=-1)
        nll = lse - jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        count = jnp.maximum(mask.sum() * b, 1.0)
        losses.append(jnp.sum(nll * mask) / count)
        accs.append(jnp.sum((jnp.argmax(logits, -1) == tgt) * mask) / count)
    return jnp.stack(losses), jnp.stack(accs)
