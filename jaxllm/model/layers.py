"""Building blocks: parameters with logical axes, linear, embedding, RMSNorm, RoPE, SwiGLU.

Every parameter carries logical axis names (batch, seq, embed, q_heads, kv_heads, head_dim,
mlp, vocab, experts, layers, latent). `jaxllm.sharding.rules` maps them onto the mesh;
model code never sees a mesh.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import RopeScaling
from jaxllm.sharding.constrain import constrain, gathered

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def as_dtype(name) -> jnp.dtype:
    return DTYPES[name] if isinstance(name, str) else name


def param(rngs: nnx.Rngs, shape, axes: tuple, dtype, std: float | None = None,
          value: float | None = None) -> nnx.Param:
    """A parameter of `shape` named by logical `axes`: normal(std) init, or constant `value`.

    Sharding is applied from outside (sharding/rules.py), so eager sharding is off here.
    """
    assert len(shape) == len(axes), (shape, axes)
    if value is not None:
        x = jnp.full(shape, value, dtype)
    else:
        x = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(x, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ W with W [*in_shape, *out_shape]; `spec` is the einsum, e.g. 'bsd,dhk->bshk'."""

    def __init__(self, in_shape, out_shape, axes, spec: str, *, dtype, param_dtype,
                 rngs: nnx.Rngs, std: float, bias: bool = False):
        n_in = len(in_shape)
        self.kernel = param(rngs, tuple(in_shape) + tuple(out_shape), tuple(axes), param_dtype,
                            std=std)
        self.bias = (param(rngs, tuple(out_shape), axes[n_in:], param_dtype, value=0.0)
                     if bias else None)
        self.spec, self.dtype = spec, dtype
        self.out_axes = tuple(axes[n_in:])

    def __call__(self, x):
        y = jnp.einsum(self.spec, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return constrain(y, ("batch", "seq") + self.out_axes)  # (B, S, *out_shape)


class Embed(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, *, dtype, param_dtype, rngs, std: float):
        self.embedding = param(rngs, (vocab_size, d_model), ("vocab", "embed"), param_dtype,
                               std=std)
        self.dtype = dtype

    def __call__(self, tokens):  # (B, S) -> (B, S, d)
        table = gathered(self.embedding[...], ("vocab", "embed"))  # FSDP: all-gather first
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        return constrain(x, ("batch", "seq", "embed"))

    def attend(self, x):  # tied output head: (B, S, d) -> (B, S, V) in f32
        logits = jnp.einsum("bsd,vd->bsv", x.astype(self.dtype),
                            self.embedding[...].astype(self.dtype),
                            preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "vocab"))


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in float32, returned in the compute dtype."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, rngs):
        self.scale = param(rngs, (dim,), ("embed",), param_dtype, value=1.0)
        self.eps, self.dtype = eps, dtype

    @jax.named_scope("rms_norm")
    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None
                     ) -> jax.Array:
    """Rotary inverse frequencies (D/2,). `scaling`: model.rope_scaling, or None."""
    inv = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # (D/2,)
    if scaling is None:
        return inv
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(inv, head_dim, theta, scaling)
    # Llama 3.1 ("llama3"): wavelengths longer than original_len / low_freq_factor are
    # stretched by `factor`, those shorter than original_len / high_freq_factor kept, and
    # those between interpolated linearly in original_len / wavelength.
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * jnp.pi / inv
    keep = jnp.clip((scaling.original_max_position_embeddings / wavelength - lo) / (hi - lo),
                    0, 1)
    return (1 - keep) * inv / scaling.factor + keep * inv


def _yarn_frequencies(inv, head_dim: int, theta: float, scaling: RopeScaling):
    """YaRN: the frequency pairs that turn more than beta_fast times over the original
    context keep their frequency, those turning fewer than beta_slow times are divided by
    `factor`, with a linear ramp between (pair indices rounded outwards, as DeepSeek)."""
    def pair(turns):  # the pair index whose wavelength fits `turns` times in original_len
        return (head_dim * math.log(scaling.original_max_position_embeddings
                                    / (turns * 2 * math.pi)) / (2 * math.log(theta)))
    lo = max(math.floor(pair(scaling.resolved("beta_fast"))), 0)
    hi = min(math.ceil(pair(scaling.resolved("beta_slow"))), head_dim - 1)
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - lo)
                    / max(hi - lo, 1e-3), 0, 1)  # 0: keep, 1: interpolate
    return inv * (1 - ramp) + inv / scaling.factor * ramp


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_magnitude(scaling: RopeScaling | None) -> float:
    """The factor on cos and sin: YaRN's mscale(mscale) / mscale(mscale_all_dim), else 1."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    return (yarn_mscale(scaling.factor, scaling.resolved("mscale"))
            / yarn_mscale(scaling.factor, scaling.resolved("mscale_all_dim")))


def softmax_scale_factor(scaling: RopeScaling | None) -> float:
    """The factor on MLA's softmax scale: YaRN's mscale(mscale_all_dim)^2, else 1."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    return yarn_mscale(scaling.factor, scaling.resolved("mscale_all_dim")) ** 2


@jax.named_scope("rope")
def apply_rope(x, positions, theta: float, scaling=None):
    """Rotary embedding, half-split convention. x (B, S, H, D), positions int (B, S)."""
    d = x.shape[-1]
    freqs = rope_frequencies(d, theta, scaling)
    angles = positions[..., None].astype(jnp.float32) * freqs  # (B, S, D/2)
    mag = rope_magnitude(scaling)
    cos, sin = (mag * f(angles)[:, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, mlp_dim: int, *, dtype, param_dtype, rngs, std: float,
                 out_std: float):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = Linear((d_model,), (mlp_dim,), ("embed", "mlp"), "bsd,dm->bsm", std=std, **kw)
        self.up = Linear((d_model,), (mlp_dim,), ("embed", "mlp"), "bsd,dm->bsm", std=std, **kw)
        self.down = Linear((mlp_dim,), (d_model,), ("mlp", "embed"), "bsm,md->bsd", std=out_std,
                           **kw)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
