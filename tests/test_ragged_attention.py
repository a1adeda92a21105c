"""Ragged paged attention (a flat batch of prefill and decode tokens over the paged cache):
the jnp reference against a naive per-sequence computation, and the pallas_triton kernel
(interpret mode on the CPU) against the reference."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import ragged_paged_attention, reference
from jaxllm.kernels.pallas import ragged_triton


def _case(seed, seqs, *, page, hq, hkv, d=32, pad_rows=0, pad_seqs=0, dtype=jnp.float32):
    """seqs: (cached tokens before the new ones, new tokens) per sequence, then `pad_seqs`
    padding sequences (q_len 0, kv_len 0) and `pad_rows` padding rows.

    Each sequence's pages are a random subset of the pool; pool slots no sequence may
    read (pages of no table, slots past a sequence's kv_len) are NaN, and table entries
    past a sequence's pages name NaN pages, so any read of them shows in the output.
    Returns (args of ragged_paged_attention, the same args on the NaN-free pool)."""
    rng = np.random.default_rng(seed)
    seqs = list(seqs) + [(0, 0)] * pad_seqs
    kv_lens = np.array([c + n for c, n in seqs], np.int32)
    q_lens = np.array([n for _, n in seqs], np.int32)
    need = -(-kv_lens // page)
    width = int(need.max()) + 1
    spare = 3  # pages of no table
    num_pages = int(need.sum()) + spare
    perm = rng.permutation(num_pages)
    tables = rng.choice(perm[:spare], (len(seqs), width)).astype(np.int32)
    live = np.zeros((num_pages, page), bool)
    at = spare
    for s, n in enumerate(need):
        tables[s, :n] = perm[at:at + n]
        at += n
        for t in range(kv_lens[s]):
            live[tables[s, t // page], t % page] = True
    k = rng.standard_normal((hkv, num_pages, page, d)).astype(np.float32)
    v = rng.standard_normal((hkv, num_pages, page, d)).astype(np.float32)
    k[:, ~live], v[:, ~live] = np.nan, np.nan
    q_starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(q_starts[-1]) + pad_rows, hq, d)).astype(np.float32)
    args = [jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables), jnp.asarray(kv_lens), jnp.asarray(q_starts)]
    clean = list(args)
    clean[1], clean[2] = jnp.nan_to_num(args[1]), jnp.nan_to_num(args[2])
    return args, clean


def _naive(q, k_pages, v_pages, tables, kv_lens, q_starts, scale):
    """Per sequence: gather its keys, softmax of each new token over keys 0 .. its position."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    hkv, _, page, _ = k_pages.shape
    group = q.shape[1] // hkv
    out = np.zeros_like(q)
    for s in range(len(kv_lens)):
        start, end, n = int(q_starts[s]), int(q_starts[s + 1]), int(kv_lens[s])
        idx = np.arange(n)
        k = k_pages[:, tables[s, idx // page], idx % page]  # [Hkv, n, D]
        v = v_pages[:, tables[s, idx // page], idx % page]
        for i, row in enumerate(range(start, end)):
            pos = n - (end - start) + i
            for h in range(q.shape[1]):
                sc = k[h // group, :pos + 1] @ q[row, h] * scale
                p = np.exp(sc - sc.max())
                out[row, h] = (p / p.sum()) @ v[h // group, :pos + 1]
    return out


def test_reference_matches_naive_per_sequence_attention():
    seqs = [(0, 3), (5, 1), (9, 6), (0, 1), (4, 4)]
    _, clean = _case(0, seqs, page=4, hq=4, hkv=2, pad_rows=2, pad_seqs=1)
    out = ragged_paged_attention(*clean, sm_scale=0.3, impl="reference")
    want = _naive(*clean, 0.3)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[-2:], 0.0)  # padding rows


P = 4  # page size of the cases below
CASES = {
    # cached context before the new tokens: 0, 1, page-1, page, page+1, long; q_len 1 and many
    "mix_gqa4_f32": dict(seqs=[(0, 1), (1, 9), (P - 1, 1), (P, 5), (P + 1, 1), (37, 14)],
                         page=P, hq=8, hkv=2, pad_rows=5, pad_seqs=2),
    "decode_only_mha": dict(seqs=[(c, 1) for c in (0, 1, 3, 4, 5, 22, 9, 40)], page=P,
                            hq=2, hkv=2, d=64),
    "chunk_over_prefix_gqa8_bf16": dict(seqs=[(45, 30), (6, 1), (17, 1), (0, 1)], page=8,
                                        hq=8, hkv=1, pad_rows=3, dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_reading_nothing_else(name):
    """NaN everywhere the kernel must not read: the output is finite and equals the
    reference on the clean pool; padding rows are zeros."""
    case = CASES[name]
    args, clean = _case(len(name), **case)
    out = ragged_paged_attention(*args, impl="pallas_triton")
    want = ragged_paged_attention(*clean, impl="reference")
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()
    tol = 2e-2 if case.get("dtype") == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    n_real = int(args[5][-1])
    np.testing.assert_array_equal(np.asarray(out[n_real:], np.float32), 0.0)


def test_small_blocks_several_per_sequence_and_garbage_table_entries():
    """Blocks of 3 tokens (a chunk spans several, the last one partial), keys 8 a step,
    table entries past a sequence's pages out of range; new values do not recompile."""
    args, clean = _case(3, [(13, 11), (0, 2), (7, 1), (2, 8)], page=4, hq=4, hkv=2,
                        pad_rows=4, pad_seqs=1)
    tables, kv_lens = np.asarray(args[3]), np.asarray(args[4])
    past = np.arange(tables.shape[1])[None, :] >= -(-kv_lens // 4)[:, None]
    args[3] = jnp.asarray(np.where(past, 10**6, tables), jnp.int32)
    # blocks this small exist only in the interpreter (compiled Triton wants >= 16)
    kernel = functools.partial(ragged_triton.ragged_paged_attention, sm_scale=0.2,
                               small_q=2, block_q=3, block_k=8, interpret=True)
    np.testing.assert_allclose(kernel(*args), reference.ragged_paged_attention(
        *clean, sm_scale=0.2), atol=2e-5, rtol=2e-5)
    # other values, same shapes: fewer new tokens a sequence, no recompilation
    compiled = ragged_triton.ragged_paged_attention._cache_size()
    args[5] = clean[5] = jnp.asarray([0, 5, 7, 8, 12, 12], jnp.int32)
    np.testing.assert_allclose(kernel(*args), reference.ragged_paged_attention(
        *clean, sm_scale=0.2), atol=2e-5, rtol=2e-5)
    assert ragged_triton.ragged_paged_attention._cache_size() == compiled


# contexts 0, 1, P-1, P, P+1 and long; a one-key sequence (fewer keys than splits)
SPLIT_SEQS = [(0, 1), (1, 9), (P - 1, 1), (P, 5), (P + 1, 1), (37, 14), (29, 2)]


@functools.cache
def _split_run(kv_splits, hq, hkv):
    """(args, clean args, the kernel's output with these splits) on SPLIT_SEQS."""
    args, clean = _case(7, SPLIT_SEQS, page=P, hq=hq, hkv=hkv, pad_rows=3, pad_seqs=2)
    out = ragged_triton.ragged_paged_attention(*args, sm_scale=0.3, small_q=2, block_q=3,
                                               block_k=4, kv_splits=kv_splits,
                                               interpret=True)  # small blocks: interpreter
    return args, clean, np.asarray(out)


@pytest.mark.parametrize("kv_splits,hq,hkv", [
    (1, 8, 2), (2, 8, 2), (3, 8, 2), ((1, 3), 8, 2), ((3, 1), 8, 2), (3, 2, 2), (2, 8, 1)])
def test_key_splits_match_reference_reading_nothing_else(kv_splits, hq, hkv):
    """Each block's keys split over programs (4 keys a step, so 3 splits do not divide
    them evenly and short blocks leave splits empty), merged by log-sum-exp: equal to
    the reference, NaN slots never read, padding rows exactly zero; a launch that does
    not split gives exactly the rows it gives with no split anywhere."""
    args, clean, out = _split_run(kv_splits, hq, hkv)
    assert np.isfinite(out).all()
    want = reference.ragged_paged_attention(*clean, sm_scale=0.3)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    n_real = int(args[5][-1])
    np.testing.assert_array_equal(out[n_real:], 0.0)
    if isinstance(kv_splits, tuple):  # the unsplit launch's rows are bit for bit as before
        q_lens = np.diff(np.asarray(args[5]))
        rows = np.repeat(q_lens <= 2, q_lens)  # the decode launch's rows
        rows = rows if kv_splits[0] == 1 else ~rows
        unsplit = _split_run(1, hq, hkv)[2]
        np.testing.assert_array_equal(out[:n_real][rows], unsplit[:n_real][rows])


def test_default_splits_follow_the_rule(monkeypatch):
    """On a GPU of 132 SMs (1B model shapes: Hq 16 / Hkv 8, S = 64 sequence slots): the
    decode launch splits several ways at T = 16 and 32 and two ways at T = 64 (64 blocks x
    8 heads, under four waves); the prefill launch splits up to 16 ways at small T; nothing
    splits past T = 256; off the GPU nothing splits."""
    def splits(t):
        sds = jax.ShapeDtypeStruct
        pages = sds((8, 64, 16, 128), jnp.bfloat16)
        jaxpr = jax.make_jaxpr(functools.partial(ragged_triton.ragged_paged_attention,
                                                 sm_scale=0.1))(
            sds((t, 16, 128), jnp.bfloat16), pages, pages, sds((64, 8), jnp.int32),
            sds((64,), jnp.int32), sds((65,), jnp.int32))
        names = re.findall(r"ragged_paged_p16_bq(\d+)_bk\d+_s(\d+)", str(jaxpr))
        return {int(bq): int(n) for bq, n in names}  # block_q 8: decode, 32: prefill

    assert splits(48) == {8: 1, 32: 1}  # shapes traced only here: the jit cache is cold
    monkeypatch.setattr(ragged_triton, "_sm_count", lambda: 132)
    assert splits(16)[8] > 1 and splits(32)[8] > 1 and splits(32)[32] == 16
    assert splits(64)[8] == 2 and splits(64)[32] > 1
    assert splits(512) == {8: 1, 32: 1}


def test_decode_steps_promised_as_such_run_the_decode_launch_alone():
    """max_q_len=1 on a decode-only step (contexts 0, 1, page-1, page, page+1, long, GQA 4,
    padding sequences and rows): one launch, no partials to merge, equal to the reference
    and to the kernel without the promise, reading nothing it should not."""
    args, clean = _case(11, [(c, 1) for c in (0, 1, P - 1, P, P + 1, 37, 9)], page=P, hq=8,
                        hkv=2, pad_rows=3, pad_seqs=2)
    kernel = functools.partial(ragged_triton.ragged_paged_attention, sm_scale=0.3, small_q=2,
                               block_q=3, block_k=4, interpret=True)
    out = np.asarray(kernel(*args, max_q_len=1))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, reference.ragged_paged_attention(*clean, sm_scale=0.3),
                               atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out, np.asarray(kernel(*args)))
    jaxpr = str(jax.make_jaxpr(functools.partial(kernel, max_q_len=1))(*args))
    assert len(re.findall(r"name=ragged_paged_p", jaxpr)) == 1, "one launch"
    assert len(re.findall(r"name=ragged_paged_p", str(jax.make_jaxpr(kernel)(*args)))) == 2
    with pytest.raises(ValueError, match="max_q_len=0"):
        kernel(*args, max_q_len=0)


def test_layer_stack_is_read_in_place_at_the_named_layer():
    _, (q, k, v, tables, kv_lens, q_starts) = _case(
        4, [(5, 1), (0, 7), (9, 3)], page=8, hq=8, hkv=2, pad_rows=1)
    k_stack, v_stack = jnp.stack([k, -k, 0.5 * k]), jnp.stack([v, v + 1, -v])
    want = reference.ragged_paged_attention(q, 0.5 * k, -v, tables, kv_lens, q_starts)
    step = jax.jit(lambda layer: ragged_paged_attention(
        q, k_stack, v_stack, tables, kv_lens, q_starts, layer=layer, impl="pallas_triton"))
    np.testing.assert_allclose(step(jnp.int32(2)), want, atol=2e-5, rtol=2e-5)
    ref = ragged_paged_attention(q, k_stack, v_stack, tables, kv_lens, q_starts, layer=2,
                                 impl="reference")
    np.testing.assert_allclose(ref, want, atol=1e-6)


def test_bad_inputs_raise():
    _, (q, k, v, tables, kv_lens, q_starts) = _case(5, [(3, 2), (0, 1)], page=4, hq=4,
                                                    hkv=2)
    with pytest.raises(ValueError, match=r"q_starts must be \[S \+ 1\] = \[3\]"):
        ragged_paged_attention(q, k, v, tables, kv_lens, q_starts[:-1])
    with pytest.raises(ValueError, match="kv_lens"):
        ragged_paged_attention(q, k, v, tables, kv_lens[:1], q_starts)
    with pytest.raises(ValueError, match="wants q"):
        ragged_paged_attention(q[None], k, v, tables, kv_lens, q_starts)
    with pytest.raises(ValueError, match="Hq must be a multiple of Hkv"):
        ragged_paged_attention(q[:, :3], k, v, tables, kv_lens, q_starts)
    with pytest.raises(ValueError, match="pass layer=|only with them"):
        ragged_paged_attention(q, k[None], v[None], tables, kv_lens, q_starts)
    with pytest.raises(ValueError, match="must be integers"):
        ragged_paged_attention(q, k, v, tables, kv_lens.astype(jnp.float32), q_starts)
    for bad in (0, (2, 0), (1, 2, 3)):
        with pytest.raises(ValueError, match="kv_splits"):
            ragged_triton.ragged_paged_attention(q, k, v, tables, kv_lens, q_starts,
                                                 sm_scale=0.1, kv_splits=bad)
    odd = jnp.zeros((2, 3, 6, 32))
    with pytest.raises(ValueError, match="page_size=6 is not a power of two"):
        ragged_paged_attention(q, odd, odd, tables, kv_lens, q_starts, impl="pallas_triton")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Triton kernel needs a GPU")
@pytest.mark.parametrize("kv_splits", [None, 1, 5])
def test_gpu_bf16_mixed_step_matches_reference(kv_splits):
    seqs = [(1500, 500)] + [(c, 1) for c in (0, 15, 16, 17, 1023, 2047, 700, 64)] + [(30, 4)]
    args, clean = _case(6, seqs, page=16, hq=32, hkv=8, d=128, pad_rows=7, pad_seqs=3,
                        dtype=jnp.bfloat16)
    out = ragged_paged_attention(*args, impl="pallas_triton", kv_splits=kv_splits)
    want = ragged_paged_attention(*clean, impl="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)


def test_lowers_for_the_gpu():
    """The Triton lowering (to Triton IR, then StableHLO) on any machine: the interpreter
    above never sees the Triton lowering rules. Both launches, a layer stack with a traced
    layer, float32 and bf16, split and unsplit launches."""
    def lower(dtype, q, pages, *, layer=False, kv_splits=None):
        def fn(q, k, v, tables, kv_lens, q_starts, *layer):
            return ragged_triton.ragged_paged_attention(
                q, k, v, tables, kv_lens, q_starts, layer=layer[0] if layer else None,
                sm_scale=0.1, interpret=False, kv_splits=kv_splits)
        shapes = [(q, dtype), (pages, dtype), (pages, dtype), ((5, 8), jnp.int32),
                  ((5,), jnp.int32), ((6,), jnp.int32)] + [((), jnp.int32)] * layer
        args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    lower(jnp.bfloat16, (64, 32, 128), (8, 32, 16, 128))
    lower(jnp.float32, (48, 16, 64), (3, 2, 32, 16, 64), layer=True)
    lower(jnp.bfloat16, (32, 16, 128), (8, 32, 16, 128), kv_splits=(3, 16))  # split, merged
    lower(jnp.bfloat16, (32, 16, 128), (8, 32, 16, 128), kv_splits=(1, 4))
