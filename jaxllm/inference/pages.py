"""Host bookkeeping of the paged KV cache: which pages each sequence owns.

A sequence owns a list of pages and a length; token t lives in page `table[t // page_size]`
at offset `t % page_size`, so its flat pool slot is `page * page_size + offset`. Pages are
taken one at a time as tokens arrive, so a sequence wastes at most its last, partly filled
page. Pages are refcounted: a fork shares its parent's pages, and the first write into a
shared, partly filled last page copies it (copy-on-write). Running out of pages raises
`OutOfPagesError` before anything changes.

The state is arrays, one row per sequence (sequence ids are rows, reused once freed): the
block table [rows, max_pages_per_seq] (entries past a sequence's pages are `num_pages`, one
past the pool) and the lengths. So the serving engine's per-step questions are array
operations: `extend` reserves the next tokens of hundreds of decoding sequences at once
(a Python loop only over the few that start a page), and `block_tables` is one gather.
"""
from __future__ import annotations

import heapq

import numpy as np


class OutOfPagesError(ValueError):
    """The page pool has too few free pages for the request; nothing was changed."""


class PageAllocator:
    """Which pages each sequence owns, with refcounts for pages shared by forks."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        if num_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
            raise ValueError(f"num_pages={num_pages}, page_size={page_size} and "
                             f"max_pages_per_seq={max_pages_per_seq} must all be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self.max_pages_per_seq = max_pages_per_seq
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low page ids first
        self._refs = np.zeros(num_pages, np.int32)
        self._tables = np.full((0, max_pages_per_seq), num_pages, np.int32)  # a row a seq
        self._lengths = np.zeros(0, np.int64)
        self._live = np.zeros(0, bool)
        self._free_ids: list[int] = []  # a heap of the unused rows: the lowest is reused first

    # ---- queries ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        return np.flatnonzero(self._live).tolist()

    def length(self, seq: int) -> int:
        return int(self._lengths[self._check(seq)])

    def pages(self, seq: int) -> list[int]:
        return self._tables[self._check(seq), :self._n_pages(self._lengths[seq])].tolist()

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def block_tables(self, seqs, width: int | None = None, out: np.ndarray | None = None
                     ) -> np.ndarray:
        """int32 [len(seqs), width] (into `out` when given: its width). Entries past a
        sequence's pages are `num_pages`, one past the pool: reads there are masked by
        length and writes (padding) are dropped."""
        seqs = self._check_all(seqs)
        if out is None:
            width = self.max_pages_per_seq if width is None else width
            out = np.empty((len(seqs), width), np.int32)
        width = out.shape[1]
        n_pages = self._n_pages(self._lengths[seqs])
        if len(seqs) and n_pages.max() > width:
            s = int(seqs[n_pages.argmax()])
            raise ValueError(f"sequence {s} has {n_pages.max()} pages; width={width} is too small")
        w = min(width, self.max_pages_per_seq)
        np.take(self._tables[:, :w], seqs, axis=0, out=out[:, :w], mode="clip")
        out[:, w:] = self.num_pages
        return out

    def lengths(self, seqs) -> np.ndarray:
        return self._lengths[self._check_all(seqs)].astype(np.int32)

    # ---- changes ----
    def allocate(self) -> int:
        """A new, empty sequence (it holds no page until tokens are appended)."""
        if not self._free_ids:
            self._grow()
        seq = heapq.heappop(self._free_ids)
        self._live[seq], self._lengths[seq] = True, 0
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence sharing all of `seq`'s pages and length (copy-on-write)."""
        self._check(seq)
        child = self.allocate()
        self._tables[child], self._lengths[child] = self._tables[seq], self._lengths[seq]
        self._refs[self._tables[child, :self._n_pages(self._lengths[child])]] += 1
        return child

    def free(self, seq: int) -> None:
        for p in self.pages(seq):
            self._release(p)
        self._tables[seq], self._lengths[seq], self._live[seq] = self.num_pages, 0, False
        heapq.heappush(self._free_ids, seq)

    def truncate(self, seq: int, length: int) -> None:
        """Drop tokens past `length` (e.g. rejected speculative tokens); frees unused pages."""
        if not 0 <= length <= self.length(seq):
            raise ValueError(f"cannot truncate sequence {seq} of length {self.length(seq)} "
                             f"to {length}")
        keep = self._n_pages(length)
        for p in self.pages(seq)[keep:]:
            self._release(p)
        self._tables[seq, keep:] = self.num_pages
        self._lengths[seq] = length

    def append(self, seqs, counts) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
        """Reserve room for counts[i] more tokens in seqs[i], all or nothing.

        Returns (slots, copies): slots[i] is int32 [counts[i]], the flat pool slot
        (page * page_size + offset) of each new token in order; copies are the
        (src_page, dst_page) copies to run on the device before writing (copy-on-write of
        shared, partly filled last pages). Raises OutOfPagesError (nothing changed) when
        the free pages do not suffice.
        """
        seqs, counts = [int(s) for s in seqs], [int(c) for c in counts]
        if len(seqs) != len(counts) or len(set(seqs)) != len(seqs):
            raise ValueError(f"append wants distinct sequences and one count each; got "
                             f"seqs={seqs} counts={counts}")
        need = 0
        for s, n in zip(seqs, counts):
            length = self.length(s)
            if n < 0:
                raise ValueError(f"cannot append {n} tokens to sequence {s}")
            self._check_fits(s, length + n)
            need += self._n_pages(length + n) - self._n_pages(length) + int(self._needs_copy(s, n))
        self._check_free(need)
        slots, copies = [], []
        ps = self.page_size
        for s, n in zip(seqs, counts):
            length, row = int(self._lengths[s]), self._tables[s]
            have = self._n_pages(length)
            if self._needs_copy(s, n):
                new = self._take()
                copies.append((int(row[have - 1]), new))
                self._release(int(row[have - 1]))
                row[have - 1] = new
            for c in range(have, self._n_pages(length + n)):
                row[c] = self._take()
            pos = np.arange(length, length + n)
            slots.append((row[pos // ps].astype(np.int64) * ps + pos % ps).astype(np.int32))
            self._lengths[s] = length + n
        return slots, copies

    def extend(self, seqs, counts) -> np.ndarray:
        """Room for counts[i] >= 1 more tokens in each of the distinct sequences seqs[i], all
        or nothing, as array operations (a serving step's decode rows, a decode window):
        the flat pool slot of each one's first new token, int32 [len(seqs)] (the others
        follow in its block table). Pages are taken in the order of `seqs`, as `append`
        takes them. A partly filled last page must be the sequence's own (ValueError:
        `append` copies a shared one); OutOfPagesError changes nothing."""
        seqs = self._check_all(seqs)
        counts = np.broadcast_to(np.asarray(counts, np.int64), seqs.shape)
        if len(np.unique(seqs)) != len(seqs) or (counts < 1).any():
            raise ValueError(f"extend wants distinct sequences and counts >= 1; got "
                             f"seqs={seqs.tolist()} counts={counts.tolist()}")
        length = self._lengths[seqs]
        have, need = self._n_pages(length), self._n_pages(length + counts)
        if (need > self.max_pages_per_seq).any():
            i = int(need.argmax())
            self._check_fits(int(seqs[i]), int(length[i] + counts[i]))
        last = self._tables[seqs, np.maximum(have - 1, 0)]
        refs = self._refs[np.minimum(last, self.num_pages - 1)]
        shared = (length % self.page_size != 0) & (refs > 1)
        if shared.any():
            raise ValueError(f"sequence {int(seqs[shared.argmax()])} shares its partly filled "
                             f"last page; append copies it before writing")
        self._check_free(int((need - have).sum()))
        for i in np.flatnonzero(need > have).tolist():
            row = self._tables[seqs[i]]
            for c in range(int(have[i]), int(need[i])):
                row[c] = self._take()
        self._lengths[seqs] = length + counts
        return (self._tables[seqs, length // self.page_size] * self.page_size
                + length % self.page_size).astype(np.int32)

    # ---- internals ----
    def _n_pages(self, length):
        return -(-length // self.page_size)

    def _check(self, seq: int) -> int:
        if not (isinstance(seq, (int, np.integer)) and 0 <= seq < len(self._live)
                and self._live[seq]):
            raise ValueError(f"unknown sequence id {seq}; live ones: {self.sequences}")
        return seq

    def _check_all(self, seqs) -> np.ndarray:
        seqs = np.asarray(seqs, np.int64).reshape(-1)
        ok = (seqs >= 0) & (seqs < len(self._live))
        if not ok.all() or not self._live[seqs].all():
            bad = [int(s) for s in seqs if not (0 <= s < len(self._live) and self._live[s])]
            raise ValueError(f"unknown sequence ids {bad}; live ones: {self.sequences}")
        return seqs

    def _check_fits(self, seq: int, length: int) -> None:
        total = self._n_pages(length)
        if total > self.max_pages_per_seq:
            raise ValueError(f"sequence {seq} would need {total} pages for {length} tokens; "
                             f"max_pages_per_seq={self.max_pages_per_seq}")

    def _check_free(self, need: int) -> None:
        if need > self.num_free:
            raise OutOfPagesError(f"need {need} free pages for this append but only "
                                  f"{self.num_free} of {self.num_pages} are free; free or "
                                  f"preempt sequences, or make the pool larger")

    def _needs_copy(self, seq: int, n: int) -> bool:
        length = int(self._lengths[seq])
        if n <= 0 or length % self.page_size == 0:
            return False
        return self._refs[self._tables[seq, self._n_pages(length) - 1]] > 1

    def _grow(self) -> None:
        rows = len(self._live)
        more = max(rows, 8)
        self._tables = np.concatenate(
            [self._tables, np.full((more, self.max_pages_per_seq), self.num_pages, np.int32)])
        self._lengths = np.concatenate([self._lengths, np.zeros(more, np.int64)])
        self._live = np.concatenate([self._live, np.zeros(more, bool)])
        for seq in range(rows, rows + more):
            heapq.heappush(self._free_ids, seq)

    def _take(self) -> int:
        page = self._pop_free()
        assert self._refs[page] == 0, f"page {page} handed out while still referenced"
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        assert self._refs[page] >= 0
        if self._refs[page] == 0:
            self._unused(page)

    # where free pages come from and go (the prefix cache keeps some of them)
    def _pop_free(self) -> int:
        return self._free.pop()

    def _unused(self, page: int) -> None:
        self._free.append(page)
