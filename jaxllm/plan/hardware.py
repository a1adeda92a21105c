"""Accelerators the planner knows: datasheet peaks, or measured ceilings from a small file.

Each entry holds what the roofline and the ring formulas need, per GPU:

    flops      dense bf16 matmul FLOP/s (no sparsity)
    hbm_bw     HBM bandwidth, bytes/s
    hbm        HBM capacity, bytes
    nvlink_bw  NVLink bandwidth inside a host, bytes/s in one direction
    ib_bw      network bandwidth across hosts (InfiniBand / RoCE), bytes/s in one direction
    per_host   GPUs a host holds (the NVLink domain)

Datasheet figures are ceilings no program reaches; a measured-ceilings file (YAML or JSON)
replaces some of them with what a bf16 matmul and an HBM copy reach on the machine
(`benchmarks/plan_check.py --measure` writes one):

    base: h200            # the entry whose other fields are kept
    flops: 7.78e14
    hbm_bw: 3.31e12
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

GB = 1e9


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
_FIELDS = ("flops", "hbm_bw", "hbm", "nvlink_bw", "ib_bw", "per_host")


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
    values = {k: (int(v) if k == "per_host" else float(v)) for k, v in raw.items() if k in _FIELDS}
    for k, v in values.items():
        if v <= 0:
            raise ValueError(f"{path}: {k}={v} must be positive")
    name = raw.get("name", base.name + " (measured)")
    return dataclasses.replace(base, name=name, measured=True, **values)


def save_measured(path: str | Path, base: str, **ceilings: float) -> None:
    """Write a measured-ceilings file over the table's entry `base`."""
    Path(path).write_text(yaml.safe_dump({"base": base, **ceilings}, sort_keys=False))
