"""Paged KV cache: allocator properties, copy-on-write forks, pool exhaustion, device writes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxllm.inference.cache import (OutOfPagesError, PageAllocator, PagePool,
                                       token_slots, write_kv)
from jaxllm.kernels import paged_attention, reference

# ---------------------------------------------------------------------------------------
# Host allocator: a model-based property test. A shadow pool of token ids is written
# through the allocator's slots (and copies); every live sequence must read back exactly
# the tokens appended to it, which fails if a page is ever handed out twice or a shared
# page is written in place.

_OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc")),
    st.tuples(st.just("append"), st.integers(0, 7), st.integers(0, 11)),
    st.tuples(st.just("fork"), st.integers(0, 7)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 7), st.floats(0, 1)),
), max_size=60)


def _check_invariants(alloc, shadow, pool):
    ps = alloc.page_size
    users = {}
    for s, tokens in shadow.items():
        pages = alloc.pages(s)
        assert alloc.length(s) == len(tokens)
        assert len(pages) == -(-len(tokens) // ps)  # at most one partly filled page
        pos = np.arange(len(tokens))
        slots = np.asarray(pages, np.int64)[pos // ps] * ps + pos % ps
        np.testing.assert_array_equal(pool[slots], tokens)
        for p in pages:
            users[p] = users.get(p, 0) + 1
    for p in range(alloc.num_pages):
        assert alloc.refcount(p) == users.get(p, 0)
    assert alloc.num_free + len(users) == alloc.num_pages  # no page lost or listed twice


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, num_pages=st.integers(1, 12), page_size=st.sampled_from([1, 2, 4]))
def test_allocator_model(ops, num_pages, page_size):
    alloc = PageAllocator(num_pages, page_size, max_pages_per_seq=num_pages)
    shadow: dict[int, list[int]] = {}
    pool = np.full(num_pages * page_size, -1, np.int64)
    next_token = 0
    for op in ops:
        live = sorted(shadow)
        pick = (lambda i: live[i % len(live)]) if live else None
        if op[0] == "alloc":
            shadow[alloc.allocate()] = []
        elif op[0] == "fork" and live:
            s = pick(op[1])
            shadow[alloc.fork(s)] = list(shadow[s])
        elif op[0] == "free" and live:
            s = pick(op[1])
            alloc.free(s)
            del shadow[s]
        elif op[0] == "truncate" and live:
            s = pick(op[1])
            n = int(op[2] * len(shadow[s]))
            alloc.truncate(s, n)
            del shadow[s][n:]
        elif op[0] == "append" and live:
            s, n = pick(op[1]), op[2]
            before = (alloc.num_free, alloc.pages(s), alloc.length(s))
            try:
                (slots,), copies = alloc.append([s], [n])
            except OutOfPagesError:
                assert (alloc.num_free, alloc.pages(s), alloc.length(s)) == before
                continue
            except ValueError as e:  # longer than max_pages_per_seq
                assert "max_pages_per_seq" in str(e)
                continue
            for src, dst in copies:
                pool[dst * page_size:(dst + 1) * page_size] = \
                    pool[src * page_size:(src + 1) * page_size]
            tokens = list(range(next_token, next_token + n))
            next_token += n
            pool[slots] = tokens
            shadow[s] += tokens
        _check_invariants(alloc, shadow, pool)
    for s in list(shadow):
        alloc.free(s)
    assert alloc.num_free == num_pages
    assert all(alloc.refcount(p) == 0 for p in range(num_pages))


def _state(alloc):
    return ({s: (alloc.pages(s), alloc.length(s)) for s in alloc.sequences}, alloc.num_free,
            [alloc.refcount(p) for p in range(alloc.num_pages)])


_EXTEND_OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc")),
    st.tuples(st.just("extend"), st.lists(st.integers(0, 7), min_size=1, max_size=4),
              st.lists(st.integers(1, 4), min_size=4, max_size=4)),
    st.tuples(st.just("extend"), st.lists(st.integers(0, 7), min_size=2, max_size=4),
              st.lists(st.just(1), min_size=4, max_size=4)),
    st.tuples(st.just("fork"), st.integers(0, 7)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 7), st.floats(0, 1)),
), min_size=4, max_size=40)


@settings(max_examples=100, deadline=None)
@given(ops=_EXTEND_OPS, num_pages=st.integers(4, 24), page_size=st.sampled_from([1, 2, 4]))
def test_extend_is_append_as_arrays(ops, num_pages, page_size):
    """`extend` (a step's decode rows at once) leaves the allocator exactly as `append` of the
    same sequences in order: the same pages taken, the same slots, the same errors."""
    fast, ref = (PageAllocator(num_pages, page_size, max_pages_per_seq=num_pages)
                 for _ in range(2))
    for op in [("alloc",)] * 3 + ops:
        live = fast.sequences
        pick = (lambda i: live[i % len(live)]) if live else None
        if op[0] == "alloc":
            assert fast.allocate() == ref.allocate()
        elif op[0] == "fork" and live:
            assert fast.fork(pick(op[1])) == ref.fork(pick(op[1]))
        elif op[0] == "free" and live:
            fast.free(pick(op[1]))
            ref.free(pick(op[1]))
        elif op[0] == "truncate" and live:
            s = pick(op[1])
            n = int(op[2] * fast.length(s))
            fast.truncate(s, n)
            ref.truncate(s, n)
        elif op[0] == "extend" and live:
            seqs = list(dict.fromkeys(pick(i) for i in op[1]))
            counts = op[2][:len(seqs)]
            before = _state(fast)
            try:
                first = fast.extend(seqs, counts)
            except OutOfPagesError:
                assert _state(fast) == before
                with pytest.raises(OutOfPagesError):
                    ref.append(seqs, counts)
                continue
            except ValueError as e:  # too long, or a shared partly filled last page
                assert _state(fast) == before
                assert "max_pages_per_seq" in str(e) or "shares" in str(e)
                continue
            slots, copies = ref.append(seqs, counts)
            assert copies == []
            assert first.tolist() == [int(x[0]) for x in slots]
        assert _state(fast) == _state(ref)


def test_extend_refuses_repeated_or_unknown_sequences():
    alloc = PageAllocator(num_pages=8, page_size=4, max_pages_per_seq=8)
    a = alloc.allocate()
    with pytest.raises(ValueError, match="distinct"):
        alloc.extend([a, a], 1)
    with pytest.raises(ValueError, match="unknown sequence"):
        alloc.extend([a + 1], 1)
    assert alloc.extend([a], 5).tolist() == [alloc.pages(a)[0] * 4]
    assert alloc.block_tables([a], width=3).tolist() == [alloc.pages(a) + [8]]


def test_out_of_pages_is_catchable_and_changes_nothing():
    alloc = PageAllocator(num_pages=3, page_size=4, max_pages_per_seq=8)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.append([a], [9])  # 3 pages
    with pytest.raises(OutOfPagesError, match="free pages") as err:
        alloc.append([b, a], [1, 1])
    assert isinstance(err.value, ValueError)
    assert alloc.length(a) == 9 and alloc.length(b) == 0 and alloc.num_free == 0
    alloc.free(a)
    (slots_b,), copies = alloc.append([b], [5])
    assert len(set(slots_b.tolist())) == 5 and copies == [] and alloc.num_free == 1


def test_fork_shares_full_pages_and_copies_partial_page_once():
    alloc = PageAllocator(num_pages=8, page_size=4, max_pages_per_seq=8)
    parent = alloc.allocate()
    alloc.append([parent], [6])  # one full page, one half page
    child = alloc.fork(parent)
    (slots,), copies = alloc.append([child], [1])
    p_pages, c_pages = alloc.pages(parent), alloc.pages(child)
    assert p_pages[0] == c_pages[0] and alloc.refcount(p_pages[0]) == 2  # full page shared
    assert copies == [(p_pages[1], c_pages[1])] and c_pages[1] != p_pages[1]
    assert slots[0] == c_pages[1] * 4 + 2
    (slots,), copies = alloc.append([parent], [1])  # now exclusive again: in place
    assert copies == [] and slots[0] == p_pages[1] * 4 + 2


# ---------------------------------------------------------------------------------------
# Device pool: writes by slot and by position, copy-on-write on device, and the paged
# kernel reading the pool.

L, HKV, D, PS = 2, 2, 8, 4


def _rand(key, *shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _cache(num_pages=16):
    return PagePool.create(n_layers=L, n_kv_heads=HKV, head_dim=D, num_pages=num_pages,
                               page_size=PS, max_pages_per_seq=8, dtype=jnp.float32)


def test_prefill_chunks_then_batched_decode_gather_back():
    cache = _cache()
    a, b = cache.allocate(), cache.allocate()
    written = {a: [], b: []}
    for i, (s, n) in enumerate([(a, 7), (b, 3), (a, 6)]):  # prefill chunks
        k, v = _rand(i, L, n, HKV, D), _rand(100 + i, L, n, HKV, D)
        cache.append(s, k, v)
        written[s].append((k, v))
    c = cache.fork(a)
    written[c] = list(written[a])
    for step in range(5):  # batched decode: one token per sequence per step
        seqs = [a, b, c]
        k, v = _rand(200 + step, L, 3, HKV, D), _rand(300 + step, L, 3, HKV, D)
        cache.write(k, v, cache.reserve(seqs, [1, 1, 1]))
        for i, s in enumerate(seqs):
            written[s].append((k[:, i:i + 1], v[:, i:i + 1]))
    for s, chunks in written.items():
        gk, gv = cache.gather(s)
        np.testing.assert_array_equal(gk, jnp.concatenate([x for x, _ in chunks], axis=1))
        np.testing.assert_array_equal(gv, jnp.concatenate([y for _, y in chunks], axis=1))
    assert cache.allocator.length(c) == 18 and cache.allocator.length(b) == 8


def test_device_slots_from_positions_match_host_slots_and_drop_padding():
    cache = _cache()
    a, b = cache.allocate(), cache.allocate()
    cache.append(a, _rand(0, L, 5, HKV, D), _rand(1, L, 5, HKV, D))
    start = cache.allocator.lengths([a, b])
    host = cache.reserve([a, b], [3, 2])
    tables, _ = cache.tables([a, b])
    pos = jnp.asarray(start)[:, None] + jnp.arange(3)[None, :]
    pos = pos.at[1, 2].set(-1)  # padding: b only gets two tokens
    dev = token_slots(tables, pos, PS, cache.allocator.num_pages)
    np.testing.assert_array_equal(np.asarray(dev)[0], host[:3])
    np.testing.assert_array_equal(np.asarray(dev)[1, :2], host[3:])
    before = cache.k
    k, v = _rand(2, L, 2, 3, HKV, D), _rand(3, L, 2, 3, HKV, D)
    cache.k, cache.v = write_kv(cache.k, cache.v, k, v, dev)
    del before  # donated
    gk, _ = cache.gather(b)
    np.testing.assert_array_equal(gk, k[:, 1, :2])
    gk, gv = cache.gather(a)
    np.testing.assert_array_equal(gk[:, 5:], k[:, 0])
    np.testing.assert_array_equal(gv[:, 5:], v[:, 0])


def test_fork_copy_on_write_on_device_keeps_parent_intact():
    cache = _cache()
    parent = cache.allocate()
    kp, vp = _rand(0, L, 6, HKV, D), _rand(1, L, 6, HKV, D)
    cache.append(parent, kp, vp)
    child = cache.fork(parent)
    kc, vc = _rand(2, L, 3, HKV, D), _rand(3, L, 3, HKV, D)
    cache.append(child, kc, vc)
    kq, vq = _rand(4, L, 1, HKV, D), _rand(5, L, 1, HKV, D)
    cache.append(parent, kq, vq)
    gk, gv = cache.gather(parent)
    np.testing.assert_array_equal(gk, jnp.concatenate([kp, kq], 1))
    np.testing.assert_array_equal(gv, jnp.concatenate([vp, vq], 1))
    gk, gv = cache.gather(child)
    np.testing.assert_array_equal(gk, jnp.concatenate([kp, kc], 1))
    np.testing.assert_array_equal(gv, jnp.concatenate([vp, vc], 1))
    cache.free(parent)
    cache.free(child)
    assert cache.allocator.num_free == cache.allocator.num_pages


def test_out_of_pages_on_the_cache_then_recover():
    cache = _cache(num_pages=4)
    a, b = cache.allocate(), cache.allocate()
    cache.append(a, _rand(0, L, 12, HKV, D), _rand(1, L, 12, HKV, D))  # 3 pages
    with pytest.raises(OutOfPagesError):
        cache.append(b, _rand(2, L, 5, HKV, D), _rand(3, L, 5, HKV, D))
    assert cache.allocator.length(b) == 0
    cache.free(a)
    kb = _rand(4, L, 5, HKV, D)
    cache.append(b, kb, kb)
    np.testing.assert_array_equal(cache.gather(b)[0], kb)


def test_paged_attention_over_the_cache_matches_reference():
    cache = _cache()
    seqs = [cache.allocate() for _ in range(3)]
    for i, (s, n) in enumerate(zip(seqs, [9, 1, 14])):
        cache.append(s, _rand(10 + i, L, n, HKV, D), _rand(20 + i, L, n, HKV, D))
    tables, lengths = cache.tables(seqs, width=4)
    q = _rand(30, 3, 2 * HKV, D)
    for layer in range(L):
        out = paged_attention(q, cache.k[layer], cache.v[layer], tables, lengths,
                              impl="pallas_triton")
        want = reference.paged_attention(q, cache.k[layer], cache.v[layer], tables, lengths)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


def test_layer_loop_writes_and_stacked_pool_reads():
    """A jitted scan over layers: write_layer + the kernel reading the stacked pool in place."""
    from jaxllm.inference.cache import write_layer
    from jaxllm.kernels.pallas import paged_triton
    cache = _cache()
    seqs = [cache.allocate() for _ in range(2)]
    for i, s in enumerate(seqs):
        cache.append(s, _rand(40 + i, L, 5 + 4 * i, HKV, D), _rand(50 + i, L, 5 + 4 * i, HKV, D))
    slots = jnp.asarray(cache.reserve(seqs, [1, 1]))
    tables, lengths = cache.tables(seqs, width=4)
    k_new, v_new = _rand(60, L, 2, HKV, D), _rand(61, L, 2, HKV, D)
    q = _rand(62, L, 2, 2 * HKV, D)

    @jax.jit
    def step(k_pool, v_pool):
        def body(pools, xs):
            layer, kn, vn, ql = xs
            kp, vp = write_layer(*pools, layer, kn, vn, slots)
            o = paged_triton.paged_attention(ql, kp, vp, tables, lengths, layer=layer,
                                             sm_scale=D**-0.5)
            return (kp, vp), o
        return jax.lax.scan(body, (k_pool, v_pool), (jnp.arange(L), k_new, v_new, q))

    (cache.k, cache.v), out = step(cache.k, cache.v)
    for layer in range(L):
        want = reference.paged_attention(q[layer], cache.k[layer], cache.v[layer], tables,
                                         lengths)
        np.testing.assert_allclose(out[layer], want, atol=2e-5, rtol=2e-5)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(cache.gather(s)[0][:, -1], k_new[:, i])
