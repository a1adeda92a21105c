"""The planner's figures (matplotlib, Agg): the roofline with the config's operating points,
memory per device by component across ZeRO stages and layouts, TPOT and tokens/s by batch."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxllm.plan.memory import train_memory
from jaxllm.plan.report import GiB, Plan
from jaxllm.plan.roofline import decode_point, prefill_point
from jaxllm.sharding.mesh import mesh_shape

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_roofline(p: Plan, path: Path) -> Path:
    plt = _pyplot()
    hw = p.hardware
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [10 ** (k / 10) for k in range(-10, 51)]
    ax.loglog(xs, [min(hw.flops, x * hw.hbm_bw) / 1e12 for x in xs], "k-", lw=1.5,
              label=f"{hw.name} roofline")
    ax.axvline(hw.ridge, color="gray", ls=":", lw=1)
    tp = p.sizes["tp"]
    points = [p.train, prefill_point(p.cfg, 1, p.prompt_len, tp)]
    points += [decode_point(p.cfg, b, p.context, tp) for b in (1, 8, 32, 128)]
    for pt in points:
        achieved = pt.flops / pt.seconds(hw) / 1e12
        ax.plot(pt.intensity, achieved, "o")
        ax.annotate(pt.name, (pt.intensity, achieved), textcoords="offset points",
                    xytext=(5, -12), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel("TFLOP/s per GPU")
    ax.set_title(f"roofline: {p.cfg.model.num_params() / 1e9:.2f}B on {hw.name}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def memory_layouts(p: Plan) -> dict[str, dict[str, float]]:
    """Per-device training memory by component for ZeRO 0-3 over dp, and fsdp / tp layouts."""
    n = p.devices
    out = {}
    layouts = [(f"dp{n} ZeRO-{z}", {"dp": n, "fsdp": 1, "tp": 1}, z) for z in range(4)]
    layouts += [(f"fsdp{n}", {"dp": 1, "fsdp": n, "tp": 1}, 0)]
    if n % 8 == 0:
        layouts += [(f"fsdp{n // 8} tp8", {"dp": 1, "fsdp": n // 8, "tp": 8}, 0)]
    for name, axes, zero in layouts:
        par = dataclasses.replace(p.cfg.parallelism, pp=1, ep=1, cp=1, **axes)
        cfg = p.cfg.replace(parallelism=par)
        rows = cfg.train.batch_size
        if rows % (axes["dp"] * axes["fsdp"]):
            continue
        mem = train_memory(cfg, mesh_shape(par, n), zero_stage=zero)
        out[name] = {k: v for k, v in mem.as_dict().items() if k != "total"}
    return out


def plot_memory(p: Plan, path: Path) -> Path:
    plt = _pyplot()
    layouts = memory_layouts(p)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottom = [0.0] * len(layouts)
    for comp in next(iter(layouts.values())):
        vals = [layouts[n][comp] / GiB for n in layouts]
        ax.bar(list(layouts), vals, bottom=bottom, label=comp)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(p.hardware.hbm / GiB, color="k", ls="--", lw=1, label="HBM")
    ax.set_ylabel("GiB per device")
    ax.set_title(f"training memory per device ({p.devices} x {p.hardware.name})")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_decode(p: Plan, path: Path) -> Path:
    plt = _pyplot()
    hw, tp = p.hardware, p.sizes["tp"]
    batches = [b for b in DECODE_BATCHES if b <= max(1, p.max_batch)]
    tpot = [decode_point(p.cfg, b, p.context, tp).seconds(hw) for b in batches]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.semilogx(batches, [t * 1e3 for t in tpot], "o-", color="C0", base=2)
    ax.set_xlabel("decode batch")
    ax.set_ylabel("TPOT (ms)", color="C0")
    ax2 = ax.twinx()
    ax2.semilogx(batches, [b / t for b, t in zip(batches, tpot)], "s-", color="C1", base=2)
    ax2.set_ylabel("tokens/s per replica", color="C1")
    ax.set_title(f"decode roofline at context {p.context} ({hw.name}, tp={tp})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(p: Plan, folder: str | Path) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [plot_roofline(p, folder / "roofline.png"), plot_memory(p, folder / "memory.png"),
            plot_decode(p, folder / "decode.png")]
