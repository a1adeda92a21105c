"""Every kernel implementation, declared once with what it supports; `pick` chooses one.

Ops and their arguments (what `pick` and an entry's `check` receive as inputs):

  flash    q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [.., Dv]  (kernels.flash_attention)
  paged    q [B, Hq, D], k_pages [(L,) Hkv, P, page, D]        (kernels.paged_attention)
  decode   q [B, S, Hq, D], k_cache [B, Hkv, T, D]             (kernels.decode_attention)
  ragged   q [T, Hq, D], k_pages [(L,) Hkv, P, page, D]        (kernels.ragged_paged_attention)
  matmul   x [M, K], w (out-major), epilogue                   (kernels.decode_matmul)
  gmm      lhs [M, K], rhs [G, K, N], group_sizes [G]          (kernels.grouped_matmul)
  mla      q [B, Hq, Dk], kv_pages [(L,) P, page, Dk], v_dim     (kernels.mla_decode)

Targets are "module:function" strings, imported on first use, so importing jaxllm never
imports Pallas or a backend the device cannot run. The dtype and head dim an entry
declares are those of the first input (its last axis is the head dim).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Callable

import jax
import jax.numpy as jnp

OPS = {"flash": "flash attention", "paged": "paged attention", "decode": "decode attention",
       "matmul": "decode matmul", "ragged": "ragged paged attention",
       "gmm": "grouped matmul", "mla": "MLA decode"}


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op and the inputs it takes."""
    op: str
    name: str
    target: str  # "module:function"
    platforms: tuple[str, ...] | None = None  # jax backends it runs on; None: any
    hopper: bool = False  # on a GPU, needs Hopper or newer
    dtypes: tuple[str, ...] | None = None  # None: any floating dtype
    head_dims: tuple[int, ...] | None = None
    with_lse: str | None = None  # its `*_with_lse` function ("module:function"), if any
    check: str | None = None  # the kernel's own `unsupported_reason(*inputs)`, if any

    @property
    def returns_lse(self) -> bool:
        return self.with_lse is not None


@dataclasses.dataclass(frozen=True)
class AutoOrder:
    """What "auto" tries, in order, for `op` on `platform` (None: any other backend) with
    inputs of these head dims (None: any) and at least `min_rows` rows in the first input's
    second-to-last axis (query heads of MLA decode, lhs rows of the grouped matmul). The
    first rule that matches applies."""
    op: str
    platform: str | None
    names: tuple[str, ...]
    head_dims: tuple[int, ...] | None = None
    min_rows: int = 0


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `pick` returns: the entry's name, its function and, with need_lse, the
    function that also returns the log-sum-exp."""
    name: str
    fn: Callable
    fn_with_lse: Callable | None = None


_REF, _XLA = "jaxllm.kernels.reference", "jaxllm.kernels.xla"
_PALLAS = "jaxllm.kernels.pallas"
_INTERPRETED = ("gpu", "cpu")  # Pallas: compiled on the GPU, interpreted on the CPU
_HALF = ("bfloat16", "float16")

IMPLS = (
    Impl("flash", "reference", f"{_REF}:flash_attention",
         with_lse=f"{_REF}:flash_attention_with_lse"),
    # plain einsums; its math is the reference's, whose LSE function stands in for it
    Impl("flash", "xla", f"{_XLA}:xla_attention", with_lse=f"{_REF}:flash_attention_with_lse"),
    Impl("flash", "cudnn", f"{_XLA}:cudnn_attention", platforms=("gpu",), dtypes=_HALF,
         check=f"{_XLA}:cudnn_unsupported_reason"),
    Impl("flash", "pallas_triton", f"{_PALLAS}.flash_triton:flash_attention",
         platforms=_INTERPRETED, with_lse=f"{_PALLAS}.flash_triton:flash_attention_with_lse",
         check=f"{_PALLAS}.flash_triton:unsupported_reason"),
    Impl("flash", "pallas_mosaic", f"{_PALLAS}.flash_mosaic:flash_attention",
         platforms=_INTERPRETED, hopper=True, dtypes=_HALF, head_dims=(64, 128, 192, 256),
         with_lse=f"{_PALLAS}.flash_mosaic:flash_attention_with_lse",
         check=f"{_PALLAS}.flash_mosaic:unsupported_reason"),
    Impl("paged", "reference", f"{_REF}:paged_attention"),
    Impl("paged", "pallas_triton", f"{_PALLAS}.paged_triton:paged_attention",
         platforms=_INTERPRETED, check=f"{_PALLAS}.paged_triton:unsupported_reason"),
    Impl("decode", "xla", f"{_XLA}:decode_attention"),
    Impl("decode", "pallas_triton", f"{_PALLAS}.paged_triton:decode_attention",
         platforms=_INTERPRETED, check=f"{_PALLAS}.paged_triton:decode_unsupported_reason"),
    Impl("ragged", "reference", f"{_REF}:ragged_paged_attention"),
    Impl("ragged", "pallas_triton", f"{_PALLAS}.ragged_triton:ragged_paged_attention",
         platforms=_INTERPRETED, check=f"{_PALLAS}.ragged_triton:unsupported_reason"),
    Impl("matmul", "xla", f"{_XLA}:decode_gemv"),
    Impl("matmul", "pallas_triton", f"{_PALLAS}.gemv_triton:decode_gemv",
         platforms=_INTERPRETED, check=f"{_PALLAS}.gemv_triton:unsupported_reason"),
    Impl("gmm", "reference", f"{_REF}:grouped_matmul"),
    Impl("gmm", "xla", f"{_XLA}:grouped_matmul"),
    Impl("gmm", "pallas_triton", f"{_PALLAS}.gmm_triton:grouped_matmul",
         platforms=_INTERPRETED, check=f"{_PALLAS}.gmm_triton:unsupported_reason"),
    # forward and d lhs on Hopper's wgmma/TMA; d rhs through gmm_triton's kernel
    Impl("gmm", "pallas_mosaic", f"{_PALLAS}.gmm_mosaic:grouped_matmul",
         platforms=_INTERPRETED, hopper=True, dtypes=_HALF,
         check=f"{_PALLAS}.gmm_mosaic:unsupported_reason"),
    Impl("mla", "reference", f"{_REF}:mla_decode"),
    Impl("mla", "pallas_triton", f"{_PALLAS}.mla_triton:mla_decode",
         platforms=_INTERPRETED, check=f"{_PALLAS}.mla_triton:unsupported_reason"),
    Impl("mla", "pallas_mosaic", f"{_PALLAS}.mla_mosaic:mla_decode",
         platforms=_INTERPRETED, hopper=True, dtypes=_HALF,
         check=f"{_PALLAS}.mla_mosaic:unsupported_reason"),
)

# The fastest correct implementation first (docs/performance.md). Flash: our Mosaic kernel
# leads cuDNN at D 128, forward and forward+backward; cuDNN leads forward+backward at
# D 64 and 256. D 192 is MLA's (v head dim 128), which cuDNN through
# jax.nn.dot_product_attention does not take: pallas_mosaic runs it 2.6x faster than
# pallas_triton (which pads 192 to 256) forward+backward, at 0.97x cuDNN's own 192/128 path
# (benchmarks/mla.py). Every order ends with an implementation that takes any input.
AUTO = (
    AutoOrder("flash", "gpu", ("pallas_mosaic", "cudnn", "pallas_triton", "xla"),
              head_dims=(128, 192)),
    AutoOrder("flash", "gpu", ("cudnn", "pallas_mosaic", "pallas_triton", "xla")),
    AutoOrder("flash", None, ("reference",)),
    AutoOrder("paged", "gpu", ("pallas_triton", "reference")),
    AutoOrder("paged", None, ("reference",)),
    AutoOrder("decode", "gpu", ("pallas_triton", "xla")),
    AutoOrder("decode", None, ("xla",)),
    AutoOrder("ragged", "gpu", ("pallas_triton", "reference")),
    AutoOrder("ragged", None, ("reference",)),
    AutoOrder("matmul", "gpu", ("pallas_triton", "xla")),
    AutoOrder("matmul", None, ("xla",)),
    # Grouped matmul (benchmarks/grouped_matmul.py, 64 experts, d 2048, width 1408, 16k
    # tokens top-8, 131072 rows): the Mosaic kernel's forward and d lhs at 0.79-0.85x a
    # dense matmul of the same FLOPs against the Triton kernel's 0.68-0.77x. Below 32768
    # rows (prefill, decode: a few rows an expert, where the Triton kernel's row tiles
    # follow the rows per expert) the Triton kernel.
    AutoOrder("gmm", "gpu", ("pallas_mosaic", "pallas_triton", "xla"), min_rows=32768),
    AutoOrder("gmm", "gpu", ("pallas_triton", "xla")),
    AutoOrder("gmm", None, ("xla",)),
    # MLA decode (benchmarks/mla_decode.py, B 64, ctx 4096, H100): the Mosaic kernels
    # above 16 heads (32 heads, the narrow kernel: 126 against 152 us; 64: 124 against
    # 261; 128: 201 against 367), the Triton one at 16 or fewer (16: 119 against the
    # narrow kernel's 127 us).
    AutoOrder("mla", "gpu", ("pallas_mosaic", "pallas_triton", "reference"), min_rows=17),
    AutoOrder("mla", "gpu", ("pallas_triton", "pallas_mosaic", "reference")),
    AutoOrder("mla", None, ("reference",)),
)


def _platform() -> str:
    return jax.default_backend()


def _hopper() -> bool:
    """Whether the first device is a Hopper or newer GPU (compute capability >= 9.0)."""
    try:
        return float(getattr(jax.devices()[0], "compute_capability", "0")) >= 9.0
    except ValueError:
        return False


def _entries(op: str) -> dict[str, Impl]:
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; choose one of {list(OPS)}")
    return {e.name: e for e in IMPLS if e.op == op}


def names(op: str) -> tuple[str, ...]:
    """The valid `impl` choices of `op`, "auto" first (for config validation and errors)."""
    return ("auto", *_entries(op))


def _load(target: str) -> Callable:
    module, fn = target.split(":")
    return getattr(importlib.import_module(module), fn)


def _unavailable(e: Impl) -> str | None:
    """None when `e` can run on this machine, else why not."""
    platform = _platform()
    if e.platforms is not None and platform not in e.platforms:
        return f"runs on {' or '.join(e.platforms)}, not on backend {platform!r}"
    if e.hopper and platform == "gpu" and not _hopper():
        return f"needs a Hopper or newer GPU (device is {jax.devices()[0].device_kind!r})"
    try:
        _load(e.target)
    except (ImportError, AttributeError) as err:
        return f"is not built ({type(err).__name__}: {err})"
    return None


def available(op: str) -> list[str]:
    """The implementations of `op` that can run here (whatever the inputs)."""
    return [n for n, e in _entries(op).items() if _unavailable(e) is None]


def _rejects(e: Impl, args) -> str | None:
    """None when `e` takes these inputs (or none are given), else why not."""
    if not args:
        return None
    dtype, d = jnp.dtype(args[0].dtype).name, args[0].shape[-1]
    if e.dtypes is not None and dtype not in e.dtypes:
        return f"{dtype} inputs (it takes {' or '.join(e.dtypes)})"
    if e.head_dims is not None and d not in e.head_dims:
        return f"head_dim={d} (it takes {' or '.join(map(str, e.head_dims))})"
    return _load(e.check)(*args) if e.check else None


def auto_order(op: str, platform: str, head_dim: int | None = None,
               rows: int | None = None) -> tuple[str, ...]:
    """What "auto" tries for `op` on `platform` ("gpu", "cpu", ...) with inputs of this
    head dim and rows (None: unknown), in order: the first matching rule of AUTO. The
    planner asks it without arrays; `pick` with the inputs' own."""
    return next(r.names for r in AUTO if r.op == op and r.platform in (platform, None)
                and (r.head_dims is None or head_dim in r.head_dims)
                and (not r.min_rows or (rows is not None and rows >= r.min_rows)))


def _auto_order(op: str, args) -> tuple[str, ...]:
    d, rows = (args[0].shape[-1], args[0].shape[-2]) if args else (None, None)
    return auto_order(op, _platform(), d, rows)


def _choice(e: Impl, need_lse: bool) -> Choice:
    return Choice(e.name, _load(e.target), _load(e.with_lse) if need_lse else None)


def pick(op: str, impl: str = "auto", *args, need_lse: bool = False) -> Choice:
    """The implementation of `op` to run: `impl` by name, or for "auto" the first of the
    op's auto order that runs here and takes `args` (inputs as arrays or
    ShapeDtypeStructs; none: skip the input checks). With need_lse, only entries that
    return the log-sum-exp. Raises ValueError naming the choices otherwise."""
    entries, label = _entries(op), OPS[op]
    if impl == "auto":
        why = {}
        for name in _auto_order(op, args):
            e = entries[name]
            why[name] = ("returns no log-sum-exp" if need_lse and not e.returns_lse
                         else _unavailable(e) or _rejects(e, args))
            if why[name] is None:
                return _choice(e, need_lse)
        raise ValueError(f"no {label} impl takes these inputs here: "
                         + "; ".join(f"{n}: {w}" for n, w in why.items()))
    if impl not in entries:
        close = difflib.get_close_matches(str(impl), entries, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {label} impl {impl!r}{hint}; choose one of {names(op)}")
    e = entries[impl]
    why = _unavailable(e)
    if why:
        raise ValueError(f"{label} impl {impl!r} is not available here: {why}; "
                         f"available: {available(op)}")
    if need_lse and not e.returns_lse:
        with_lse = [n for n in available(op) if entries[n].returns_lse]
        raise ValueError(f"{label} impl {impl!r} returns no log-sum-exp; those that do here: "
                         f"{with_lse} (or 'auto')")
    why = _rejects(e, args)
    if why:
        takes = [n for n in available(op) if _rejects(entries[n], args) is None]
        raise ValueError(f"{label} impl {impl!r} cannot take these inputs: {why}; those that "
                         f"can here: {takes}")
    return _choice(e, need_lse)
