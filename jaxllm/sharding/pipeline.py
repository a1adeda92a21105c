"""Pipeline parallelism: the main block stack split into stages over the `pp` mesh axis.

    pipe = Pipeline(cfg, graphdef, mesh, token_loss)
    loss, aux = pipe.loss(params, batch)                    # gpipe / circular forward
    (loss, aux), grads = pipe.value_and_grad(params, batch)  # what the train step calls

The stacked `blocks` parameters [L, ...] stay one array per leaf (checkpoints do not
depend on pp); their `stages` axis (`stage_axes`) is sharded over `pp`, so device d holds
layers [d L/p, (d+1) L/p). Inside the step the stack is viewed as [p, v, L/(p v), ...]:
for circular (v stages per device) the layers are first put in pipeline order, stage
s = r p + d to device d, which costs one exchange of the layer weights over pp per step.

One `shard_map` over `pp` alone runs the schedule; dp / fsdp / tp stay automatic axes
for GSPMD inside it, so they compose. Each tick every device runs the stage that the
schedule table (`pipeline_schedule.py`) gives it; activations move one device forward
with `ppermute` (cotangents one back). The first stage embeds its microbatch, the last
applies the final norm, head and loss, and the MTP modules (model.mtp_depth, as
DeepSeek-V3 places them): their parameters, like the head's, are on every pp device, and
their losses, accuracies and MoE stats are summed over the microbatches as the main
loss is. Device-dependent work (the head and loss, the op of a 1F1B tick) runs under
`lax.cond` / `lax.switch`, so other devices skip it.

- gpipe, circular: a scan over the forward ticks; autodiff mirrors it for the backward.
  The stage is rematerialised by `model.remat`, so the scan keeps each tick's stage input
  (plus what the remat policy saves): activation memory grows with the microbatches.
- 1f1b: a scan over every tick, each running one forward or one backward (`jax.vjp` of
  the stage, recomputed from its saved input); a device keeps at most p stage inputs,
  gradients are accumulated in the carry and the loss's cotangent starts at the last
  stage inside the schedule. Memory stays level as microbatches are added.

The batch [B, S] is cut into m microbatches of rows i, i + m, i + 2m, ... so that the
data-parallel split of the rows is untouched; the loss is the mean over microbatches
of their token means, equal to the full batch's mean.

MoE models: the stages split the MoE stack (`blocks`, n_layers - dense_layers layers);
the `dense_blocks` stack runs in the first stage after the embedding (its weights, like
the embedding's, are on every pp device), so that stage has dense_layers more layers.
Each stage's MoE layers return their routing stats per microbatch (`routing_stats`:
token means); they are summed over the microbatches in the schedule's carry, leave the
`shard_map` sharded over pp and are put back in layer order [L, E], and their mean over
the microbatches (of equal token counts) is the full batch's; the MTP blocks' follow
them, [L + D, E], as in `trainer.loss_fn`. The Switch aux loss, a product of two means,
is recomputed from the averaged load and probability, so the metrics, `expert_load` and
the aux-loss objective equal one device's. gpipe and circular differentiate through
that; 1f1b takes the stats from each microbatch's backward tick and gives them no
cotangent, so it refuses balance=aux_loss (its gradient needs the whole batch's load
before the first backward). Expert parallelism composes: the experts' own `shard_map`
over the token axes (ep > 1: its all-to-all) nests inside this one.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.config import Config, ConfigError
from jaxllm.sharding.pipeline_schedule import BWD, FWD, Schedule, build, slots

STACK = "blocks"  # the pipelined stack of the decoder's parameters


def check_config(cfg: Config) -> None:
    """Refuse pipeline settings that cannot run, naming the keys and the fix."""
    p, m, t = cfg.parallelism, cfg.model, cfg.train
    pp, v, mb, kind = p.pp, p.pp_repeats, t.microbatches, p.pp_schedule
    if pp == 1:
        if v != 1 or mb != 1:
            raise ConfigError(f"parallelism.pp_repeats={v} and train.microbatches={mb} are "
                              f"pipeline settings; with parallelism.pp=1 leave them at 1")
        return
    if v != 1 and kind != "circular":
        raise ConfigError(f"parallelism.pp_repeats={v} (stages per device) needs "
                          f"parallelism.pp_schedule=circular, not {kind!r}")
    dense = m.moe.dense_layers if m.moe is not None else 0
    if (m.n_layers - dense) % (pp * v):
        stack = (f"model.n_layers={m.n_layers}" if not dense else
                 f"model.n_layers={m.n_layers} - model.moe.dense_layers={dense} = "
                 f"{m.n_layers - dense} MoE layers")
        raise ConfigError(f"{stack} is not divisible by parallelism.pp={pp} x "
                          f"parallelism.pp_repeats={v} = {pp * v} stages; choose n_layers, "
                          f"pp and pp_repeats so that it is")
    if kind == "circular" and mb % pp:
        raise ConfigError(f"train.microbatches={mb} must be a multiple of parallelism.pp={pp} "
                          f"for pp_schedule=circular (microbatches enter in groups of pp)")
    if kind == "1f1b" and mb < pp:
        raise ConfigError(f"train.microbatches={mb} must be >= parallelism.pp={pp} for "
                          f"pp_schedule=1f1b; raise train.microbatches")
    if t.batch_size % mb:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by "
                          f"train.microbatches={mb}")
    if p.cp != 1:
        raise ConfigError(f"parallelism.cp={p.cp} with parallelism.pp={pp} is not supported; "
                          f"set one of them to 1")
    if t.distill_from:
        raise ConfigError(f"train.distill_from with parallelism.pp={pp} is not supported; "
                          f"distil with parallelism.pp=1")
    if m.moe is not None and kind == "1f1b" and m.moe.balance == "aux_loss":
        raise ConfigError("model.moe.balance=aux_loss with parallelism.pp_schedule=1f1b is "
                          "not supported (the loss's gradient needs the whole batch's expert "
                          "load before the first microbatch's backward); use "
                          "pp_schedule=gpipe or circular, or model.moe.balance=bias")


def _positions(x):
    return jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])


def _zeros(tree):
    """Zeros of every shape and dtype in a tree of arrays or ShapeDtypeStructs."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)


def schedule_of(cfg: Config) -> Schedule:
    """The schedule table of the config's pipeline settings."""
    p = cfg.parallelism
    return build(p.pp_schedule, p.pp, cfg.train.microbatches, p.pp_repeats)


def stage_axes(logical):
    """Logical axes of the parameters with the pipelined stack's `layers` axis named
    `stages` (which `rules.py` shards over pp); other stacks keep `layers`."""
    if STACK not in logical:
        raise ConfigError(f"parallelism.pp > 1 splits the model's `{STACK}` stack into "
                          f"stages, but this model has none ({sorted(logical)}); set "
                          f"parallelism.pp=1")
    out = dict(logical)
    out[STACK] = jax.tree.map(lambda names: ("stages",) + tuple(names[1:]), logical[STACK],
                              is_leaf=lambda x: isinstance(x, tuple))
    return out


class Pipeline:
    """The pipelined loss and gradients of one config's model over a mesh with pp > 1."""

    def __init__(self, cfg: Config, graphdef: nnx.GraphDef, mesh, token_loss: Callable):
        check_config(cfg)
        self.graphdef, self.mesh, self.token_loss = graphdef, mesh, token_loss
        self.p, self.v = cfg.parallelism.pp, cfg.parallelism.pp_repeats
        self.m, self.kind = cfg.train.microbatches, cfg.parallelism.pp_schedule
        from jaxllm.model.decoder import REMAT_POLICIES  # the model imports sharding
        self.remat = cfg.model.remat
        self.remat_policy = REMAT_POLICIES.get(self.remat)
        self.schedule = schedule_of(cfg)
        self.moe = cfg.model.moe
        self.mtp_weight = cfg.train.mtp_weight

    # -- the model in pieces ------------------------------------------------------------

    def _model(self, rest, chunk):
        return nnx.merge(self.graphdef, {**rest, STACK: chunk})

    def _stage(self, chunk, rest, x):
        """One stage: its L/(p v) layers over x (b, S, d) -> (output, MoE stats, each
        [L/(p v), ...]; {} for a dense model)."""
        def run(chunk, rest, x):
            return self._model(rest, chunk).run_blocks(x, _positions(x))
        if self.remat != "none":
            run = jax.checkpoint(run, policy=self.remat_policy)
        return run(chunk, rest, x)

    def _embed(self, chunk, rest, tokens):
        """The first stage's start: the embedding, then the dense stack of an MoE model."""
        model = self._model(rest, chunk)
        x = model.embed(tokens)
        if model.dense_blocks is not None:
            x = model.run_blocks(x, _positions(x), model.dense_blocks)[0]
        return x

    def _head(self, chunk, rest, h, targets):
        """The last stage's end over its output h (b, S, d): {"loss": the token loss} and,
        with MTP modules, their per-depth "mtp_loss", "mtp_acc" [D] and "mtp_stats" (their
        blocks' MoE stats [D, ...], {} if dense), all means over this microbatch."""
        model = self._model(rest, chunk)
        out = {"loss": self.token_loss(model.logits(h), targets)}
        if model.mtp is not None:
            from jaxllm.model.mtp import mtp_losses  # the model imports sharding
            out["mtp_loss"], out["mtp_acc"], out["mtp_stats"] = mtp_losses(model, h, targets)
        return out

    def _head_or_zeros(self, chunk, rest, h, targets, is_last):
        """`_head` on the last stage, zeros of its shapes on the others."""
        shapes = jax.eval_shape(self._head, chunk, rest, h, targets)
        return jax.lax.cond(is_last, lambda h: self._head(chunk, rest, h, targets),
                            lambda h: _zeros(shapes), h)

    def _head_objective(self, out):
        """A microbatch's share of the objective before balancing: its token loss plus
        mtp_weight x its MTP modules' mean loss."""
        if "mtp_loss" not in out:
            return out["loss"]
        return out["loss"] + self.mtp_weight * jnp.mean(out["mtp_loss"])

    def _forward(self, chunk, rest, x_in, tokens, first):
        """Stage input (the embedding on the first stage) -> (stage output, MoE stats)."""
        x = jax.lax.cond(first, lambda x: self._embed(chunk, rest, tokens), lambda x: x, x_in)
        return self._stage(chunk, rest, x)

    def _shapes(self, chunk, rest, tokens):
        """Shapes and dtypes of a stage's output (the activation passed between stages)
        and of its MoE stats."""
        return jax.eval_shape(lambda: self._stage(chunk, rest, self._embed(chunk, rest, tokens)))

    def _objective(self, out, stats):
        """(objective, aux) as `trainer.loss_fn` gives them, from the last stage's `_head`
        figures and the MoE layers' stats [L, ...] in layer order, both summed over the
        microbatches."""
        from jaxllm.model.moe import balance_aux, switch_loss  # the model imports sharding
        from jaxllm.model.mtp import mtp_objective
        out, stats = jax.tree.map(lambda x: x / self.m, (out, stats))  # means of token means
        objective = loss = out["loss"]
        aux = {"loss": loss}
        if "mtp_loss" in out:
            objective, more = mtp_objective(objective, out["mtp_loss"], out["mtp_acc"],
                                            self.mtp_weight)
            aux.update(more)
            if stats:  # an MoE model's MTP blocks are MoE layers too, after the main ones
                stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats,
                                     out["mtp_stats"])
        if not stats:
            return objective, aux
        stats["aux_loss"] = switch_loss(stats["load"], stats["prob"])  # not a token mean
        objective, more = balance_aux(objective, stats, self.moe)
        return objective, {**aux, **more}

    # -- layouts around the shard_map -------------------------------------------------

    def _to_pipeline_order(self, blocks):
        """[L, ...] in layer order -> [L, ...] whose contiguous pp blocks are each device's
        v stages (r p + d for r < v); the identity for v = 1."""
        if self.v == 1:
            return blocks
        p, v = self.p, self.v
        return jax.tree.map(lambda x: x.reshape(v, p, -1, *x.shape[1:]).swapaxes(0, 1)
                            .reshape(x.shape), blocks)

    def _to_layer_order(self, stacked):
        """The inverse of `_to_pipeline_order`."""
        if self.v == 1:
            return stacked
        p, v = self.p, self.v
        return jax.tree.map(lambda x: x.reshape(p, v, -1, *x.shape[1:]).swapaxes(0, 1)
                            .reshape(x.shape), stacked)

    def _microbatches(self, batch):
        """[B, S] -> [m, B/m, S]: microbatch i holds rows i, i + m, ..."""
        cut = lambda x: x.reshape(x.shape[0] // self.m, self.m, *x.shape[1:]).swapaxes(0, 1)
        return cut(batch["inputs"]), cut(batch["targets"])

    def _shard_map(self, body, out_specs):
        return jax.shard_map(body, mesh=self.mesh, in_specs=(P("pp"), P(), P(), P()),
                             out_specs=out_specs, axis_names=frozenset({"pp"}),
                             check_vma=False)  # the attention's own shard_map is unchecked

    # -- gpipe and circular: forward ticks, autodiff for the backward -------------------

    def loss(self, params, batch):
        """(loss, aux) of the batch through the pipeline's forward ticks (any schedule)."""
        rest = {k: v for k, v in params.items() if k != STACK}
        inputs, targets = self._microbatches(batch)
        fwd = self.schedule if self.kind != "1f1b" else build("gpipe", self.p, self.m)
        ticks = jnp.asarray(fwd.forward_ticks())  # [T, p, 2] (microbatch, stage)
        p, v = self.p, self.v
        last = p * v - 1

        # What autodiff keeps of a tick is stacked over all ticks. So the head's loss (and
        # the MTP modules') runs under one checkpoint around its lax.cond (whose residuals,
        # the head's weights among them, would be kept per tick), and with one stage per
        # device the stage's weights are taken once, outside the ticks; with v stages per
        # device each tick slices its stage, and that slice is kept per tick
        # (docs/experiments.md).
        head = jax.checkpoint(self._head_or_zeros)

        def body(blocks, rest, inputs, targets):
            d = jax.lax.axis_index("pp")
            stages = jax.tree.map(lambda x: x.reshape(v, -1, *x.shape[1:]), blocks)
            first = jax.tree.map(lambda x: x[0], stages)
            act, shapes = self._shapes(first, rest, inputs[0])
            out_shapes = jax.eval_shape(self._head, first, rest, act, targets[0])

            def tick(carry, row):
                state, total, acc = carry
                mb, s = row[d, 0], row[d, 1]
                i, r = jnp.maximum(mb, 0), jnp.maximum(s, 0) // p
                chunk = first if v == 1 else jax.tree.map(lambda x: x[r], stages)
                y, stats = self._forward(chunk, rest, state, inputs[i], s == 0)
                out = head(first, rest, y, targets[i], s == last)  # reads no block
                # this tick's stage's MoE stats, in its row r of the device's v stages
                acc = jax.tree.map(lambda a, x: a.at[r].add(jnp.where(mb >= 0, x, 0)),
                                   acc, stats)
                state = jax.lax.ppermute(y, "pp", [(j, (j + 1) % p) for j in range(p)])
                return (state, jax.tree.map(jnp.add, total, out), acc), None

            init = (_zeros(act), _zeros(out_shapes),
                    jax.tree.map(lambda x: jnp.zeros((v,) + x.shape, x.dtype), shapes))
            (_, total, acc), _ = jax.lax.scan(tick, init, ticks)
            acc = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), acc)  # [v L/(p v), ...]
            return jax.lax.psum(total, "pp"), acc

        blocks = self._to_pipeline_order(params[STACK])
        out, stats = self._shard_map(body, (P(), P("pp")))(blocks, rest, inputs, targets)
        return self._objective(out, self._to_layer_order(stats))

    # -- 1f1b: every tick by hand -------------------------------------------------------

    def _value_and_grad_1f1b(self, params, batch):
        rest = {k: v for k, v in params.items() if k != STACK}
        inputs, targets = self._microbatches(batch)
        ops = jnp.asarray(self.schedule.ops)  # [T, p, 3]
        p, m = self.p, self.m
        k_act, k_cot = slots(self.schedule)

        def body(blocks, rest, inputs, targets):
            d = jax.lax.axis_index("pp")
            first, last = d == 0, d == p - 1
            act, shapes = self._shapes(blocks, rest, inputs[0])
            out_shapes = jax.eval_shape(self._head, blocks, rest, act, targets[0])
            zeros = jnp.zeros(act.shape, act.dtype)
            add = lambda a, b: jax.tree.map(jnp.add, a, b)

            def full(chunk, rest, x_in, tokens, tgt):
                """-> ((stage output, this microbatch's share of the objective on the last
                stage, else 0), (its MoE stats, the last stage's `_head` figures))."""
                y, stats = self._forward(chunk, rest, x_in, tokens, first)
                out = self._head_or_zeros(chunk, rest, y, tgt, last)
                return (y, self._head_objective(out)), (stats, out)

            def tick(carry, row):
                acts, cots, g_blocks, g_rest, total, acc = carry
                op, mb = row[d, 0], jnp.maximum(row[d, 1], 0)
                x_in, dy = acts[mb % k_act], cots[mb % k_cot]

                def idle(g_blocks, g_rest, total, acc):
                    return zeros, zeros, g_blocks, g_rest, total, acc

                def forward(g_blocks, g_rest, total, acc):
                    y, _ = self._forward(blocks, rest, x_in, inputs[mb], first)
                    return y, zeros, g_blocks, g_rest, total, acc

                def backward(g_blocks, g_rest, total, acc):
                    # the MoE stats come from this recomputed forward, once per microbatch
                    # (balance aux_loss is refused with 1f1b: they need no cotangent)
                    _, vjp, (stats, out) = jax.vjp(
                        lambda c, r, x: full(c, r, x, inputs[mb], targets[mb]),
                        blocks, rest, x_in, has_aux=True)
                    dy_in = jnp.where(last, jnp.zeros_like(dy), dy)
                    gc, gr, dx = vjp((dy_in, jnp.where(last, 1.0 / m, 0.0)))
                    return (zeros, dx, add(g_blocks, gc), add(g_rest, gr), add(total, out),
                            add(acc, stats))

                y, dx, g_blocks, g_rest, total, acc = jax.lax.switch(
                    op, [idle, forward, backward], g_blocks, g_rest, total, acc)
                y = jax.lax.ppermute(y, "pp", [(j, j + 1) for j in range(p - 1)])
                dx = jax.lax.ppermute(dx, "pp", [(j + 1, j) for j in range(p - 1)])
                # what the neighbours just sent: store it in the microbatch's slot
                prev, nxt = row[(d - 1) % p], row[(d + 1) % p]
                got_act = (d > 0) & (prev[0] == FWD)
                got_cot = (d < p - 1) & (nxt[0] == BWD)
                i, j = jnp.maximum(prev[1], 0) % k_act, jnp.maximum(nxt[1], 0) % k_cot
                acts = acts.at[i].set(jnp.where(got_act, y, acts[i]))
                cots = cots.at[j].set(jnp.where(got_cot, dx, cots[j]))
                return (acts, cots, g_blocks, g_rest, total, acc), None

            init = (jnp.zeros((k_act,) + act.shape, act.dtype),
                    jnp.zeros((k_cot,) + act.shape, act.dtype),
                    _zeros(blocks), _zeros(rest), _zeros(out_shapes), _zeros(shapes))
            (_, _, g_blocks, g_rest, total, acc), _ = jax.lax.scan(tick, init, ops)
            return (jax.lax.psum(total, "pp"), g_blocks,
                    jax.tree.map(lambda g: jax.lax.psum(g, "pp"), g_rest), acc)

        out, g_blocks, g_rest, stats = self._shard_map(body, (P(), P("pp"), P(), P("pp")))(
            params[STACK], rest, inputs, targets)
        return self._objective(out, stats), {**g_rest, STACK: g_blocks}

    def value_and_grad(self, params, batch):
        """((loss, aux), grads) of the batch, as `jax.value_and_grad(loss_fn, has_aux=True)`."""
        if self.kind == "1f1b":
            return self._value_and_grad_1f1b(params, batch)
        return jax.value_and_grad(self.loss, has_aux=True)(params, batch)
