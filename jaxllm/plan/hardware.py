"""Accelerators the planner knows: datasheet peaks, or measured ceilings from a small file.

Each entry holds what the roofline and the ring formulas need, per GPU:

    flops      dense bf16 matmul FLOP/s (no sparsity)
    hbm_bw     HBM bandwidth, bytes/s
    hbm        HBM capacity, bytes
    nvlink_bw  NVLink bandwidth inside a host, bytes/s in one direction
    ib_bw      network bandwidth across hosts (InfiniBand / RoCE), bytes/s in one direction
    per_host   GPUs a host holds (the NVLink domain)

and what the per-kernel time model (`kernel_time.py`) adds, each optional:

    kernel_s       the fixed cost of one kernel launch inside a compiled program, seconds
                   (its launch, ramp-up and tail beyond its FLOPs or bytes)
    call_s         the host's time to run one compiled call that takes the model's decode
                   parameters and read its first result back (dispatch, launch, transfer):
                   TTFT's per-kernel model adds it once
    launch_s       the host's time to launch one kernel of a call: TTFT's per-kernel model
                   adds it for each of the prefill's kernels (a call from an idle device
                   does its host work before the device's, not beside it)
    attn_fwd       the flash attention kernel's forward FLOP/s (causal FLOPs, as counted)
    attn_bwd       its backward FLOP/s (2.5x the forward's FLOPs in the backward's time)
    gmm_flops      the grouped (MoE experts) matmul kernel's FLOP/s (forward + backward
                   at the training shape)
    matmul_shapes  FLOP/s of bf16 matmuls of given shapes, {"MxKxN": FLOP/s} (the FLOPs
                   over the time past `kernel_s`, the weights laid out as the program
                   using that shape holds them), used for matmuls of exactly that shape
                   in place of `flops`
    gmm_shapes     FLOP/s of the grouped matmul's forward at given shapes, {"MxKxNxG":
                   FLOP/s} (lhs [M, K] x rhs [G, K, N], the planned FLOPs of its row
                   tiles over the time past `kernel_s`), used for prefill and decode
                   products of exactly that shape in place of `gmm_flops`
    gemv_shapes    FLOP/s of the fused decode products (`kernels.pallas.gemv_triton`'s
                   `decode_gemv`, x [M, K] with weights [N, K]) at given shapes,
                   {"MxKxN": FLOP/s, over the time past `kernel_s`}

Datasheet figures are ceilings no program reaches; a measured-ceilings file (YAML or JSON)
replaces some of them with what a bf16 matmul and an HBM copy reach on the machine
(`benchmarks/plan_check.py --measure` writes one):

    base: h200            # the entry whose other fields are kept
    flops: 7.78e14
    hbm_bw: 3.31e12
    kernel_s: 3.0e-6
    call_s: 3.0e-4
    launch_s: 2.0e-6
    attn_fwd: 5.6e14
    matmul_shapes: {32768x2048x2048: 7.2e14}

Without them a kernel's FLOPs run at `flops`, the fixed cost is `KERNEL_S`, a call's
host time `CALL_S` and a launch's `LAUNCH_S`.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

GB = 1e9
# The fixed cost of a kernel inside a compiled program, when no measurement gives it: a
# launch from a CUDA graph and the ramp and tail of a small grid, a few microseconds on
# the GPUs listed (`benchmarks/plan_check.py --gpu` measures it as `kernel_s`).
KERNEL_S = 3e-6
# The host's time for one call of a compiled program over a model's decode parameters, to
# its first result on the host, when no measurement gives it (`plan_check.py --gpu`
# measures it as `call_s`: 0.25 ms for the 1B config's 99 arrays, 0.45 ms for the MLA
# config's 243 on an H100 host; it grows with the arrays and with a slower host).
CALL_S = 3e-4
# The host's time to launch one kernel of a call, when no measurement gives it
# (`plan_check.py --gpu` measures it as `launch_s`: 1.6-1.8 us on one H100 host, 2.6-3.2
# on another).
LAUNCH_S = 2e-6


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float
    hbm_bw: float
    hbm: float
    nvlink_bw: float
    ib_bw: float
    per_host: int = 8
    measured: bool = False  # ceilings from a measurement, not the datasheet
    kernel_s: float = KERNEL_S
    call_s: float = CALL_S
    launch_s: float = LAUNCH_S
    attn_fwd: float | None = None
    attn_bwd: float | None = None
    gmm_flops: float | None = None
    matmul_shapes: tuple[tuple[str, float], ...] = ()
    gmm_shapes: tuple[tuple[str, float], ...] = ()
    gemv_shapes: tuple[tuple[str, float], ...] = ()

    def matmul_rate(self, m: int, k: int, n: int) -> float:
        """FLOP/s of an [m, k] x [k, n] bf16 matmul: its measured rate, else `flops`."""
        key = f"{int(m)}x{int(k)}x{int(n)}"
        return dict(self.matmul_shapes).get(key, self.flops)

    def gmm_rate(self, m: int, k: int, n: int, groups: int) -> float:
        """FLOP/s of the grouped matmul [m, k] x [groups, k, n]: its measured forward rate
        at that shape, else `gmm_flops`, else `flops`."""
        key = f"{int(m)}x{int(k)}x{int(n)}x{int(groups)}"
        return dict(self.gmm_shapes).get(key, self.gmm_flops or self.flops)

    def gemv_rate(self, m: int, k: int, n: int) -> float:
        """FLOP/s of the fused decode product of x [m, k] with weights [n, k]: its measured
        rate at that shape, else `flops` (its bytes bound it)."""
        return dict(self.gemv_shapes).get(f"{int(m)}x{int(k)}x{int(n)}", self.flops)

    @property
    def ridge(self) -> float:
        """FLOPs per HBM byte above which a kernel is compute-bound (peak / bandwidth)."""
        return self.flops / self.hbm_bw


# NVLink: the datasheet's bidirectional figure halved. Networks: one 400 Gb/s NIC per GPU
# (ConnectX-7 NDR) on the H100 / H200 / H800 / B200 reference systems, 200 Gb/s (HDR) on A100.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM", 989e12, 3.35e12, 80 * GB, 450 * GB, 50 * GB),
    "h200": Hardware("H200 SXM", 989e12, 4.8e12, 141 * GB, 450 * GB, 50 * GB),
    "h800": Hardware("H800 SXM", 989e12, 3.35e12, 80 * GB, 200 * GB, 50 * GB),
    "a100": Hardware("A100 SXM 80GB", 312e12, 2.039e12, 80 * GB, 300 * GB, 25 * GB),
    "b200": Hardware("B200", 2250e12, 8.0e12, 180 * GB, 900 * GB, 50 * GB),
}
_FIELDS = ("flops", "hbm_bw", "hbm", "nvlink_bw", "ib_bw", "per_host", "kernel_s", "call_s",
           "launch_s", "attn_fwd", "attn_bwd", "gmm_flops", "matmul_shapes", "gmm_shapes",
           "gemv_shapes")
_SHAPE_KEYS = {"matmul_shapes": (r"\d+x\d+x\d+", "MxKxN"),
               "gmm_shapes": (r"\d+x\d+x\d+x\d+", "MxKxNxG"),
               "gemv_shapes": (r"\d+x\d+x\d+", "MxKxN")}


def get_hardware(name: str | Hardware, measured: str | Path | None = None) -> Hardware:
    """The table's entry `name` (case-insensitive), with the ceilings of a measured file
    (its `base` names the entry when `name` is not given one)."""
    if isinstance(name, Hardware):
        hw = name
    else:
        key = str(name).lower().replace(" ", "").replace("-", "").replace("sxm", "")
        if key not in HARDWARE:
            raise ValueError(f"hardware={name!r} is unknown; choose one of {sorted(HARDWARE)} "
                             f"or give measured ceilings with a base entry")
        hw = HARDWARE[key]
    return hw if measured is None else load_measured(measured, hw)


def detect_hardware(device_kind: str) -> str | None:
    """The table's entry for a JAX GPU's `device_kind` ("NVIDIA H100 80GB HBM3" -> "h100"),
    or None where it names none of them, another form of one (PCIe, NVL: other bandwidths
    and sizes) or another memory size (an A100 of 40 GB)."""
    if re.search(r"pcie|\bnvl\b", device_kind, re.I):
        return None
    for key, hw in HARDWARE.items():
        if re.search(rf"\b{key}\b", device_kind, re.I):  # "GH200" is not "H200"
            size = re.search(r"(\d+)\s*GB", device_kind, re.I)
            return key if size is None or int(size[1]) * GB == hw.hbm else None
    return None


def load_measured(path: str | Path, base: Hardware | None = None) -> Hardware:
    """A Hardware from a YAML/JSON file of measured ceilings over its `base` entry."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"measured ceilings file {str(path)!r} does not exist")
    text = path.read_text()
    raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of {_FIELDS} (and base); got {raw!r}")
    raw = dict(raw)
    if "base" in raw:
        base = get_hardware(raw.pop("base"))
    if base is None:
        raise ValueError(f"{path} names no base entry; add `base: h200` (or another of "
                         f"{sorted(HARDWARE)})")
    unknown = set(raw) - set(_FIELDS) - {"name"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; known: {list(_FIELDS)}")
    tables = {}
    for field, (pattern, form) in _SHAPE_KEYS.items():
        shapes = raw.pop(field, None) or {}
        if not isinstance(shapes, dict):
            raise ValueError(f"{path}: {field} must map \"{form}\" to FLOP/s; got {shapes!r}")
        for key, v in shapes.items():
            if not re.fullmatch(pattern, str(key)) or float(v) <= 0:
                raise ValueError(f"{path}: {field} entry {key!r}: {v!r} must be "
                                 f"\"{form}\": a positive FLOP/s")
        if shapes:
            tables[field] = tuple(sorted((str(k), float(v)) for k, v in shapes.items()))
    values = {k: (int(v) if k == "per_host" else float(v)) for k, v in raw.items() if k in _FIELDS}
    for k, v in values.items():
        if v <= 0:
            raise ValueError(f"{path}: {k}={v} must be positive")
    values.update(tables)
    name = raw.get("name", base.name + " (measured)")
    return dataclasses.replace(base, name=name, measured=True, **values)


def save_measured(path: str | Path, base: str, **ceilings) -> None:
    """Write a measured-ceilings file over the table's entry `base` (`matmul_shapes`,
    `gemv_shapes` and `gmm_shapes`: dicts of "MxKxN" / "MxKxNxG" -> FLOP/s; the other
    ceilings numbers)."""
    out = {k: (dict(v) if k in _SHAPE_KEYS else float(v)) for k, v in ceilings.items()}
    Path(path).write_text(yaml.safe_dump({"base": base, **out}, sort_keys=False))
