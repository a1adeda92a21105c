"""Communication of one training step, per mesh axis, timed with the ring formulas.

For a collective over a group of n devices on a link of bandwidth W (bytes/s in one
direction), with M the bytes of the whole array (the gathered or reduced result):

    all-gather, reduce-scatter   (n - 1) / n · M / W
    all-reduce                   2 (n - 1) / n · M / W     (a reduce-scatter + an all-gather)
    all-to-all                   (n - 1) / n · M / W       (M: the bytes one device holds)
    ppermute                     M / W                     (M: the bytes one device sends)

A group stays on NVLink while it lies inside a host (`per_host` GPUs; the mesh keeps
tp, cp and ep inside first, `sharding/mesh.py`), else its ring runs at the network's
bandwidth. What each axis moves per step (dense; the MoE and pipeline terms are their own
functions, zero until the config has those sections):

    fsdp (and dp at ZeRO-3)  all-gather the parameters forward and again backward,
                             reduce-scatter the gradients
    dp                       ZeRO-0: all-reduce the gradients; 1: all-reduce them and
                             all-gather the updated parameters; 2: reduce-scatter + all-gather
    tp                       two all-reduces of the activations per layer forward and two
                             backward (with sequence parallelism each is a reduce-scatter
                             + all-gather: the same bytes); the forward again under remat
                             "full" and in 1f1b's backward ticks
    cp                       the ring passes key/value blocks cp - 1 times per layer
                             forward, keys/values and their gradients backward ("allgather":
                             all-gather / reduce-scatter of the same); gradients all-reduced
    ep                       all-to-all of the routed tokens, twice per MoE layer of the
                             stage each way, the forward's again where it is recomputed
                             (remat, 1f1b); dense parameters' gradients all-reduced like dp
    pp                       each microbatch's activations sent forward, their gradients back
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxllm.config import Config
from jaxllm.plan.flops import pipeline_of, stage_layers, stage_moe_layers
from jaxllm.plan.hardware import Hardware
from jaxllm.plan.memory import DTYPE_BYTES, StateBytes, local_tokens
from jaxllm.sharding.mesh import AXES, _host_split


@dataclass(frozen=True)
class Collective:
    axis: str  # mesh axis (or axes joined by "+")
    op: str  # all-gather, reduce-scatter, all-reduce, all-to-all, ppermute
    bytes: float  # M of the formulas above, per call
    count: float  # calls per step
    group: int
    link: str  # "nvlink" or "network"
    seconds: float  # all calls together
    what: str


def ring_seconds(op: str, nbytes: float, n: int, bandwidth: float) -> float:
    """One collective's time by the ring formulas (module docstring)."""
    if n <= 1:
        return 0.0
    factor = {"all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
              "all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n, "ppermute": 1.0}[op]
    return factor * nbytes / bandwidth


def links(sizes: dict[str, int], hw: Hardware) -> dict[str, str]:
    """Each axis's link: "network" when its groups span hosts."""
    n = math.prod(sizes.values())
    hosts = max(1, n // hw.per_host)
    if hosts == 1:
        return dict.fromkeys(AXES, "nvlink")
    across = _host_split(sizes, hosts)
    return {a: "network" if across[a] > 1 else "nvlink" for a in AXES}


def train_collectives(cfg: Config, sizes: dict[str, int], hw: Hardware,
                      states: StateBytes, psi_tp: float, micro: int = 1) -> list[Collective]:
    """Every collective of one training step. `psi_tp`: parameter bytes per device after
    the model-parallel (tp, ep) split only, i.e. what the data-parallel axes move."""
    m, t, p = cfg.model, cfg.train, cfg.parallelism
    link = links(sizes, hw)
    out: list[Collective] = []

    def add(axes: tuple[str, ...], op: str, nbytes: float, count: float, what: str):
        axes = tuple(a for a in axes if sizes[a] > 1)
        if not axes or nbytes <= 0 or count <= 0:
            return
        n = math.prod(sizes[a] for a in axes)
        kind = "network" if any(link[a] == "network" for a in axes) else "nvlink"
        bw = hw.ib_bw if kind == "network" else hw.nvlink_bw
        out.append(Collective("+".join(axes), op, nbytes, count, n, kind,
                              count * ring_seconds(op, nbytes, n, bw), what))

    stage = t.zero_stage
    # data-parallel axes: parameters and gradients
    param_axes = ("dp", "fsdp") if stage >= 3 else ("fsdp",)
    add(param_axes, "all-gather", psi_tp, 2, "parameters, forward and backward")
    grad_rs = ("dp", "fsdp") if stage >= 2 else ("fsdp",)
    add(grad_rs, "reduce-scatter", psi_tp, 1, "gradients")
    if stage < 2:
        add(("dp",), "all-reduce", psi_tp / sizes["fsdp"], 1, "gradients")
    if stage in (1, 2):
        add(("dp",), "all-gather", psi_tp / sizes["fsdp"], 1, "updated parameters")
    add(("cp", "ep"), "all-reduce", states.grads, 1, "gradients (replicated over the axis)")

    rows, seq = local_tokens(cfg, sizes, micro=micro)
    c = DTYPE_BYTES[m.dtype]
    layers = stage_layers(m, sizes["pp"])
    act = rows * seq * m.d_model * c  # one residual-stream activation per device
    # forwards a step runs of each layer: 1f1b runs the stage's again in its backward tick
    again = int(pipeline_of(cfg, sizes) == "1f1b")
    forwards = 1 + (m.remat == "full") + again
    if p.sequence_parallel:
        for op in ("reduce-scatter", "all-gather"):
            add(("tp",), op, act, 2 * (forwards + 1) * layers * micro,
                "activations, sequence parallel")
    else:
        add(("tp",), "all-reduce", act, 2 * (forwards + 1) * layers * micro,
            "activations (attention and MLP outputs)")
    hkv = m.n_kv_heads / sizes["tp"] if m.n_kv_heads % sizes["tp"] == 0 else m.n_heads / sizes["tp"]
    kv = rows * seq * 2 * hkv * m.resolved_head_dim * c  # this device's K and V block
    if p.cp_impl == "allgather":
        add(("cp",), "all-gather", kv * sizes["cp"], (forwards + 1) * layers * micro,
            "keys, values")
        add(("cp",), "reduce-scatter", kv * sizes["cp"], layers * micro, "key/value gradients")
    else:
        ring = (sizes["cp"] - 1) * layers * micro
        add(("cp",), "ppermute", kv, (forwards + 2) * ring, "key/value blocks and gradients")
    out += moe_collectives(cfg, sizes, hw, rows * seq * micro, link, again)
    # between stages each tp rank sends its own shard with sequence parallelism, else all
    sent = act / sizes["tp"] if p.sequence_parallel else act
    out += pipeline_collectives(cfg, sizes, hw, sent, micro, link)
    return out


def moe_collectives(cfg: Config, sizes, hw: Hardware, tokens: int, link,
                    again: int = 0) -> list[Collective]:
    """Expert parallelism: the dispatch and combine all-to-alls of the routed tokens (top_k
    copies of each) of each MoE layer of the device's stage, forward and backward, and
    the forward's again where the backward recomputes the routed experts (remat "dots" and
    "full"; `again`: the forwards a pipeline schedule reruns). None without `model.moe`."""
    m = cfg.model
    n_moe, ep = stage_moe_layers(m, sizes["pp"]), sizes["ep"]
    if n_moe == 0 or ep == 1:
        return []
    nbytes = tokens * m.moe.top_k * m.d_model * DTYPE_BYTES[m.dtype]
    kind = link["ep"]
    bw = hw.ib_bw if kind == "network" else hw.nvlink_bw
    count = 2 * (2 + (m.remat != "none") + again) * n_moe
    return [Collective("ep", "all-to-all", nbytes, count, ep, kind,
                       count * ring_seconds("all-to-all", nbytes, ep, bw),
                       "routed tokens, dispatch and combine")]


def pipeline_collectives(cfg: Config, sizes, hw: Hardware, act: float, micro: int,
                         link) -> list[Collective]:
    """Pipeline parallelism: every microbatch's activations to the next stage and their
    gradients back (circular schedules: once per repeat). None without pp."""
    pp = sizes["pp"]
    if pp == 1:
        return []
    repeats = getattr(cfg.parallelism, "pp_repeats", 1)
    kind = link["pp"]
    bw = hw.ib_bw if kind == "network" else hw.nvlink_bw
    count = 2 * micro * repeats
    return [Collective("pp", "ppermute", act, count, pp, kind,
                       count * ring_seconds("ppermute", act, pp, bw),
                       "activations forward, gradients backward")]
