"""Runs the expert-parallel layouts of tests/test_experts.py in a fresh process.

    python tests/experts_worker.py OUT   # one device + every layout -> OUT/<name>.npz
    python tests/experts_worker.py multihost OUT PID PORT  # one of 2 processes, 4 devices
                                         # each: the MULTIHOST layouts -> OUT/multihost_*

Its own process, as tests/sharding_worker.py, so that XLA compiles without backend
optimisation (3x faster compiles on the CPU; the numbers are the same to float tolerance).
Each .npz holds the loss ("loss") and every gradient leaf of the tiny MoE model on one
batch, or the traceback ("error") of a layout that failed.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import processes

# one MoE layer (8 experts, top-2, the selection bias) and one MTP module (its block an MoE
# block too, its loss in the objective), small enough to compile fast
MODEL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.n_layers=1",
         "model.moe.dense_layers=0", "model.moe.num_shared_experts=0",
         "model.moe.expert_mlp_dim=16", "model.init_std=0.3", "model.mtp_depth=1",
         "train.batch_size=8", "train.seq_len=16"]
MTP_WEIGHT = 0.5
LAYOUTS = {  # ep alone, with fsdp and tp (the expert width split), with dp; no ep
    "ep8": ["parallelism.dp=1", "parallelism.ep=8"],
    "ep2_fsdp2_tp2": ["parallelism.dp=1", "parallelism.fsdp=2", "parallelism.ep=2",
                      "parallelism.tp=2"],
    "ep4_dp2": ["parallelism.dp=2", "parallelism.ep=4"],
    "dp4_tp2": ["parallelism.dp=4", "parallelism.tp=2"],  # every expert on each device
}
# 2 processes x 4 devices. The mesh spreads its outermost axis larger than 1 over the hosts
# and keeps the inner ones inside a host: ep spans them in ep8 and ep4_tp2, fsdp and dp
# in the other two layouts, whose ep groups stay inside a host. {name: (overrides, the
# axis across the hosts)}
MULTIHOST = {
    "ep8": (LAYOUTS["ep8"], "ep"),
    "ep4_tp2": (["parallelism.dp=1", "parallelism.ep=4", "parallelism.tp=2"], "ep"),
    "ep2_fsdp2_tp2": (LAYOUTS["ep2_fsdp2_tp2"], "fsdp"),
    "ep4_dp2": (LAYOUTS["ep4_dp2"], "dp"),
}


def config(overrides):
    from jaxllm.config import load_config
    return load_config("configs/tiny_moe.yaml", MODEL + overrides)


def loss_and_grads(plan, params, batch) -> dict:
    """{"loss", every gradient leaf by its path} of the model's objective on `batch`."""
    import jax
    import numpy as np

    from jaxllm.sharding.constrain import traced_in
    from jaxllm.train.trainer import loss_fn

    fn = jax.value_and_grad(lambda p, b: loss_fn(plan.graphdef, p, b, MTP_WEIGHT)[0])
    step = jax.jit(traced_in(plan.context, fn), in_shardings=(plan.params, plan.batch),
                   out_shardings=(plan.replicated, plan.shardings("grads")))
    loss, grads = step(jax.device_put(params, plan.params), plan.place_batch(batch))
    flat = jax.tree_util.tree_flatten_with_path(processes.fetch(grads))[0]
    return {"loss": np.asarray(loss), **{jax.tree_util.keystr(p): g for p, g in flat}}


def single_device():
    """(the one-device plan, its initial parameters on the host, the batch: 8 rows)."""
    import jax
    import numpy as np

    from jaxllm.train.trainer import sharding_plan

    tokens = np.random.default_rng(0).integers(0, 258, size=(8, 17)).astype(np.int32)
    plan = sharding_plan(config(["parallelism.dp=1"]), jax.local_devices()[:1])
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return plan, jax.device_get(plan.init_params()), batch


def layout(overrides):
    """The plan of a layout, checked to put the experts ([L, E, d, f]) on ep."""
    from jaxllm.train.trainer import sharding_plan

    plan = sharding_plan(config(overrides))
    ep = plan.mesh.shape["ep"]
    assert plan.params["blocks"]["mlp"]["gate"].spec[1] == ("ep" if ep > 1 else None)
    return plan


def run(out: Path):
    import numpy as np

    single, params, batch = single_device()
    np.savez(out / "single.npz", **loss_and_grads(single, params, batch))
    for name, overrides in LAYOUTS.items():
        try:
            np.savez(out / f"{name}.npz", **loss_and_grads(layout(overrides), params, batch))
        except Exception:  # reported by the test of this layout
            np.savez(out / f"{name}.npz", error=traceback.format_exc())


def run_multihost(out: Path, pid: int, port: int):
    """Process `pid` of 2: every MULTIHOST layout, each process loading its block of the
    batch rows. Process 0 writes multihost_<name>.npz and multihost.json (the mesh-shaped
    process index of each device, per layout). A failure ends the process (its peer is
    stopped by the test)."""
    import jax
    import numpy as np

    processes.join(pid, port)
    _, params, batch = single_device()  # on each process's first device: the same values
    hosts = {}
    for name, (overrides, _) in MULTIHOST.items():
        plan = layout(overrides)
        block, blocks = plan.data_shard()
        mine = {k: np.split(v, blocks)[block] for k, v in batch.items()}
        result = loss_and_grads(plan, params, mine)
        hosts[name] = processes.hosts(plan.mesh)
        if pid == 0:
            np.savez(out / f"multihost_{name}.npz", **result)
    if pid == 0:
        (out / "multihost.json").write_text(json.dumps(hosts))
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1] == "multihost":
        run_multihost(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        run(Path(sys.argv[1]))
