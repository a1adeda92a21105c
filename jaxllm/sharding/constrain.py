"""Activation sharding from model code, without a mesh: `constrain(x, ('batch', 'seq', 'embed'))`.

The trainer traces its step inside `active(ctx)`; then `constrain` pins an activation to
the layout the rules table gives its logical axes (a `with_sharding_constraint`), and
the context-parallel hooks in `sharding.context` find the mesh. Outside such a context
(eager calls, generation, tests of the model alone) `constrain` returns x unchanged.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import jax
from jax.sharding import Mesh, NamedSharding

from jaxllm.sharding.rules import Rules


@dataclass
class ShardingContext:
    """What model-side hooks may know while a sharded program is traced."""
    mesh: Mesh
    rules: Rules
    cp_impl: str = "ring"  # context-parallel attention: "ring" or "allgather"
    # Set by sharding.context while the sequence is in its load-balanced order.
    balanced: bool = field(default=False)

    def activation_sharding(self, logical, shape) -> NamedSharding:
        return NamedSharding(self.current_mesh(), self.rules.activation_spec(logical, shape))

    def current_mesh(self):
        """The mesh; inside a shard_map (the pipeline's, over pp) the abstract one that marks
        its manual axes, which the rules never name."""
        abstract = jax.sharding.get_abstract_mesh()
        return abstract if abstract.manual_axes else self.mesh


_CURRENT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar(
    "jaxllm_sharding_context", default=None)


def current() -> ShardingContext | None:
    return _CURRENT.get()


@contextlib.contextmanager
def active(ctx: ShardingContext):
    """Make `ctx` the context of everything traced inside the block."""
    ctx.balanced = False  # each trace starts in sequence order
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def traced_in(ctx: ShardingContext, fn):
    """`fn` that runs (and is therefore traced) inside `active(ctx)`; wrap before jit."""
    def wrapped(*args, **kwargs):
        with active(ctx):
            return fn(*args, **kwargs)
    wrapped.__name__ = getattr(fn, "__name__", "fn")
    return wrapped


def constrain(x, logical: tuple[str, ...]):
    """Pin activation x (named by `logical` axes) to its layout; a no-op without a context."""
    ctx = current()
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(x, ctx.activation_sharding(logical, x.shape))


def gathered(w, logical: tuple[str, ...]):
    """Parameter w as the computation uses it: split over model-parallel axes only, its
    ZeRO / FSDP shards all-gathered. A no-op without a context."""
    ctx = current()
    if ctx is None:
        return w
    spec = ctx.rules.param_spec(logical, w.shape, "compute")
    return jax.lax.with_sharding_constraint(w, NamedSharding(ctx.current_mesh(), spec))
