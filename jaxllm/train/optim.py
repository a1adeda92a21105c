"""AdamW with linear warmup, cosine decay and global-norm gradient clipping."""
from __future__ import annotations

import jax
import optax

from jaxllm.config import TrainConfig

NO_DECAY = ("scale", "bias")  # norms and biases are not decayed


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
        decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.lr * t.min_lr_ratio)


def decay_mask(params):
    """True for parameters that get weight decay (matrices and embeddings)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in NO_DECAY, params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(lr_schedule(t), b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay,
                    mask=decay_mask),
    )
