"""Worker processes of the sharding tests, both ends.

The layouts train in worker scripts (tests/*_worker.py), each in a fresh Python with its own
number of simulated CPU devices and XLA without backend optimisation (3x faster compiles
on the CPU; the numbers are the same to float tolerance). A multi-host run is two of them
on localhost, 4 devices each, joined by `jax.distributed` over gloo.

    tests:    env(devices), run(worker, *args), two_hosts(worker, out)
    workers:  join(pid, port), fetch(tree), hosts(mesh)

This module imports no jax at the top, so the tests can set the environment first.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- tests


def env(devices: int) -> dict:
    """The environment of a worker with `devices` simulated CPU devices."""
    flags = (f"--xla_force_host_platform_device_count={devices} "
             "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def run(worker, *args, devices: int = 8, timeout: float = 600):
    """`python WORKER ARGS` on `devices` devices; fails with its stderr unless it exits 0
    (past `timeout` seconds it is killed)."""
    r = subprocess.run([sys.executable, str(worker), *map(str, args)], env=env(devices),
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def two_hosts(worker, out: Path, timeout: float = 300):
    """`python WORKER multihost OUT PID PORT` as processes 0 and 1 of a 2-host run, 4
    devices each, process 0 the coordinator on a free port of 127.0.0.1. Their output goes
    to OUT/process<PID>.log. Fails with the log of each process that did not exit 0. When
    one fails, its peer (which would wait in a collective until jax's own timeouts) is
    killed at once; past `timeout` seconds both are."""
    out = Path(out)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logs = [out / f"process{pid}.log" for pid in (0, 1)]
    procs, deadline, timed_out = [], time.monotonic() + timeout, False
    try:
        for pid, log in enumerate(logs):
            with open(log, "w") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, str(worker), "multihost", str(out), str(pid), str(port)],
                    env=env(4), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT))
        while True:
            codes = [p.poll() for p in procs]  # every one polled: a failure ends the wait
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    failed = [pid for pid, p in enumerate(procs) if p.returncode != 0]
    assert not failed, (
        (f"timed out after {timeout} s\n" if timed_out else "")
        + "\n".join(f"--- process {pid} exited {procs[pid].returncode}:\n"
                    + logs[pid].read_text()[-4000:] for pid in failed))


# ----------------------------------------------------------------------------- workers


def join(pid: int, port: int):
    """In a worker: become process `pid` of the 2-host run coordinated on 127.0.0.1:`port`
    (gloo collectives on the CPU), 4 of the 8 devices its own."""
    import jax

    from jaxllm.sharding import initialize_distributed

    initialize_distributed(f"127.0.0.1:{port}", 2, pid)
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4), \
        jax.devices()


def fetch(tree):
    """Every leaf of `tree` as one whole numpy array, in every process (multi-host: gathered
    from the processes that hold its parts)."""
    import jax

    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)


def hosts(mesh) -> list:
    """The process index of every device of `mesh`, mesh-shaped (pp, dp, fsdp, ep, cp, tp)."""
    import numpy as np
    return np.vectorize(lambda d: d.process_index)(mesh.devices).tolist()
