"""The hardware planner: memory, FLOPs, roofline and per-kernel times and communication
of a config.

    p = jaxllm.plan(cfg, hardware="h200", devices=8)
    print(jaxllm.plan.render(p))

    python -m jaxllm.plan --config configs/llama_1b.yaml --hardware h100 --devices 16

    hardware.py  datasheet peaks and measured ceilings      flops.py    FLOPs
    memory.py    per-device memory (training, KV cache)     comm.py     collectives per axis
    activations.py  what the backward reads, by layer kind  report.py   `plan`, the report
    roofline.py  intensity and times                        plot.py     the figures
    kernel_time.py  times as sums of the kernels each workload launches (counted in
                    kernel_train.py and kernel_infer.py)
    serving.py   the planner's serving figures beside a built engine's (`describe_serving`)
"""
import sys
import types

from jaxllm.plan.hardware import (HARDWARE, Hardware, detect_hardware, get_hardware,
                                  load_measured)
from jaxllm.plan.report import Plan, plan, render
from jaxllm.plan.serving import describe_serving


class _CallableModule(types.ModuleType):
    """`jaxllm.plan(cfg, ...)` calls `plan` while `jaxllm.plan.render` etc. stay reachable:
    importing this package binds it as `jaxllm.plan`, so the package is the call."""

    def __call__(self, *args, **kwargs):
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["HARDWARE", "Hardware", "Plan", "describe_serving", "detect_hardware", "get_hardware",
           "load_measured", "plan", "render"]
