"""config.json helpers every family uses: required values, RoPE parameters, and the
sampling defaults of generation_config.json."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def require(c: dict, key: str, allowed, default):
    """ValueError unless config.json's `key` (or `default` when absent) is one of `allowed`."""
    value = c.get(key, default)
    if value not in allowed:
        raise ValueError(f"config.json {key}={value!r} is not supported; jaxllm reads "
                         f"{' or '.join(map(repr, allowed))}")


def rope_params(c: dict) -> tuple[float, str, dict]:
    """(rope_theta, rope type, the scaling parameters) from either config.json form:
    `rope_theta` and `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5)."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json partial_rotary_factor != 1 is not supported")
    return theta, kind, params


def rope_scaling_json(scaling) -> dict | None:
    """config.json's rope_scaling for our model.rope_scaling (None without one)."""
    if scaling is None:
        return None
    return {k: v for k, v in asdict(scaling).items() if v is not None}


def generation_defaults(path) -> dict:
    """Our `inference:` values from the directory's generation_config.json ({} without one),
    as transformers' `generate` reads it: greedy unless do_sample, else its temperature,
    top_k and top_p (transformers' defaults 1.0, 50, 1.0 where absent)."""
    f = Path(path) / "generation_config.json"
    if not f.exists():
        return {}
    g = {k: v for k, v in json.loads(f.read_text()).items() if v is not None}
    out = {"max_new_tokens": g["max_new_tokens"]} if g.get("max_new_tokens") else {}
    if not g.get("do_sample", False):
        return {**out, "temperature": 0.0}
    return {**out, "temperature": float(g.get("temperature", 1.0)),
            "top_k": int(g.get("top_k", 50)), "top_p": float(g.get("top_p", 1.0))}
