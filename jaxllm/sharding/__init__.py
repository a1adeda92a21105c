"""Parallelism from the config's `parallelism:` section, kept out of model code.

    mesh.py       the device mesh (pp, dp, fsdp, ep, cp, tp) and multi-host start-up
    rules.py      the one table: logical axes -> mesh axes, by ZeRO stage
    constrain.py  `constrain(x, logical_axes)` for model code; no-op without a context
    context.py    context parallelism: ring / all-gather attention, load-balanced order
    experts.py    expert parallelism: the MoE layer's all-to-all over the ep axis
    plan.py       a training run's layouts: init, jit with shardings, batch placement
    pipeline.py   pipeline parallelism: the block stack in stages over pp, run by a schedule
    pipeline_schedule.py  the schedules (gpipe, circular, 1f1b) as tables; their bubbles
    memory.py     per-device memory of the model states vs the ZeRO formula
"""
from jaxllm.sharding.constrain import ShardingContext, active, constrain
from jaxllm.sharding.mesh import AXES, initialize_distributed, make_mesh, mesh_shape
from jaxllm.sharding.plan import ShardingPlan
from jaxllm.sharding.rules import RULES, Rules

__all__ = ["AXES", "RULES", "Rules", "ShardingContext", "ShardingPlan", "active", "constrain",
           "initialize_distributed", "make_mesh", "mesh_shape"]
