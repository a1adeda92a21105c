"""Logical axes -> mesh axes: the one table, and the specs of every training array.

Model code names logical axes only: parameters carry them as metadata and
activations through `sharding.constrain`. This table puts them on the mesh axes of
`sharding.mesh` for two kinds of arrays:

    logical     parameters    activations
    batch       -             dp, fsdp, ep     data parallel
    seq         -             cp (+ tp)        context parallel (+ sequence parallel)
    embed       ZeRO axes     -                FSDP / ZeRO shards the model dimension
    q_heads     tp            tp               Megatron: column-parallel QKV,
    kv_heads    tp            tp                 row-parallel output projection
    mlp         tp            tp               column-parallel up/gate, row-parallel down
    vocab       tp            tp               vocabulary-parallel embedding, head, loss
    experts     ep            ep
    stages      pp            -                the pipelined stack's `layers` (pipeline.py)
    head_dim, layers, latent: not sharded

ZeRO axes. Training holds three model states per parameter: the parameter, its gradient
and the optimizer state. The `fsdp` axis shards all three (that is what it is for); over
the `dp` axis `train.zero_stage` decides: 0 replicates everything, 1 shards the optimizer
state, 2 also the gradients (reduce-scatter instead of all-reduce), 3 also the
parameters. With fsdp=1 this is DeepSpeed's ZeRO over dp; with dp=1 it is FSDP.
A parameter is ZeRO-sharded on its `embed` dimension, or else on its largest divisible
dimension other than `layers` / `stages`.

Model-parallel axes (heads, mlp, vocab, experts) claim their mesh axes first; batch and
seq take what is left, so with `parallelism.sequence_parallel` the residual stream
(batch, seq, embed) is split over cp x tp while q/k/v keep tp for their heads: between
the norms and the Megatron matmuls GSPMD then all-gathers and reduce-scatters sequences.
A dimension that the mesh axes do not divide is left whole on those axes (the dry run
lists every parameter's layout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jax.sharding import PartitionSpec as P

ZERO = "zero"  # stands for the ZeRO axes of the array kind

# logical axis -> (mesh axes of parameters, mesh axes of activations)
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "batch": ((), ("dp", "fsdp", "ep")),
    "seq": ((), ("cp",)),
    "embed": ((ZERO,), ()),
    "q_heads": (("tp",), ("tp",)),
    "kv_heads": (("tp",), ("tp",)),
    "head_dim": ((), ()),
    "mlp": (("tp",), ("tp",)),
    "vocab": (("tp",), ("tp",)),
    "experts": (("ep",), ("ep",)),
    "layers": ((), ()),
    "stages": (("pp",), ()),
    "latent": ((), ()),
    None: ((), ()),  # an unnamed axis
}
DATA_AXES = ("batch", "seq")  # take their mesh axes after the model-parallel ones
STATE_KINDS = {"params": 3, "grads": 2, "opt_state": 1}  # kind -> first ZeRO stage over dp
# "compute": a parameter as the computation uses it, gathered over its ZeRO axes.


@dataclass(frozen=True)
class Rules:
    """The table applied to one mesh: axis sizes, ZeRO stage, sequence parallelism."""
    sizes: tuple[tuple[str, int], ...]  # (mesh axis, size), outermost first
    zero_stage: int = 0
    sequence_parallel: bool = False

    @classmethod
    def for_mesh(cls, mesh, zero_stage: int = 0, sequence_parallel: bool = False) -> "Rules":
        return cls(tuple(mesh.shape.items()), zero_stage, sequence_parallel)

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def zero_axes(self, kind: str) -> tuple[str, ...]:
        """The data-parallel mesh axes over which `kind` of model state is sharded."""
        if kind == "compute":
            return ()
        if kind not in STATE_KINDS:
            raise ValueError(f"unknown model state kind {kind!r}; one of "
                             f"{list(STATE_KINDS) + ['compute']}")
        axes = ("dp", "fsdp") if self.zero_stage >= STATE_KINDS[kind] else ("fsdp",)
        return tuple(a for a in axes if self.size(a) > 1)

    def _fit(self, axes, dim: int, used: set) -> tuple[str, ...]:
        """The longest prefix of the free, non-trivial `axes` whose product divides `dim`."""
        free = [a for a in axes if a not in used and self.size(a) > 1]
        while free and dim % math.prod(self.size(a) for a in free):
            free.pop()
        used.update(free)
        return tuple(free)

    def param_spec(self, logical, shape, kind: str = "params") -> P:
        """PartitionSpec of a parameter-shaped array (`kind`: params, grads, opt_state or
        compute)."""
        _check_names(logical, shape)
        spec, used = [()] * len(shape), set()
        for i, name in enumerate(logical):
            axes = RULES[name][0]
            if axes and axes != (ZERO,):
                spec[i] = self._fit(axes, shape[i], used)
        zero = [a for a in self.zero_axes(kind) if a not in used]
        if zero:
            group = math.prod(self.size(a) for a in zero)
            order = [i for i, n in enumerate(logical) if RULES[n][0] == (ZERO,)]
            order += sorted((i for i, n in enumerate(logical)
                             if n not in ("layers", "stages") and i not in order
                             and not spec[i]),
                            key=lambda i: -shape[i])
            for i in order:
                rest = shape[i] // math.prod(self.size(a) for a in spec[i])
                if rest % group == 0:
                    spec[i] = spec[i] + tuple(zero)
                    break
        return _as_spec(spec)

    def activation_spec(self, logical, shape) -> P:
        """PartitionSpec of an activation named by `logical` axes."""
        _check_names(logical, shape)
        spec, used = [()] * len(shape), set()
        order = ([i for i, n in enumerate(logical) if n not in DATA_AXES]
                 + [i for i, n in enumerate(logical) if n == "seq"]
                 + [i for i, n in enumerate(logical) if n == "batch"])
        for i in order:
            axes = RULES[logical[i]][1]
            if logical[i] == "seq" and self.sequence_parallel:
                axes = axes + ("tp",)
            spec[i] = self._fit(axes, shape[i], used)
        return _as_spec(spec)

    def batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in RULES["batch"][1] if self.size(a) > 1)

    def data_parallel_size(self) -> int:
        return math.prod(self.size(a) for a in RULES["batch"][1])


def _check_names(logical, shape):
    unknown = [n for n in logical if n not in RULES]
    if unknown:
        raise ValueError(f"unknown logical axes {unknown}; the vocabulary is "
                         f"{[n for n in RULES if n is not None]}")
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match the shape {tuple(shape)}")


def _as_spec(spec) -> P:
    return P(*[None if not s else s[0] if len(s) == 1 else tuple(s) for s in spec])
