"""Prefix caching: full KV pages found again by the tokens that filled them.

A full page is keyed by a chain hash, h_j = H(h_{j-1}, tokens of page j), so equal keys mean
equal tokens from the start of the sequence up to the page's end, and so equal K/V. A new
sequence takes every cached page of its prefix (`allocate_prefix`: refcounts go up, nothing
is copied); pages it fills are registered as they fill (`register`). A cached page whose last
user is gone is not freed but parked, least recently used first, and handed out again as an
empty page only when no never-used page is left (eviction drops its key).

The prefix a sequence takes stops before the page holding its last known token, so that
token is always computed (its logits are needed) and every write lands in a page the
sequence owns alone: shared pages are never written, and need no copy.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from jaxllm.inference.pages import PageAllocator


def chain_hash(parent: bytes, tokens) -> bytes:
    """The key of a full page holding `tokens`, after the page keyed `parent` (b"" first)."""
    return _chain(parent, np.asarray(tokens, np.int64).tobytes())


def _chain(parent: bytes, page: bytes) -> bytes:
    """chain_hash of a page given as its tokens' int64 bytes."""
    return hashlib.blake2b(parent + page, digest_size=16).digest()


class PrefixCachingAllocator(PageAllocator):
    """A PageAllocator whose full pages outlive their sequences as a prefix cache.

    `num_free` counts never-used pages and parked cached ones: both can be handed out."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        super().__init__(num_pages, page_size, max_pages_per_seq)
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._key_of: dict[int, bytes] = {}  # page -> key
        self._parked: OrderedDict[int, None] = OrderedDict()  # cached, unused; LRU first
        self._keys: dict[int, list[bytes]] = {}  # seq -> keys of its leading full pages
        self._n_keys = np.zeros(0, np.int64)  # len(self._keys[seq]) by sequence row

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._parked)

    @property
    def num_cached(self) -> int:
        """Pages holding a registered prefix (in use or parked)."""
        return len(self._key_of)

    def match(self, tokens) -> list[int]:
        """The cached pages of the longest registered prefix of `tokens`, stopping before
        the page that holds the last token."""
        return self._match(tokens)[0]

    def _match(self, tokens) -> tuple[list[int], list[bytes]]:
        """match's pages and their keys."""
        ps, pages, keys, key = self.page_size, [], [], b""
        n_full = (len(tokens) - 1) // ps
        # every page's bytes in one conversion, not an array a page
        data, step = np.asarray(tokens[:n_full * ps], np.int64).tobytes(), 8 * ps
        page_of = self._page_of
        for j in range(n_full):
            key = _chain(key, data[j * step:(j + 1) * step])
            page = page_of.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
        return pages, keys

    def allocate_prefix(self, tokens) -> tuple[int, int]:
        """A new sequence holding the cached prefix of `tokens` -> (seq, cached tokens)."""
        pages, keys = self._match(tokens)
        seq = self.allocate()
        if pages:
            idx = np.asarray(pages)  # distinct pages: one increment each
            for p in idx[self._refs[idx] == 0].tolist():  # parked until now
                del self._parked[p]
            self._refs[idx] += 1
        self._tables[seq, :len(pages)] = pages
        self._lengths[seq] = len(pages) * self.page_size
        self._keys[seq] = keys
        self._n_keys[seq] = len(pages)
        return seq, int(self._lengths[seq])

    def unkeyed(self, seqs, n_tokens) -> np.ndarray:
        """The indices i of the sequences seqs[i] (their known tokens: n_tokens[i]) that have
        written full pages not yet keyed: the ones `register` has work for."""
        seqs = self._check_all(seqs)
        full = np.minimum(self._lengths[seqs], n_tokens) // self.page_size
        return np.flatnonzero(full > self._n_keys[seqs])

    def register(self, seq: int, tokens) -> None:
        """Key the full pages of `seq` whose tokens (`tokens`: the sequence's, from the
        start) are now written. A page whose key is already held by another page stays
        unkeyed (two sequences computed the same prefix at once)."""
        keys = self._keys.setdefault(self._check(seq), [])
        ps = self.page_size
        full = min(int(self._lengths[seq]), len(tokens)) // ps
        while len(keys) < full:
            j = len(keys)
            page = int(self._tables[seq, j])
            key = chain_hash(keys[-1] if keys else b"", tokens[j * ps:(j + 1) * ps])
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key], self._key_of[page] = page, key
            keys.append(key)
        self._n_keys[seq] = len(keys)

    def free(self, seq: int) -> None:
        super().free(seq)
        self._keys.pop(seq, None)
        self._n_keys[seq] = 0

    def truncate(self, seq: int, length: int) -> None:
        super().truncate(seq, length)
        keys = self._keys.get(seq)
        if keys is not None:
            del keys[length // self.page_size:]
            self._n_keys[seq] = len(keys)

    def fork(self, seq: int) -> int:
        child = super().fork(seq)
        self._keys[child] = list(self._keys.get(seq, []))
        self._n_keys[child] = len(self._keys[child])
        return child

    def _grow(self) -> None:
        super()._grow()
        self._n_keys = np.concatenate(
            [self._n_keys, np.zeros(len(self._live) - len(self._n_keys), np.int64)])

    def _pop_free(self) -> int:
        if self._free:
            return self._free.pop()
        page, _ = self._parked.popitem(last=False)  # evict the least recently used
        del self._page_of[self._key_of.pop(page)]
        return page

    def _unused(self, page: int) -> None:
        if page in self._key_of:
            self._parked[page] = None  # most recently used last
        else:
            self._free.append(page)
