"""A training run's sharding plan: the mesh, the rules, and the layout of every array.

    plan = ShardingPlan.create(cfg, lambda: build_model(cfg.model, rngs=nnx.Rngs(0)))
    params = plan.init_params()                     # created sharded, never whole on one device
    opt_state = plan.init_opt_state(tx, params)
    step = plan.jit_step(step_fn, tx)               # in/out shardings, donated state
    batch = plan.place_batch(host_rows)             # this host's rows -> one global array

Parameters are plain nested dicts (`nnx.to_pure_dict`); their logical axes come from
the NNX metadata and `rules.Rules` turns them into mesh layouts for the three model
states (parameters, gradients, optimizer moments), which differ by ZeRO stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import Config, ConfigError
from jaxllm.sharding.constrain import ShardingContext, traced_in
from jaxllm.sharding.context import attention_with_lse, balanced_order
from jaxllm.sharding.experts import check_experts
from jaxllm.sharding.mesh import describe_mesh, make_mesh
from jaxllm.sharding.pipeline import check_config as check_pipeline
from jaxllm.sharding.pipeline import stage_axes
from jaxllm.sharding.rules import Rules


def logical_axes(state) -> Any:
    """Pure-dict tree of each parameter's logical axis names (from its NNX metadata)."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    return jax.tree.map(lambda s: tuple(s), specs, is_leaf=lambda x: isinstance(x, P))


def _path(keys) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in keys)


@dataclass
class ShardingPlan:
    mesh: Mesh
    rules: Rules
    context: ShardingContext
    graphdef: nnx.GraphDef
    abstract: Any  # params tree of ShapeDtypeStruct
    logical: Any  # params tree of logical axis tuples
    make_model: Callable
    batch_size: int
    seq_len: int
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, cfg: Config, make_model: Callable, devices=None) -> "ShardingPlan":
        """The plan of `cfg` over `devices` (default: every device of every process)."""
        p, t = cfg.parallelism, cfg.train
        mesh = make_mesh(p, devices)
        check_pipeline(cfg)
        rules = Rules.for_mesh(mesh, t.zero_stage, p.sequence_parallel)
        n_data = rules.data_parallel_size()
        if t.batch_size % n_data:
            raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by the "
                              f"data-parallel size dp x fsdp x ep = {n_data}")
        if (t.batch_size // t.microbatches) % n_data:
            raise ConfigError(f"a microbatch of train.batch_size={t.batch_size} / train."
                              f"microbatches={t.microbatches} rows is not divisible by the "
                              f"data-parallel size dp x fsdp x ep = {n_data}")
        if mesh.shape["cp"] > 1:
            balanced_order(t.seq_len, mesh.shape["cp"])  # raises unless 2 cp divides seq_len
            attention_with_lse(cfg.model.attention_impl)  # raises if it has no log-sum-exp
        # ep splits an MoE model's experts (a dense model's batch only)
        check_experts(cfg.model.moe and cfg.model.moe.num_experts, mesh.shape["ep"])
        graphdef, state = nnx.split(nnx.eval_shape(make_model))
        logical = logical_axes(state)
        if p.pp > 1:  # the main stack's layers are split into stages over pp
            logical = stage_axes(logical)
        plan = cls(mesh, rules, ShardingContext(mesh, rules, p.cp_impl), graphdef,
                   nnx.to_pure_dict(state), logical, make_model, t.batch_size, t.seq_len)
        plan._check_host_rows()
        return plan

    # -- layouts --------------------------------------------------------------------

    def shardings(self, kind: str = "params"):
        """Params-shaped tree of NamedShardings of one model state (params, grads, opt_state)."""
        if kind not in self._cache:
            self._cache[kind] = jax.tree.map(
                lambda a, names: NamedSharding(self.mesh,
                                               self.rules.param_spec(names, a.shape, kind)),
                self.abstract, self.logical, is_leaf=lambda x: isinstance(x, tuple))
        return self._cache[kind]

    @property
    def params(self):
        return self.shardings("params")

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch(self) -> NamedSharding:
        """Token batches [B, S]: rows over the data-parallel axes (the model splits seq)."""
        return NamedSharding(self.mesh, P(self.rules.batch_axes() or None))

    def opt_state_shardings(self, tx: optax.GradientTransformation):
        """The optimizer state's layout: moments like parameters at their ZeRO stage."""
        key = ("tx", id(tx))
        if key not in self._cache:
            abstract = jax.eval_shape(tx.init, self.abstract)
            self._cache[key] = tx, optax.tree_map_params(
                tx, lambda _, s: s, abstract, self.shardings("opt_state"),
                transform_non_params=lambda _: self.replicated)
        return self._cache[key][1]

    def abstract_opt_state(self, tx):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            jax.eval_shape(tx.init, self.abstract),
                            self.opt_state_shardings(tx))

    def abstract_params(self):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract, self.params)

    def abstract_batch(self):
        shape = jax.ShapeDtypeStruct((self.batch_size, self.seq_len), np.int32,
                                     sharding=self.batch)
        return {"inputs": shape, "targets": shape}

    # -- creating and moving arrays ---------------------------------------------------

    def init_params(self):
        """The model's parameters, created directly in their sharded layout."""
        make = lambda: nnx.to_pure_dict(nnx.state(self.make_model()))
        return jax.jit(make, out_shardings=self.params)()

    def init_opt_state(self, tx, params):
        return jax.jit(tx.init, out_shardings=self.opt_state_shardings(tx))(params)

    def place_batch(self, local: dict) -> dict:
        """This process's rows of each batch array -> global arrays in the batch layout."""
        out = {}
        for name, rows in local.items():
            rows = np.asarray(rows)
            shape = (rows.shape[0] * self.data_shard()[1],) + rows.shape[1:]
            out[name] = jax.make_array_from_process_local_data(self.batch, rows, shape)
        return out

    def data_shard(self) -> tuple[int, int]:
        """(block, blocks): this process loads row block `block` of `blocks` equal blocks of
        every batch. Processes whose devices hold the same rows (pp spanning hosts) load
        the same block."""
        held = {}
        for dev, idx in self.batch.devices_indices_map((self.batch_size, self.seq_len)).items():
            held.setdefault(dev.process_index, set()).update(
                range(*idx[0].indices(self.batch_size)))
        firsts = sorted({min(rows) for rows in held.values()})
        return firsts.index(min(held[jax.process_index()])), len(firsts)

    def _check_host_rows(self):
        """Each process must own the contiguous block of rows `data.get_batch` gives it."""
        if jax.process_count() == 1:
            return
        index = self.batch.addressable_devices_indices_map((self.batch_size, self.seq_len))
        rows = {r for idx in index.values() for r in range(*idx[0].indices(self.batch_size))}
        block, blocks = self.data_shard()
        per = self.batch_size // blocks
        if rows != set(range(block * per, (block + 1) * per)):
            raise ConfigError(
                f"process {jax.process_index()}'s devices hold batch rows {sorted(rows)[:4]}..."
                f" but it loads rows {per * block}..; let the data-parallel "
                f"axes (dp, fsdp) span the {jax.process_count()} hosts")

    # -- the step ---------------------------------------------------------------------

    def constrain_grads(self, grads):
        """Gradients to their ZeRO layout (stage >= 2: a reduce-scatter, not an all-reduce)."""
        return jax.lax.with_sharding_constraint(grads, self.shardings("grads"))

    def jit_step(self, step: Callable, tx) -> Callable:
        """jit of step(params, opt_state, batch) -> (params, opt_state, metrics), state donated."""
        opt = self.opt_state_shardings(tx)
        return jax.jit(traced_in(self.context, step),
                       in_shardings=(self.params, opt, self.batch),
                       out_shardings=(self.params, opt, self.replicated), donate_argnums=(0, 1))

    def jit_eval(self, fn: Callable) -> Callable:
        """jit of fn(params, batch) -> scalar."""
        return jax.jit(traced_in(self.context, fn), in_shardings=(self.params, self.batch),
                       out_shardings=self.replicated)

    # -- reporting --------------------------------------------------------------------

    def describe(self) -> str:
        """The mesh and every parameter's layout, one line each."""
        lines = [describe_mesh(self.mesh) + f"; ZeRO stage {self.rules.zero_stage}"
                 + ("; sequence parallel" if self.rules.sequence_parallel else ""),
                 f"{'parameter':<34} {'shape':<22} {'params':<26} {'per device':<18}"
                 f" {'grads / opt state'}"]
        kinds = {k: self.shardings(k) for k in ("params", "grads", "opt_state")}
        flat = jax.tree_util.tree_flatten_with_path(self.abstract)[0]
        leaves = {k: jax.tree.leaves(v) for k, v in kinds.items()}
        for n, (path, a) in enumerate(flat):
            sp = leaves["params"][n]
            local = sp.shard_shape(a.shape)
            others = " / ".join(_spec(leaves[k][n].spec) for k in ("grads", "opt_state"))
            lines.append(f"{_path(path):<34} {str(tuple(a.shape)):<22} {_spec(sp.spec):<26} "
                         f"{str(tuple(local)):<18} {others}")
        return "\n".join(lines)


def _spec(spec) -> str:
    return "(" + ", ".join("-" if s is None else s if isinstance(s, str) else "+".join(s)
                           for s in spec) + ")"


def shard_bytes(abstract, shardings) -> int:
    """Bytes one device holds of a tree laid out by `shardings` (the largest shard)."""
    return sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))
