"""The kernel registry: auto orders per platform, errors, declared support, LSE, config names.

GPU orders are checked on the CPU by faking the platform query (the Pallas kernels import
on the CPU, where they run interpreted)."""
import jax
import jax.numpy as jnp
import pytest

from jaxllm import config, config_model
from jaxllm.kernels import registry
from jaxllm.kernels.registry import available, names, pick


def _qkv(d, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((1, 8, 4, d), dtype)
    kv = jax.ShapeDtypeStruct((1, 8, 2, d), dtype)
    return q, kv, kv


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend to run on a GPU; `hopper` sets whether it is a Hopper."""
    monkeypatch.setattr(registry, "_platform", lambda: "gpu")

    def set_hopper(hopper: bool):
        monkeypatch.setattr(registry, "_hopper", lambda: hopper)
    set_hopper(True)
    return set_hopper


@pytest.mark.parametrize("d,dtype,want", [
    (128, jnp.bfloat16, "pallas_mosaic"),  # our kernel leads cuDNN at D 128
    (64, jnp.bfloat16, "cudnn"),            # cuDNN leads at D 64 and 256
    (256, jnp.float16, "cudnn"),
    (128, jnp.float32, "pallas_triton"),    # neither cuDNN nor Mosaic takes float32
    (512, jnp.float32, "xla"),              # past every kernel's head dims
])
def test_flash_auto_on_a_hopper_gpu(on_gpu, d, dtype, want):
    assert pick("flash", "auto", *_qkv(d, dtype)).name == want


def test_flash_auto_mla_head_dims(on_gpu):
    # MLA's D 192 with Dv 128: our Mosaic kernel on a Hopper; without one, cuDNN (through
    # jax.nn) does not take the pair and pallas_triton does
    q = jax.ShapeDtypeStruct((1, 8, 4, 192), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 8, 4, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 8, 4, 128), jnp.bfloat16)
    assert pick("flash", "auto", q, k, v).name == "pallas_mosaic"
    assert pick("flash", "auto", q, k, k).name == "cudnn"  # 192/192: no Mosaic config
    on_gpu(False)
    assert pick("flash", "auto", q, k, v).name == "pallas_triton"


def test_auto_on_an_older_gpu_and_on_the_cpu(on_gpu, monkeypatch):
    on_gpu(False)  # no Hopper: no Mosaic kernel
    assert pick("flash", "auto", *_qkv(128)).name == "cudnn"
    assert "pallas_mosaic" not in available("flash")
    monkeypatch.setattr(registry, "_platform", lambda: "cpu")
    assert pick("flash", "auto", *_qkv(128)).name == "reference"
    assert pick("paged").name == "reference"
    assert pick("ragged").name == "reference"
    assert pick("decode").name == "xla"
    assert pick("matmul").name == "xla"
    assert "cudnn" not in available("flash")


def test_decode_paged_ragged_and_matmul_auto_on_a_gpu(on_gpu):
    q = jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((2, 10, 16, 64), jnp.bfloat16)
    assert pick("paged", "auto", q, pages).name == "pallas_triton"
    odd_pages = jax.ShapeDtypeStruct((2, 10, 12, 64), jnp.bfloat16)
    assert pick("paged", "auto", q, odd_pages).name == "reference"  # page size 12
    assert pick("ragged", "auto", q, pages).name == "pallas_triton"
    assert pick("ragged", "auto", q, odd_pages).name == "reference"
    qd = jax.ShapeDtypeStruct((2, 1, 8, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 2, 100, 64), jnp.bfloat16)
    assert pick("decode", "auto", qd, cache).name == "pallas_triton"
    q96 = jax.ShapeDtypeStruct((2, 1, 8, 96), jnp.bfloat16)
    assert pick("decode", "auto", q96, cache).name == "xla"  # not a power of two
    x, w = jnp.ones((1, 64), jnp.bfloat16), jnp.ones((32, 64), jnp.bfloat16)
    assert pick("matmul", "auto", x, w, "none").name == "pallas_triton"
    assert pick("matmul", "auto", jnp.ones((17, 64)), w, "none").name == "xla"  # > 16 rows
    assert pick("matmul", "auto", x, jnp.ones((24, 64)), "none").name == "xla"


def test_gmm_auto_follows_the_rows(on_gpu):
    # the Mosaic kernel for a training step's rows on a Hopper, the Triton one for few rows
    # (prefill, decode) and without a Hopper
    rhs, sizes = (jax.ShapeDtypeStruct((8, 256, 128), jnp.bfloat16),
                  jax.ShapeDtypeStruct((8,), jnp.int32))
    big, small = (jax.ShapeDtypeStruct((m, 256), jnp.bfloat16) for m in (32768, 32767))
    assert pick("gmm", "auto", big, rhs, sizes).name == "pallas_mosaic"
    assert pick("gmm", "auto", small, rhs, sizes).name == "pallas_triton"
    on_gpu(False)
    assert pick("gmm", "auto", big, rhs, sizes).name == "pallas_triton"


def test_unknown_and_unavailable_names():
    with pytest.raises(ValueError, match=r"unknown flash attention impl 'pallas_mosiac' "
                                         r"\(did you mean 'pallas_mosaic'\?\); choose one of"):
        pick("flash", "pallas_mosiac")
    with pytest.raises(ValueError, match="unknown kernel op"):
        pick("conv")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="'cudnn' is not available here: runs on gpu.*"
                                             "available: .*'reference'"):
            pick("flash", "cudnn")


def test_declared_support_rejects_inputs(on_gpu):
    f32 = _qkv(128, jnp.float32)
    with pytest.raises(ValueError, match="'cudnn' cannot take these inputs: float32 .*"
                                         "those that can here: .*'pallas_triton'"):
        pick("flash", "cudnn", *f32)
    with pytest.raises(ValueError, match="head_dim=96"):
        pick("flash", "pallas_mosaic", *_qkv(96))
    with pytest.raises(ValueError, match="17 rows"):  # the kernel's own check
        pick("matmul", "pallas_triton", jnp.ones((17, 64)), jnp.ones((32, 64)), "none")
    assert pick("flash", "cudnn").name == "cudnn"  # no inputs: no input checks


def test_need_lse_takes_only_entries_that_return_it(on_gpu):
    for d, want in ((128, "pallas_mosaic"), (64, "pallas_mosaic")):  # cuDNN has no LSE
        choice = pick("flash", "auto", *_qkv(d), need_lse=True)
        assert choice.name == want and choice.fn_with_lse.__name__ == "flash_attention_with_lse"
    assert pick("flash", "auto", *_qkv(128, jnp.float32), need_lse=True).name == "pallas_triton"
    xla = pick("flash", "xla", need_lse=True)
    assert xla.fn.__name__ == "xla_attention"
    assert xla.fn_with_lse.__module__ == "jaxllm.kernels.reference"
    assert pick("flash", "xla").fn_with_lse is None
    with pytest.raises(ValueError, match="'cudnn' returns no log-sum-exp"):
        pick("flash", "cudnn", need_lse=True)


@pytest.mark.parametrize("op,constant", [("flash", "ATTENTION_IMPLS"),
                                         ("decode", "DECODE_IMPLS"),
                                         ("matmul", "MATMUL_IMPLS")])
def test_names_are_the_configs_choices(op, constant):
    assert names(op) == tuple(getattr(config, constant))


def test_every_entry_and_order_is_consistent():
    for e in registry.IMPLS:
        assert e.op in registry.OPS
    for rule in registry.AUTO:
        assert set(rule.names) <= set(names(rule.op)) - {"auto"}
    assert names("gmm") == config_model.GMM_IMPLS  # model.moe.gmm_impl's choices
    for op in registry.OPS:  # every op has an order for any backend
        assert any(r.op == op and r.platform is None for r in registry.AUTO)
