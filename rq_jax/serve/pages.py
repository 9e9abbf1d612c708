"""The page pool the scheduler plans over: a cache of `num_pages` pages of `page_size` tokens (every loop and
layer of those tokens: `rq_jax.cache.kv.init_paged_cache`). A page is free, held (reference-counted:
requests sharing a prefix hold the same page), or cached: unreferenced but indexed by the hash of its
tokens and all the tokens before them (`prefix_hashes`), kept until its page is needed (least recently
released first). Pages are Python ints; no arrays live here."""

from __future__ import annotations

import collections
import hashlib


class PagePool:
    """`num_pages` pages: free, held (reference-counted) or cached (unreferenced, indexed by hash, evicted
    least recently released first)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.free: collections.deque[int] = collections.deque(range(num_pages))
        self.hash_of: dict[int, bytes] = {}  # page -> its prefix hash (indexed pages only)
        self.index: dict[bytes, int] = {}  # prefix hash -> page
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced, indexed
        self.evictions = 0

    @property
    def available(self) -> int:
        """Pages an allocation can take: the free ones and the cached ones it would evict."""
        return len(self.free) + len(self.cached)

    @property
    def held(self) -> int:
        return self.num_pages - self.available

    def allocate(self) -> int | None:
        """A page for new tokens (held once), or None when every page is held."""
        if self.free:
            page = self.free.popleft()
        elif self.cached:
            page, _ = self.cached.popitem(last=False)
            del self.index[self.hash_of.pop(page)]
            self.evictions += 1
        else:
            return None
        self.refs[page] = 1
        return page

    def share(self, key: bytes) -> int | None:
        """The indexed page of prefix hash `key`, held once more; None when none is indexed."""
        page = self.index.get(key)
        if page is None:
            return None
        if self.refs[page] == 0:
            del self.cached[page]
        self.refs[page] += 1
        return page

    def register(self, page: int, key: bytes) -> None:
        """Index held page `page` under prefix hash `key` (a full page whose K/V are final). A key already
        indexed keeps its page."""
        if key not in self.index and page not in self.hash_of:
            self.index[key] = page
            self.hash_of[page] = key

    def release(self, page: int) -> None:
        """Hold `page` once less; unreferenced, it is cached when indexed, else free."""
        if self.refs[page] < 1:
            raise RuntimeError(f"page {page} released more often than it was held")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.hash_of:
                self.cached[page] = None
            else:
                self.free.append(page)

    def check(self, held: collections.Counter) -> None:
        """Raise AssertionError unless every page's count is `held[page]` (the holders the caller knows of)
        and every page is exactly one of free, cached or held."""
        for page in range(self.num_pages):
            assert self.refs[page] == held[page], (page, self.refs[page], held[page])
            states = (page in self.free) + (page in self.cached) + (self.refs[page] > 0)
            assert states == 1, (page, states)


def prefix_hashes(tokens: list[int], page_size: int, cache_key: str) -> list[bytes]:
    """The prefix hash of every full page of `tokens`: page i's covers tokens [0, (i+1)·page_size) and
    `cache_key` (the cache format and calibration they were stored under)."""
    out, h = [], hashlib.sha256(cache_key.encode()).digest()
    for i in range(len(tokens) // page_size):
        h = hashlib.sha256(h + repr(tokens[i * page_size : (i + 1) * page_size]).encode()).digest()
        out.append(h)
    return out
