"""The device mesh: six named axes sized by the config's `parallelism:` section.

Axes, outermost (slowest links) first:

    pp    pipeline stages                      dp    data parallel (replicas)
    fsdp  data parallel, model states sharded  ep    experts
    cp    context (sequence) parallel          tp    tensor (Megatron) parallel

One axis may be -1 and takes the devices the others leave; the product must equal the
device count. Devices are laid out so the chatty inner axes (tp, then cp, then ep) stay
inside a host and the outer ones (pp, dp, fsdp) absorb the host count. Axes are `Auto`
(GSPMD propagates shardings); `jax.make_mesh` would default to `Explicit` in new jax.

Multi-host: call `initialize_distributed()` first in every process (coordinator address,
process count and id from flags, JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID, or a detected cluster such as SLURM); every process then builds the same
mesh over all devices and loads only its own rows of each batch.
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxllm.config import ConfigError, ParallelismConfig

AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")


def mesh_shape(p: ParallelismConfig, n_devices: int) -> dict[str, int]:
    """Axis sizes for `n_devices`, with a -1 axis resolved. Raises ConfigError on mismatch."""
    sizes = {a: getattr(p, a) for a in AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    described = " x ".join(f"{a}={v}" for a, v in sizes.items())
    free = [a for a, v in sizes.items() if v == -1]
    if free:
        if n_devices % fixed:
            raise ConfigError(f"parallelism {described}: the fixed axes take {fixed} devices, "
                              f"which does not divide the {n_devices} devices present")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(f"parallelism {described} needs {math.prod(sizes.values())} devices "
                          f"but {n_devices} are present; make the product equal {n_devices} "
                          f"or set one axis to -1 to take the remaining devices")
    return sizes


def _host_split(sizes: dict[str, int], n_hosts: int) -> dict[str, int]:
    """How many hosts each axis spans: outer axes first, so tp/cp/ep stay inside a host."""
    across, left = {}, n_hosts
    for a in AXES:
        across[a] = math.gcd(sizes[a], left)
        left //= across[a]
    if left != 1:
        raise ConfigError(f"cannot spread the mesh {sizes} over {n_hosts} hosts: no axis "
                          f"sizes share the host count's factors")
    return across


def make_mesh(p: ParallelismConfig, devices=None) -> Mesh:
    """The mesh for `p` over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(p, len(devices))
    shape = [sizes[a] for a in AXES]
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        across = _host_split(sizes, len(processes))
        per_host = [sizes[a] // across[a] for a in AXES]
        grid = mesh_utils.create_hybrid_device_mesh(per_host, [across[a] for a in AXES],
                                                    devices, process_is_granule=True)
    else:
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            # A subset of a TPU slice, or an unknown topology: plain order.
            grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe_mesh(mesh: Mesh) -> str:
    """One line: the axis sizes and where the devices are."""
    sizes = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    hosts = len({d.process_index for d in mesh.devices.flat})
    return (f"mesh {sizes} ({mesh.devices.size} x {mesh.devices.flat[0].device_kind}"
            f"{f', {hosts} hosts' if hosts > 1 else ''})")


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """Start multi-host JAX once per process. Returns True when it ran multi-process.

    Values come from the arguments, else JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID, else jax's cluster detection (SLURM, Open MPI, ...). With nothing at
    all set this is a single-process run and nothing happens. On the CPU the collectives
    go through gloo.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise ValueError(f"multi-host start needs the coordinator address, the number of "
                         f"processes and this process's id; got coordinator_address="
                         f"{coordinator_address!r}, num_processes={num_processes!r}, "
                         f"process_id={process_id!r}")
    if num_processes == 1:
        return False
    if coordinator_address is None and not _cluster_detected():
        return False
    if "cpu" in (env.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return jax.process_count() > 1


def _cluster_detected() -> bool:
    """A multi-task SLURM or MPI launch, whose variables jax reads by itself."""
    env = os.environ
    return (int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env
            or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
