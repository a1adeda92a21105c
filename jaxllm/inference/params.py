"""Training parameters -> `DecodeParams`, the parameters of the decode program, made once.

Per layer (no stacked [L, ...] arrays, so a step reads each weight in place), q/k/v joined
into one weight and gate/up into another (multi-head latent attention: its projections,
kv_b split into the key part W_uk the queries are absorbed through and the value part
W_uv), every weight stored out-major ([*out, in]: each
output's weights contiguous, the layout of the fused decode matmuls), all cast to the
compute dtype. An MoE layer's routed experts stay stacked [E, ...] for the grouped matmuls
(`MoEParams`), its shared experts take the dense MLP's place. The model's config and the
row limit of the fused kernels ride along as static fields, so a jitted step needs nothing
else.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxllm.config import Config, ModelConfig
from jaxllm.kernels import pick
from jaxllm.model.layers import as_dtype, rope_magnitude
from jaxllm.model.moe import ExpertBias

# Steps of at most this many rows (batch x new tokens) run each layer in the fused decode
# matmuls when they are picked; XLA's matmuls do better above (docs/performance.md).
FUSED_ROWS = 1


@struct.dataclass
class MoEParams:
    """An MoE layer's routed experts (model/moe.py), in the layout of its grouped matmuls."""
    router: jax.Array  # [E, d]
    expert_bias: jax.Array | None  # [E] float32, selection only ("bias" balancing)
    gate: jax.Array  # [E, d, F]
    up: jax.Array  # [E, d, F]
    down: jax.Array  # [E, F, d]


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [d]
    qkv: jax.Array  # [Hq + 2 Hkv, D, d]
    qkv_bias: jax.Array | None  # [Hq + 2 Hkv, D]
    q_norm: jax.Array | None  # [D]: RMSNorm of each q head before RoPE (model.qk_norm)
    k_norm: jax.Array | None  # [D]
    o: jax.Array  # [d, Hq * D]
    mlp_norm: jax.Array  # [d]
    gate_up: jax.Array | None  # [2, F, d]: the dense MLP, or an MoE layer's shared experts
    down: jax.Array | None  # [d, F]
    moe: MoEParams | None = None  # the routed experts of an MoE layer


@struct.dataclass
class MLALayerParams:
    """A multi-head latent attention layer (model/mla.py) in the absorbed decode layout."""
    attn_norm: jax.Array  # [d]
    q_a: jax.Array | None  # [q_lora_rank, d]; None: full-rank queries (q_b is then x -> q)
    q_a_norm: jax.Array | None  # [q_lora_rank]
    q_b: jax.Array  # [H, Dqk, q_lora_rank or d]
    kv_a: jax.Array  # [kv_lora_rank + rope, d]
    kv_norm: jax.Array  # [kv_lora_rank]
    w_uk: jax.Array  # [H, nope, kv_lora_rank]: the latent -> each head's k_nope
    w_uv: jax.Array  # [H, Dv, kv_lora_rank]: the latent -> each head's v
    o: jax.Array  # [d, H * Dv]
    mlp_norm: jax.Array  # [d]
    gate_up: jax.Array | None  # [2, F, d]: the dense MLP, or an MoE layer's shared experts
    down: jax.Array | None  # [d, F]
    moe: MoEParams | None = None  # the routed experts of an MoE layer


@struct.dataclass
class MTPParams:
    """An MTP module (model/mtp.py): its block is of the main layers' kind (MLA, MoE)."""
    e_norm: jax.Array  # [d]
    h_norm: jax.Array  # [d]
    proj: jax.Array  # [d, 2 d]: over [e_norm(embedding); h_norm(hidden)]
    block: LayerParams | MLALayerParams
    final_norm: jax.Array  # [d]: before the shared head


@struct.dataclass
class DecodeParams:
    embed: jax.Array  # [V, d]
    layers: tuple  # of LayerParams (or MLALayerParams), one per layer
    final_norm: jax.Array  # [d]
    head: jax.Array | None  # [V, d]; None: tied to the embedding
    mtp: tuple  # of MTPParams, one per MTP module (empty without them)
    cfg: ModelConfig = struct.field(pytree_node=False)
    fused_rows: int = struct.field(pytree_node=False, default=0)  # 0: never fused

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def _out_major(w, n_in: int = 1):
    """[*in, *out] -> [*out, *in]."""
    return jnp.moveaxis(w, tuple(range(n_in)), tuple(range(w.ndim - n_in, w.ndim)))


def _moe(mlp: dict) -> MoEParams:
    return MoEParams(router=_out_major(mlp["router"]), expert_bias=mlp.get("expert_bias"),
                     gate=mlp["gate"], up=mlp["up"], down=mlp["down"])


def _dense_mlp(mlp: dict) -> tuple:
    """(gate_up, down, moe) of a block's feed-forward part: an MoE layer's dense SwiGLU is
    its shared experts (None without them)."""
    moe = _moe(mlp) if "router" in mlp else None
    if moe is not None:
        mlp = mlp.get("shared")
    if mlp is None:
        return None, None, moe
    return (_out_major(jnp.stack([mlp["gate"]["kernel"], mlp["up"]["kernel"]], axis=1)),
            _out_major(mlp["down"]["kernel"]), moe)


def _mla_layer(blk: dict, nope: int) -> MLALayerParams:
    attn = blk["attn"]
    gate_up, down, moe = _dense_mlp(blk["mlp"])
    low_rank = "q_a" in attn
    kv_b = _out_major(attn["kv_b"]["kernel"])  # [H, nope + Dv, rank]
    o = attn["o"]["kernel"]  # [H, Dv, d]
    return MLALayerParams(
        attn_norm=blk["attn_norm"]["scale"],
        q_a=_out_major(attn["q_a"]["kernel"]) if low_rank else None,
        q_a_norm=attn["q_a_norm"]["scale"] if low_rank else None,
        q_b=_out_major(attn["q_b" if low_rank else "q"]["kernel"]),
        kv_a=_out_major(attn["kv_a"]["kernel"]), kv_norm=attn["kv_norm"]["scale"],
        w_uk=kv_b[:, :nope], w_uv=kv_b[:, nope:],
        o=_out_major(o, 2).reshape(o.shape[-1], -1), mlp_norm=blk["mlp_norm"]["scale"],
        gate_up=gate_up, down=down, moe=moe)


def _layer(blk: dict, cfg: ModelConfig) -> LayerParams | MLALayerParams:
    if cfg.mla is not None:
        return _mla_layer(blk, cfg.mla.qk_nope_head_dim)
    attn = blk["attn"]
    gate_up, down, moe = _dense_mlp(blk["mlp"])
    qkv = jnp.concatenate([attn[n]["kernel"] for n in "qkv"], axis=1)  # [d, Hq + 2 Hkv, D]
    bias = (jnp.concatenate([attn[n]["bias"] for n in "qkv"], axis=0)
            if "bias" in attn["q"] else None)
    o = attn["o"]["kernel"]  # [Hq, D, d]
    qk_norm = [attn[n]["scale"] if n in attn else None for n in ("q_norm", "k_norm")]
    return LayerParams(
        attn_norm=blk["attn_norm"]["scale"], qkv=_out_major(qkv), qkv_bias=bias,
        q_norm=qk_norm[0], k_norm=qk_norm[1],
        o=_out_major(o, 2).reshape(o.shape[-1], -1), mlp_norm=blk["mlp_norm"]["scale"],
        gate_up=gate_up, down=down, moe=moe)


def _fused_rows(m: ModelConfig, impl: str) -> int:
    """FUSED_ROWS when `impl` (inference.matmul_impl) picks the fused decode matmuls for
    every projection of a layer, else 0. An explicit pick they cannot take raises."""
    if m.attention == "mla" or rope_magnitude(m.rope_scaling) != 1.0 or m.moe is not None:
        if impl == "pallas_triton":
            raise ValueError("inference.matmul_impl='pallas_triton': the fused decode matmuls "
                             "take grouped-query attention with unscaled RoPE magnitudes and "
                             "dense MLPs (no MLA, no YaRN mscale, no model.moe); use 'auto' "
                             "or 'xla'")
        return 0
    for flag, what in (("qkv_bias", "no q/k/v bias"), ("qk_norm", "no q/k head norm")):
        if getattr(m, flag):
            if impl == "pallas_triton":
                raise ValueError(f"inference.matmul_impl='pallas_triton': the fused decode "
                                 f"matmuls take {what} (model.{flag}); use 'auto' or 'xla'")
            return 0
    hq, hkv, hd, d, f = m.n_heads, m.n_kv_heads, m.resolved_head_dim, m.d_model, m.mlp_dim
    dtype = as_dtype(m.dtype)
    for k, w, epilogue in ((d, (hq + 2 * hkv, hd, d), "qkv"), (hq * hd, (d, hq * hd), "none"),
                           (d, (2, f, d), "glu"), (f, (d, f), "none")):
        x = jax.ShapeDtypeStruct((FUSED_ROWS, k), dtype)
        if pick("matmul", impl, x, jax.ShapeDtypeStruct(w, dtype), epilogue).name == "xla":
            return 0
    return FUSED_ROWS


def decode_params(model, cfg: Config, *, fused_rows: int | None = None) -> DecodeParams:
    """The decode program's parameters for a trained `model` (left as it is).

    The model's own config shapes the program; `cfg` gives the inference options.
    `fused_rows` overrides the row limit of the fused decode matmuls (tests use it to run
    them on steps of several rows); by default it follows inference.matmul_impl.
    """
    state = nnx.to_pure_dict(nnx.state(model, (nnx.Param, ExpertBias)))
    if fused_rows is None:
        fused_rows = _fused_rows(model.cfg, cfg.inference.matmul_impl)
    return _convert(state, model.cfg, fused_rows)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _convert(state: dict, cfg: ModelConfig, fused_rows: int) -> DecodeParams:
    dtype = as_dtype(cfg.dtype)
    stacks = [state[k] for k in ("dense_blocks", "blocks") if state.get(k)]  # in layer order
    layers = tuple(_layer(jax.tree.map(lambda a, i=i: a[i], blocks), cfg)
                   for blocks in stacks for i in range(len(jax.tree.leaves(blocks)[0])))
    mtp = tuple(MTPParams(e_norm=m["e_norm"]["scale"], h_norm=m["h_norm"]["scale"],
                          proj=_out_major(m["proj"]["kernel"]), block=_layer(m["block"], cfg),
                          final_norm=m["final_norm"]["scale"])
                for _, m in sorted((state.get("mtp") or {"layers": {}})["layers"].items()))
    head = state.get("head")
    params = DecodeParams(embed=state["embed"]["embedding"], layers=layers,
                          final_norm=state["final_norm"]["scale"],
                          head=None if head is None else _out_major(head["kernel"]), mtp=mtp,
                          cfg=cfg, fused_rows=fused_rows)
    # all in the compute dtype but the expert bias, which chooses experts: kept in float32
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if getattr(path[-1], "name", None) == "expert_bias"
        else x.astype(dtype), params)
