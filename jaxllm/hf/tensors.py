"""HF tensors <-> our parameters: safetensors files, weight layouts, stacked-layer slots.

A family's weight table maps each of our parameter paths to a `Weight`: the HF tensor
name ("{i}" the layer of a stacked block or of an MTP module, "{e}" an expert), the
layout, and optionally a permutation of our last axis. Layouts: "same" (identical),
"flat" (ours [H, D], HF [H*D]), "T1" / "T2" (ours [*in, *out] with 1 or 2 input axes,
HF's linear weight [out, in]).
`perm`: ours[..., j] = HF's[..., perm[j]] along our last axis, once laid out (DeepSeek's
interleaved rotary dimensions).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx


class Weight(NamedTuple):
    name: str
    layout: str
    perm: np.ndarray | None = None


_MTP = re.compile(r"mtp/layers/(\d+)/")  # an MTP module's parameters (model/mtp.py)


def table_key(ours: str) -> str:
    """The weight table's key of our parameter path: the dense_blocks (the first layers of
    an MoE model) and the block of each MTP module share the blocks' names; an MTP
    module's own parameters are keyed without its index ("mtp/proj/kernel")."""
    if ours.startswith("dense_blocks/"):
        return "blocks/" + ours[len("dense_blocks/"):]
    if m := _MTP.match(ours):
        rest = ours[m.end():]
        return "blocks/" + rest[len("block/"):] if rest.startswith("block/") else "mtp/" + rest
    return ours


def lookup(table: dict, ours: str) -> Weight:
    """The Weight of our parameter path (see `table_key`)."""
    key = table_key(ours)
    if key not in table:
        raise ValueError(f"parameter {ours!r} has no Hugging Face counterpart")
    return Weight(*table[key])


def slots(ours: str, shape, name: str, n_dense: int, n_layers: int) -> list[tuple[tuple, str]]:
    """(index into our parameter, HF tensor name) of each HF tensor parameter `ours` of
    `shape` holds: one for a plain one, one per layer of a stack (blocks follow the
    n_dense dense_blocks), one per layer and expert of stacked experts. MTP module k is
    HF layer n_layers + k, unstacked (its experts: one per expert)."""
    if m := _MTP.match(ours):
        i = n_layers + int(m[1])
        if "{e}" not in name:
            return [((), name.format(i=i))]
        return [((e,), name.format(i=i, e=e)) for e in range(shape[0])]
    if not ours.startswith(("blocks/", "dense_blocks/")):
        return [((), name)]
    first = n_dense if ours.startswith("blocks/") else 0
    if "{e}" not in name:
        return [((i,), name.format(i=first + i)) for i in range(shape[0])]
    return [((i, e), name.format(i=first + i, e=e))
            for i in range(shape[0]) for e in range(shape[1])]


def hf_shape(shape, layout: str) -> tuple:
    if layout == "same":
        return tuple(shape)
    if layout == "flat":
        return (math.prod(shape),)
    n = int(layout[1])
    return (math.prod(shape[n:]), math.prod(shape[:n]))


def to_hf(x: np.ndarray, w: Weight) -> np.ndarray:
    """Our array -> the HF tensor of Weight `w`."""
    if w.perm is not None:
        x = x[..., np.argsort(w.perm)]
    hf = hf_shape(x.shape, w.layout)
    return np.ascontiguousarray(x.reshape(hf[::-1]).T) if w.layout[0] == "T" else x.reshape(hf)


def load_into(dst: np.ndarray, t: np.ndarray, name: str, w: Weight) -> None:
    """Write HF tensor `t` into our (contiguous) array `dst`, casting, in one pass (and a
    second over this one tensor to permute it)."""
    if t.shape != hf_shape(dst.shape, w.layout):
        raise ValueError(f"tensor {name!r} has shape {t.shape}; config.json implies "
                         f"{hf_shape(dst.shape, w.layout)}")
    if w.layout[0] == "T":  # ours [*in, *out] is HF's [out, in] transposed
        dst.reshape(t.shape[::-1])[...] = t.T
    else:
        dst.reshape(t.shape)[...] = t
    if w.perm is not None:
        dst[...] = dst[..., w.perm]


class Tensors:
    """Tensors by name over one or several (indexed) safetensors files."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: path / f for k, f in json.loads(index.read_text())["weight_map"]
                          .items()}
        else:
            from safetensors import safe_open
            self.where = {}
            for f in sorted(path.glob("*.safetensors")):
                with safe_open(str(f), framework="numpy") as h:
                    self.where.update({k: f for k in h.keys()})
        if not self.where:
            raise ValueError(f"no *.safetensors weights in {str(path)!r}")
        self.used = set()

    def get(self, name: str) -> np.ndarray:
        from safetensors import safe_open
        if name not in self.where:
            raise ValueError(f"the checkpoint lacks tensor {name!r}")
        self.used.add(name)
        # opened per tensor: a file held open keeps every page read so far mapped
        with safe_open(str(self.where[name]), framework="numpy") as h:
            return h.get_tensor(name)


def shardings_from_mesh(abstract_state, mesh, rules=None):
    """NamedShardings of every parameter from its logical axes and the sharding rules."""
    from jax.sharding import NamedSharding

    from jaxllm.sharding.rules import Rules
    rules = rules or Rules.for_mesh(mesh)

    def one(v):
        spec = rules.param_spec(v.get_metadata()["out_sharding"], v.get_value().shape)
        return NamedSharding(mesh, spec)

    return nnx.to_pure_dict(jax.tree.map(one, abstract_state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def get_path(tree, keys):
    for k in keys:
        tree = tree[k.key]
    return tree


def set_path(tree, keys, value):
    for k in keys[:-1]:
        tree = tree.setdefault(k.key, {})
    tree[keys[-1].key] = value
