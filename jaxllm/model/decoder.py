"""The Llama-family decoder: embed -> N x [norm, attention, norm, SwiGLU] -> norm -> head.

The N blocks are one stacked module (every parameter has a leading `layers` axis) run by
`jax.lax.scan`, so pipeline stages are slices and compile time does not grow with depth.
model.unroll_layers unrolls that scan in the compiled step: each layer then reads its
weights as static slices of the stack, where the rolled loop copies them and stacks its
saved activations (the 1B train step on an H100: 211 -> 171 ms), at a compile time that
grows with depth.
With model.moe the feed-forward part is the MoE block (model/moe.py), and the first
moe.dense_layers layers, which keep the dense MLP, are a stack of their own
(`dense_blocks`) run before the main one (`blocks`).
Decoding runs its own program over these parameters (`jaxllm.inference`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.block import Block
from jaxllm.model.layers import Embed, Linear, RMSNorm, as_dtype
from jaxllm.model.mtp import MTPHeads
from jaxllm.sharding import context

REMAT_POLICIES = {
    "full": None,  # save nothing; recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Decoder(nnx.Module):
    """tokens int32 [B, S] -> logits float32 [B, S, V]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, pdtype = as_dtype(cfg.dtype), as_dtype(cfg.param_dtype)
        self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=pdtype,
                           rngs=rngs, std=cfg.init_std)

        def stack(n: int, moe: bool):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs):
                return Block(cfg, rngs=rngs, moe=moe)
            return make_blocks(rngs)

        # with model.moe: its first dense_layers layers keep the dense MLP, a stack of
        # their own before the uniform MoE stack `blocks`
        n_dense = cfg.moe.dense_layers if cfg.moe else 0
        self.dense_blocks = stack(n_dense, moe=False) if n_dense else None
        self.blocks = stack(cfg.n_layers - n_dense, moe=cfg.moe is not None)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype, param_dtype=pdtype,
                                  rngs=rngs)
        self.head = None if cfg.tie_embeddings else Linear(
            (cfg.d_model,), (cfg.vocab_size,), ("embed", "vocab"), "bsd,dv->bsv",
            dtype=dtype, param_dtype=pdtype, rngs=rngs, std=cfg.init_std)
        # multi-token-prediction modules (model/mtp.py): extra training loss, drafting
        self.mtp = MTPHeads(cfg, rngs=rngs) if cfg.mtp_depth > 0 else None

    def logits(self, h):
        """Final norm + output head: hidden (B, S, d) -> float32 logits (B, S, V)."""
        return self.head_logits(self.final_norm(h))

    def head_logits(self, h):
        """The output head alone over normed hidden states (B, S, d) -> float32 logits
        (B, S, V): the main model's after its final norm, an MTP module's after its own."""
        if self.head is None:
            return self.embed.attend(h)
        return self.head(h).astype(jnp.float32)

    def run_blocks(self, x, positions, blocks=None):
        """The scanned `blocks` (default: the main stack) over x (B, S, d) -> (hidden
        (B, S, d), stats): the blocks' MoE routing statistics, each [L, ...] ({} if dense)."""
        graphdef, state = nnx.split(self.blocks if blocks is None else blocks)

        def body(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions)

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat])
        return jax.lax.scan(body, x, state, unroll=self.cfg.unroll_layers)

    def forward(self, tokens):
        """Training / scoring forward: causal attention over the whole sequence.
        -> (logits (B, S, V), hidden (B, S, d), MoE stats of the main stack's layers)."""
        b, s = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x, positions = context.balance(self.embed(tokens), positions)  # cp > 1: reorder
        if self.dense_blocks is not None:
            x = self.run_blocks(x, positions, self.dense_blocks)[0]
        h, stats = self.run_blocks(x, positions)
        h = context.unbalance(h)
        return self.logits(h), h, stats

    def __call__(self, tokens, *, return_hidden: bool = False):
        """`forward`'s logits (and hidden states with return_hidden)."""
        logits, h, _ = self.forward(tokens)
        return (logits, h) if return_hidden else logits


def build_model(cfg: ModelConfig, *, rngs: nnx.Rngs | None = None) -> Decoder:
    """The decoder for `cfg` (a ModelConfig, or a full Config whose .model is used)."""
    cfg = getattr(cfg, "model", cfg)
    return Decoder(cfg, rngs=rngs if rngs is not None else nnx.Rngs(0))
