"""The training loop: one jitted step with donated state, evaluation, logging, checkpoints.

    summary = train(load_config("configs/tiny.yaml"))

Parameters and optimizer state are plain nested dicts (`nnx.to_pure_dict`), so optax,
orbax and the sharding rules see ordinary pytrees; the NNX graph is merged back inside the
jitted step.
"""
from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxllm.config import Config, ConfigError, load_config, save_config
from jaxllm.model import build_model
from jaxllm.model.moe import balance_aux, load_max_over_mean, update_expert_bias
from jaxllm.model.mtp import mtp_losses, mtp_objective
from jaxllm.sharding import ShardingPlan
from jaxllm.sharding.memory import describe_memory, step_memory
from jaxllm.sharding.pipeline import Pipeline, schedule_of
from jaxllm.tokenizer import load_tokenizer
from jaxllm.train import data as data_lib
from jaxllm.checkpoint import Checkpointer, has_checkpoints, load_model
from jaxllm.train.optim import lr_schedule, make_optimizer

# Dense bf16 peak FLOP/s by device kind (datasheet figures, without sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12,
              "B200": 2250e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12,
              "A10G": 70e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


def device_peak_flops() -> float | None:
    """Peak bf16 FLOP/s of all local devices together; None when unknown (e.g. the CPU)."""
    dev = jax.local_devices()[0]
    if dev.platform != "gpu":
        return None
    for name, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if name in dev.device_kind:
            return flops * jax.device_count()
    return None


@jax.named_scope("cross_entropy")
def cross_entropy(logits, targets):
    """Mean token cross-entropy in float32 (nats). logits (B, S, V), targets (B, S)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # the target's logit by a one-hot select-and-sum: it partitions over a vocab-sharded
    # axis everywhere, also inside the pipeline's shard_map, where XLA cannot split a gather
    hit = targets[..., None] == jnp.arange(logits.shape[-1], dtype=targets.dtype)
    picked = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    return jnp.mean(lse - picked)


def kl_divergence(teacher_logits, logits):
    """Mean over tokens of KL(softmax(teacher) || softmax(logits)) in float32 (nats)."""
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    s = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(t) * (t - s), axis=-1))


def teacher_fn(cfg: Config, plan: ShardingPlan) -> Callable:
    """batch -> the batch plus "teacher_logits" [B, S, V] of the model checkpointed at
    train.distill_from (a run directory; the vocabularies must match)."""
    teacher, tcfg, _ = load_model(cfg.train.distill_from)
    if tcfg.model.vocab_size != cfg.model.vocab_size:
        raise ValueError(f"train.distill_from={cfg.train.distill_from!r} has vocab_size="
                         f"{tcfg.model.vocab_size}, but model.vocab_size="
                         f"{cfg.model.vocab_size}; distillation needs the same vocabulary")
    graphdef, state = nnx.split(teacher)
    params = jax.device_put(nnx.to_pure_dict(state), plan.replicated)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    return lambda batch: {**batch, "teacher_logits": forward(params, batch["inputs"])}


@dataclass
class TrainFns:
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    step: Callable  # (params, opt_state, batch) -> (params, opt_state, metrics)
    eval: Callable  # (params, batch) -> {"loss"} (+ "expert_load" [L, E] with MoE layers,
    #                 the MTP modules' MoE blocks after the main ones)
    plan: ShardingPlan  # the mesh and every array's layout


def loss_fn(graphdef, params, batch, mtp_weight: float = 0.0):
    """(objective, aux). aux["loss"] is the main model's token cross-entropy; with MTP
    modules the objective adds mtp_weight x their mean loss, and aux holds each depth's
    loss and accuracy (mtp1_loss, mtp1_acc, ...). With MoE layers aux holds their
    balancing statistics (moe_*; expert_load [L, E], the main stack's MoE layers then the
    MTP modules' blocks) and, with moe.balance "aux_loss", the objective adds
    aux_loss_weight x the mean over those layers of their aux loss."""
    model = nnx.merge(graphdef, params)
    logits, h, moe_stats = model.forward(batch["inputs"])
    loss = objective = cross_entropy(logits, batch["targets"])
    aux = {"loss": loss}
    if "teacher_logits" in batch:  # distillation (train.distill_from): the KL replaces CE
        aux["distill_kl"] = objective = kl_divergence(batch["teacher_logits"], logits)
    if model.mtp is not None:
        losses, accs, mtp_stats = mtp_losses(model, h, batch["targets"])
        objective, more = mtp_objective(objective, losses, accs, mtp_weight)
        aux.update(more)
        if moe_stats:  # an MoE model's MTP blocks are MoE layers too, after the main ones
            moe_stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), moe_stats, mtp_stats)
    if moe_stats:
        objective, more = balance_aux(objective, moe_stats, model.cfg.moe)
        aux.update(more)
    return objective, aux


def make_train_fns(cfg: Config, graphdef, plan: ShardingPlan) -> TrainFns:
    tx = make_optimizer(cfg.train)
    w = cfg.train.mtp_weight
    value_and_grad = lambda p, b: jax.value_and_grad(lambda p: loss_fn(graphdef, p, b, w),
                                                     has_aux=True)(p)
    eval_fn = lambda p, b: {k: v for k, v in loss_fn(graphdef, p, b)[1].items()
                            if k in ("loss", "expert_load")}
    if cfg.parallelism.pp > 1:  # the blocks in stages over pp (1f1b: its own backward)
        pipe = Pipeline(cfg, graphdef, plan.mesh, cross_entropy)
        value_and_grad = pipe.value_and_grad
        eval_fn = lambda p, b: {k: v for k, v in pipe.loss(p, b)[1].items()
                                if k in ("loss", "expert_load")}

    moe = cfg.model.moe
    bias_rate = moe.bias_update_rate if moe is not None and moe.balance == "bias" else 0.0

    def step(params, opt_state, batch):
        (_, aux), grads = value_and_grad(params, batch)
        grads = plan.constrain_grads(grads)  # ZeRO-2/3: reduce-scatter, not all-reduce
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            new = optax.apply_updates(params, updates)
        load = aux.pop("expert_load", None)
        if bias_rate:  # auxiliary-loss-free balancing, outside the optimizer
            new = update_expert_bias(new, params, load, bias_rate)
        return new, opt_state, {**aux, "grad_norm": optax.tree.norm(grads)}

    return TrainFns(graphdef, tx, plan.jit_step(step, tx), plan.jit_eval(eval_fn), plan)


def sharding_plan(cfg: Config, devices=None) -> ShardingPlan:
    """The layout of `cfg`'s model and batches on its `parallelism:` mesh over `devices`."""
    make_model = lambda: build_model(cfg.model, rngs=nnx.Rngs(cfg.train.seed))
    return ShardingPlan.create(cfg, make_model, devices)


def init_state(cfg: Config, plan: ShardingPlan | None = None):
    """(graphdef, params, opt_state, fns) for a fresh model, created sharded by `plan`
    (default: the config's mesh over all devices)."""
    plan = plan or sharding_plan(cfg)
    params = plan.init_params()
    fns = make_train_fns(cfg, plan.graphdef, plan)
    return plan.graphdef, params, plan.init_opt_state(fns.tx, params), fns


def dry_run(cfg: Config) -> str:
    """The mesh, every parameter's layout, the pipeline schedule (pp > 1) and the compiled
    step's per-device memory beside the planner's, without allocating or training anything."""
    from jaxllm.plan.memory import describe_vs_compiled
    plan = sharding_plan(cfg)
    fns = make_train_fns(cfg, plan.graphdef, plan)
    mem = step_memory(fns.step, plan, fns.tx)
    pipeline = schedule_of(cfg).describe() + "\n" if cfg.parallelism.pp > 1 else ""
    return (plan.describe() + "\n" + pipeline + describe_memory(mem, cfg.train.zero_stage)
            + "\n" + describe_vs_compiled(cfg, mem, plan.mesh.size,
                                          plan.mesh.devices.flat[0].platform))


class _StopFlag:
    """SIGTERM and a first Ctrl-C set a flag the loop checks, so the run saves and exits
    cleanly between steps; a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.stop, self.signal_name, self._old = False, None, {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, _frame):
        if self.stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop, self.signal_name = True, signal.Signals(signum).name

    def __exit__(self, *_):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Logger:
    """metrics.jsonl plus a rich progress bar (or plain lines when not on a terminal)."""

    def __init__(self, cfg: Config, run_dir: Path, start_step: int):
        self.path = run_dir / "metrics.jsonl"
        self.total = cfg.train.steps
        # A resumed run keeps the records up to its checkpoint and rewrites the rest.
        kept = []
        if self.path.exists():
            kept = [l for l in self.path.read_text().splitlines()
                    if l.strip() and json.loads(l)["step"] <= start_step]
        self.file = open(self.path, "w")
        for line in kept:
            self.file.write(line + "\n")
        self.file.flush()
        self.progress = None
        self.console = None
        if jax.process_index() == 0:
            from rich.console import Console
            self.console = Console()
            if cfg.train.progress and self.console.is_terminal:
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                           TimeRemainingColumn)
                self.progress = Progress(
                    TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                    console=self.console)
                self.task = self.progress.add_task("train", total=self.total,
                                                   completed=start_step, info="")
                self.progress.start()

    def print(self, msg: str):
        if self.console is not None:
            self.console.print(msg, highlight=False)

    def record(self, rec: dict):
        if jax.process_index() == 0:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        info = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s"
        if rec.get("mfu") is not None:
            info += f"  MFU {100 * rec['mfu']:.1f}%"
        mtp = sorted(k[:-5] for k in rec if k.startswith("mtp") and k.endswith("_loss"))
        info += "".join(f"  {m} {rec[m + '_loss']:.3f} ({100 * rec[m + '_acc']:.0f}%)"
                        for m in mtp)
        if "moe_load_max" in rec:
            info += f"  expert load max/mean {rec['moe_load_max']:.2f}"
        if "distill_kl" in rec:
            info += f"  KL(teacher||model) {rec['distill_kl']:.4f}"
        if "eval_loss" in rec:
            info += f"  eval {rec['eval_loss']:.4f}"
        if "eval_moe_load_max" in rec:
            info += f" (expert load max/mean {rec['eval_moe_load_max']:.2f})"
        if self.progress is not None:
            self.progress.update(self.task, completed=rec["step"], info=info)
            if "eval_loss" in rec:
                self.print(f"step {rec['step']}: {info}")
        else:
            self.print(f"step {rec['step']:>6}/{self.total}  {info}  lr {rec['lr']:.2e}")

    def close(self):
        if self.progress is not None:
            self.progress.stop()
        self.file.close()


def evaluate(fns: TrainFns, params, cfg: Config, tokens: np.ndarray, place) -> dict:
    """Over a fixed set of validation batches (the same at every evaluation): `eval_loss`,
    their mean loss, and with MoE layers `eval_moe_load_max`, the worst layer's max/mean of
    the expert loads summed over all the batches (one figure for the whole set, not a mean
    of per-batch figures; the batches are the same size, so their load fractions add up as
    token counts do)."""
    t = cfg.train
    outs = []
    block, blocks = fns.plan.data_shard()  # this process's rows (shared across pp hosts)
    for i in range(t.eval_batches):
        batch = data_lib.get_batch(tokens, t.seq_len, t.batch_size, t.seed, i,
                                   stream=data_lib.EVAL_STREAM, host_id=block, num_hosts=blocks)
        outs.append(fns.eval(params, place(batch)))
    outs = jax.device_get(outs)
    rec = {"eval_loss": float(np.mean([o["loss"] for o in outs]))}
    if "expert_load" in outs[0]:
        load = np.sum([o["expert_load"] for o in outs], axis=0)  # [L, E]
        rec["eval_moe_load_max"] = float(load_max_over_mean(load))
    return rec


def check_resume(cfg: Config, run_dir: Path) -> None:
    """Refuse, before anything is written, to resume a run directory whose checkpoints were
    trained with another model (or tokenizer): name the differing keys and the fixes."""
    stored = run_dir / "config.yaml"
    if not stored.is_file() or not has_checkpoints(run_dir):
        return
    old = load_config(stored).to_dict()
    new = cfg.to_dict()
    keys = [("model", k) for k in new["model"] if old["model"].get(k) != new["model"][k]]
    keys += [("data", "tokenizer")] * (old["data"]["tokenizer"] != new["data"]["tokenizer"])
    if keys:
        diff = ", ".join(f"{s}.{k}={new[s][k]!r} (checkpoints: {old[s].get(k)!r})"
                         for s, k in keys)
        raise ConfigError(f"{run_dir} holds checkpoints of another model: {diff}; choose a "
                          f"new train.run_dir, or resume with the stored values "
                          f"(e.g. --config {run_dir})")


def train(cfg: Config, *, resume: bool = True, place_batch: Callable | None = None,
          stop_at: int | None = None, from_step: int | None = None) -> dict:
    """Train `cfg`; returns {'step', 'loss', 'eval_loss', 'run_dir', 'interrupted'}.

    Resumes from the run directory's newest intact checkpoint when there is one (and
    `resume`), or from the checkpoint of `from_step`; later checkpoints are moved aside.
    `stop_at` ends this call early at that step (saving a checkpoint) without changing the
    schedule, which still runs to train.steps; a later call continues from there.
    Nothing is written to the run directory until the inputs are checked and the
    checkpoint restored.
    """
    t = cfg.train
    run_dir = Path(t.run_dir)
    cfg.check()
    has_ckpt = has_checkpoints(run_dir)
    if has_ckpt and not resume:
        raise FileExistsError(f"{run_dir / 'checkpoints'} holds checkpoints; resume, or "
                              f"choose a new train.run_dir")
    if from_step is not None and not has_ckpt:
        raise FileNotFoundError(f"no checkpoints in {run_dir} to resume from step {from_step}")
    check_resume(cfg, run_dir)
    plan = sharding_plan(cfg)  # the mesh and batch checks, before any tokenizing
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but "
                         f"model.vocab_size={cfg.model.vocab_size}; raise model.vocab_size")
    data = data_lib.load_tokens(cfg.data, tokenizer)

    graphdef, params, opt_state, fns = init_state(cfg, plan)
    place = place_batch or fns.plan.place_batch
    if t.distill_from:  # the teacher's logits ride along with every batch
        place = (lambda put, teach: lambda b: teach(put(b)))(place, teacher_fn(cfg, fns.plan))
    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    start = 0
    if has_ckpt:
        try:
            params, opt_state, start = ckpt.restore(params, opt_state, from_step)
        except Exception:
            ckpt.close()
            raise
        ckpt.set_aside_after(start)  # damaged, or to be written again from this step on
    save_config(cfg, run_dir / "config.yaml")
    logger = _Logger(cfg, run_dir, start)
    n_params = cfg.model.num_params()
    active = cfg.model.num_params(active=True)
    logger.print(f"model: {n_params / 1e6:.2f}M parameters"
                 + (f" ({active / 1e6:.2f}M active)" if active != n_params else "")
                 + f"; data: {len(data.train):,} train / {len(data.val):,} val tokens; "
                 f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}"
                 + (f"; resumed at step {start}" if start else ""))
    logger.print(fns.plan.describe().splitlines()[0] + "\n"
                 + describe_memory(step_memory(fns.step, fns.plan, fns.tx), t.zero_stage))

    schedule = lr_schedule(t)
    peak = device_peak_flops()
    flops_per_token = cfg.model.flops_per_token(t.seq_len)
    tokens_per_step = t.batch_size * t.seq_len
    pending = []
    interrupted, last_loss, eval_loss = False, float("nan"), None
    tick, tick_step = time.perf_counter(), start

    def check_finite(upto_step):
        """Fetch pending losses; raise if any is not finite. Returns the last one."""
        vals = [float(x) for x in jax.device_get([m["loss"] for m in pending])]
        pending.clear()
        for i, v in enumerate(vals):
            if not math.isfinite(v):
                ckpt.wait()
                raise NonFiniteLoss(
                    f"loss became {v} at or before step {upto_step}; stopping. The last good "
                    f"checkpoint (step {ckpt.latest_step()}) is kept in {ckpt.dir}. Lower "
                    f"train.lr (now {t.lr}) or raise train.warmup_steps.")
        return vals[-1] if vals else float("nan")

    step = start
    block, blocks = fns.plan.data_shard()  # this process's rows (shared across pp hosts)
    try:
        with _StopFlag() as flag:
            while step < t.steps:
                batch = data_lib.get_batch(data.train, t.seq_len, t.batch_size, t.seed, step,
                                           host_id=block, num_hosts=blocks)
                params, opt_state, metrics = fns.step(params, opt_state, place(batch))
                pending.append(metrics)
                if len(pending) > 1:  # at most one step in flight, so a signal acts within one
                    jax.block_until_ready(pending[-2]["loss"])
                step += 1
                is_log = step % t.log_every == 0 or step == t.steps
                is_eval = step % t.eval_every == 0 or step == t.steps
                # A stop (a signal, read once here, or stop_at) saves as a periodic save
                # does: once, even where it lands on a checkpoint step.
                signalled = flag.stop
                stopping = signalled or (stop_at is not None and step >= stop_at)
                is_save = step % cfg.checkpoint.every == 0 or step == t.steps or stopping
                if is_log or is_save:
                    last_loss = check_finite(step)
                if is_log:
                    now = time.perf_counter()
                    tps = (step - tick_step) * tokens_per_step / (now - tick)
                    rec = {"step": step, "loss": last_loss, "lr": float(schedule(step - 1)),
                           "tokens_per_s": tps,
                           "mfu": tps * flops_per_token / peak if peak else None}
                    rec.update({k: float(v) for k, v in jax.device_get(metrics).items()
                                # MTP, distillation, MoE
                                if k.startswith(("mtp", "distill", "moe"))})
                    if is_eval:
                        rec.update(evaluate(fns, params, cfg, data.val, place))
                        eval_loss = rec["eval_loss"]
                    logger.record(rec)
                    tick, tick_step = time.perf_counter(), step
                if is_save and cfg.checkpoint.enabled:
                    ckpt.save(step, params, opt_state, force=True)
                if signalled:
                    interrupted = True
                    saved = "checkpoint saved" if cfg.checkpoint.enabled else "no checkpoint"
                    logger.print(f"stopped by {flag.signal_name} at step {step}; {saved}")
                if stopping:
                    break
    finally:
        ckpt.close()
        logger.close()
    return {"step": step, "loss": last_loss, "eval_loss": eval_loss, "run_dir": str(run_dir),
            "interrupted": interrupted}
