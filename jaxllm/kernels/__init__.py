"""Attention kernels behind one interface each: `flash_attention`, `paged_attention` and
`decode_attention` (a few new tokens over a contiguous KV cache).

`impl` picks the implementation; "auto" takes the fastest correct one for the device.
Pallas implementations live in `kernels/pallas/` and register themselves here lazily,
so importing jaxllm never compiles or imports a backend the device cannot run.
"""
from __future__ import annotations

import importlib
from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.kernels import reference

FLASH_IMPLS = ("auto", "reference", "xla", "cudnn", "pallas_triton", "pallas_mosaic")
PAGED_IMPLS = ("auto", "reference", "pallas_triton")
DECODE_IMPLS = ("auto", "xla", "pallas_triton")

# name -> "module:function"; resolved on first use. A module that fails to import, or a
# backend the current device cannot run, makes the impl unavailable (with the reason).
_FLASH_TABLE = {
    "reference": "jaxllm.kernels.reference:flash_attention",
    "xla": "jaxllm.kernels.xla:xla_attention",
    "cudnn": "jaxllm.kernels.xla:cudnn_attention",
    "pallas_triton": "jaxllm.kernels.pallas.flash_triton:flash_attention",
    "pallas_mosaic": "jaxllm.kernels.pallas.flash_mosaic:flash_attention",
}
_PAGED_TABLE = {
    "reference": "jaxllm.kernels.reference:paged_attention",
    "pallas_triton": "jaxllm.kernels.pallas.paged_triton:paged_attention",
}
_DECODE_TABLE = {
    "xla": "jaxllm.kernels.xla:decode_attention",  # einsums; XLA fuses the masking
    "pallas_triton": "jaxllm.kernels.pallas.paged_triton:decode_attention",
}


def _platform() -> str:
    return jax.default_backend()


def _device_kind() -> str:
    return jax.devices()[0].device_kind


def _is_hopper_or_newer() -> bool:
    if _platform() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", "0")
    try:
        return float(cc) >= 9.0
    except ValueError:
        return False


def _unavailable_reason(name: str) -> str | None:
    """None when `name` can run here, else a short reason."""
    platform = _platform()
    if name == "cudnn" and platform != "gpu":
        return f"needs an NVIDIA GPU (backend is {platform!r})"
    if name == "pallas_mosaic" and platform == "gpu" and not _is_hopper_or_newer():
        return f"needs a Hopper or newer GPU (device is {_device_kind()!r})"
    if name.startswith("pallas") and platform not in ("gpu", "cpu"):
        return f"needs a GPU or the CPU interpreter (backend is {platform!r})"
    return None


def _resolve(table: dict[str, str], name: str) -> tuple[Callable | None, str | None]:
    why = _unavailable_reason(name)
    if why:
        return None, why
    module, fn = table[name].split(":")
    try:
        return getattr(importlib.import_module(module), fn), None
    except (ImportError, AttributeError) as e:
        return None, f"not built ({type(e).__name__}: {e})"


def _supports(fn, args) -> bool:
    """Whether an implementation takes these inputs. A kernel module with a narrower
    domain than the public API (e.g. pallas_mosaic: bf16/f16, D in {64, 128, 256};
    cuDNN: bf16/f16) says so with `unsupported_reason(*args)`, on the function or its
    module; `auto` then moves on to the next one."""
    check = (getattr(fn, "unsupported_reason", None)  # a function's own, else its module's
             or getattr(importlib.import_module(fn.__module__), "unsupported_reason", None))
    return check is None or not args or check(*args) is None


def available_flash_impls() -> list[str]:
    return [n for n in _FLASH_TABLE if _resolve(_FLASH_TABLE, n)[0] is not None]


def available_paged_impls() -> list[str]:
    return [n for n in _PAGED_TABLE if _resolve(_PAGED_TABLE, n)[0] is not None]


def _pick(table, name, valid, auto_order, args=()):
    if name not in valid:
        raise ValueError(f"unknown attention impl {name!r}; choose one of {list(valid)}")
    if name == "auto":
        for cand in auto_order():
            fn, _ = _resolve(table, cand)
            if fn is not None and _supports(fn, args):
                return fn
        name = "reference"
    fn, why = _resolve(table, name)
    if fn is None:
        avail = [n for n in table if _resolve(table, n)[0] is not None]
        raise ValueError(f"attention impl {name!r} is not available here: {why}; "
                         f"available: {avail}")
    return fn


def _flash_auto_order() -> list[str]:
    # The fastest correct implementation measured on the H200 first (docs/benchmarks.md:
    # cuDNN leads our Triton kernel by ~1.3x); the reference on the CPU. pallas_mosaic
    # goes first once it measures faster than cuDNN.
    if _platform() == "gpu":
        return ["cudnn", "pallas_mosaic", "pallas_triton", "xla"]
    return ["reference"]


def _check_flash_inputs(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"flash_attention wants q, k, v of rank 4 [B, S, H, D]; got "
                         f"q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k{k.shape} and v{v.shape} must have the same shape")
    b, sq, hq, d = q.shape
    bk, skv, hkv, dk = k.shape
    if b != bk or d != dk:
        raise ValueError(f"q{q.shape} and k{k.shape} disagree in batch or head_dim")
    if sq < 1 or skv < 1:
        raise ValueError(f"sequence lengths must be >= 1; got Sq={sq}, Skv={skv}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not divisible by kv heads {hkv}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point; got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                    impl: str = "auto", **kwargs):
    """Multi-head attention, q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] -> [B, Sq, Hq, D].

    Hq % Hkv == 0 (MHA, GQA, MQA). Causal with Sq != Skv is bottom-right aligned: query
    i sees keys j <= i + (Skv - Sq). `sm_scale` defaults to 1/sqrt(D). Differentiable.
    Extra keyword arguments (e.g. block sizes) go to the chosen implementation.
    """
    _check_flash_inputs(q, k, v)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    fn = _pick(_FLASH_TABLE, impl, FLASH_IMPLS, _flash_auto_order, (q, k, v))
    return fn(q, k, v, causal=causal, sm_scale=sm_scale, **kwargs)


def _paged_auto_order() -> list[str]:
    return [] if _platform() == "cpu" else ["pallas_triton"]


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale: float | None = None,
                    impl: str = "auto", layer=None, **kwargs):
    """Decode attention over a paged KV cache.

    q [B, Hq, D]; k_pages/v_pages [Hkv, num_pages, page_size, D], or a layer stack
    [L, Hkv, num_pages, page_size, D] with `layer` (an int or traced int32 scalar) naming
    the layer to read in place; block_tables int32 [B, max_pages_per_seq]; lengths int32
    [B] (0 allowed: the output row is zeros).
    """
    stacked = k_pages.ndim == 5
    if q.ndim != 3 or k_pages.ndim not in (4, 5) or k_pages.shape != v_pages.shape:
        raise ValueError(f"paged_attention wants q [B, Hq, D] and k/v pages [Hkv, P, page, D] "
                         f"(or [L, Hkv, P, page, D] with layer=); got q{q.shape} "
                         f"k{k_pages.shape} v{v_pages.shape}")
    if stacked != (layer is not None):
        raise ValueError(f"layer={layer!r} goes with k/v pages of rank 5 [L, Hkv, P, page, D], "
                         f"and only with them; got pages{k_pages.shape}")
    hkv = k_pages.shape[-4]
    if q.shape[-1] != k_pages.shape[-1] or q.shape[1] % hkv:
        raise ValueError(f"q{q.shape} does not fit pages{k_pages.shape}: head_dim must match "
                         f"and Hq must be a multiple of Hkv")
    if block_tables.ndim != 2 or lengths.shape != (q.shape[0],):
        raise ValueError(f"block_tables must be [B, n] and lengths [B]; got "
                         f"{block_tables.shape} and {lengths.shape}")
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    fn = _pick(_PAGED_TABLE, impl, PAGED_IMPLS, _paged_auto_order)
    if stacked and fn is reference.paged_attention:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    elif stacked:
        kwargs["layer"] = layer
    return fn(q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, **kwargs)


def _decode_auto_order() -> list[str]:
    # on the GPU one kernel launch per layer instead of XLA's einsum / softmax / einsum
    # chain (docs/benchmarks.md, decode); on the CPU the einsums
    return ["pallas_triton", "xla"] if _platform() == "gpu" else ["xla"]


def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale: float | None = None,
                     impl: str = "auto", counters=None, **kwargs):
    """New tokens over a contiguous KV cache: decoding (S = 1) and speculative verification.

    q [B, S, Hq, D]: row b's S new tokens sit at positions lengths[b] - S .. lengths[b] - 1
    and are already written to the cache; query s sees keys 0 .. lengths[b] - S + s.
    k_cache/v_cache [B, Hkv, T, D] (model.attention.KVCache's per-layer layout);
    lengths int32 [B], S <= lengths[b] <= T. -> [B, S, Hq, D].
    counters: optional int32 zeros [B * Hkv] scratch; `pallas_triton` then merges a
    context split over several programs inside its kernel (other impls ignore it).
    """
    if q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention wants q [B, S, Hq, D] and k/v [B, Hkv, T, D]; got "
                         f"q{q.shape} k{k_cache.shape} v{v_cache.shape}")
    b, _, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or hq % k_cache.shape[1]:
        raise ValueError(f"q{q.shape} does not fit the cache {k_cache.shape}: batch and "
                         f"head_dim must match and Hq must be a multiple of Hkv")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B]={b}; got {lengths.shape}")
    sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    fn = _pick(_DECODE_TABLE, impl, DECODE_IMPLS, _decode_auto_order, (q, k_cache))
    if counters is not None and fn is _resolve(_DECODE_TABLE, "pallas_triton")[0]:
        kwargs["counters"] = counters
    return fn(q, k_cache, v_cache, lengths, sm_scale=sm_scale, **kwargs)


__all__ = ["flash_attention", "paged_attention", "decode_attention", "available_flash_impls",
           "available_paged_impls", "FLASH_IMPLS", "PAGED_IMPLS", "DECODE_IMPLS"]


# -- provisional: replaced by the kernel registry -----------------------------------------
class _Picked:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn


def pick(op, impl="auto", *args, need_lse=False):
    if op != "matmul":
        raise NotImplementedError(op)
    from jaxllm.kernels.pallas import gemv_triton
    if impl == "xla" or (impl == "auto" and _platform() != "gpu"):
        return _Picked("xla", None)
    why = gemv_triton.unsupported_reason(*args)
    if why and impl == "pallas_triton":
        raise ValueError(f"inference.matmul_impl=pallas_triton: {why}")
    return _Picked("xla", None) if why else _Picked("pallas_triton", gemv_triton.decode_gemv)


def decode_matmul(*args, **kwargs):
    from jaxllm.kernels.pallas import gemv_triton
    return gemv_triton.decode_gemv(*args, **kwargs)
