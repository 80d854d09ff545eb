"""The paged KV cache (docs/ARCHITECTURE.md, "The KV cache").

Per layer, K and V are fp16 `[num_pages, num_kv_heads, 16, head_dim]`. A sequence owns an int32 page
table shared by every layer and head: token `t` lives in page `page_table[t // 16]`, slot `t % 16`.
Pages come from one allocator and need not be contiguous or ordered (`shuffle_seed` hands them out in
a seeded random order, which tests use). With `debug_nan`, every free page and every unwritten slot
holds NaN, so a kernel that reads past a sequence's length produces NaN instead of a plausible number.
"""

from __future__ import annotations

import numpy as np

from engine.config import PAGE_SIZE, Qwen2Config
from engine.errors import OutOfPagesError, PromptTooLongError


class PageAllocator:
    def __init__(self, num_pages: int, shuffle_seed: int | None = None):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        order = np.arange(num_pages)
        if shuffle_seed is not None:
            order = np.random.default_rng(shuffle_seed).permutation(num_pages)
        self.num_pages = num_pages
        self._free = [int(p) for p in order[::-1]]  # pop() from the end hands out `order` front first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPagesError(f"KV cache out of pages: all {self.num_pages} pages of {PAGE_SIZE} tokens are in use")
        return self._free.pop()

    def free(self, pages) -> None:
        self._free.extend(int(p) for p in reversed(list(pages)))


class PagedKVCache:
    def __init__(self, config: Qwen2Config, backend, num_pages: int, max_pages_per_seq: int | None = None,
                 debug_nan: bool = False, shuffle_seed: int | None = None):
        self.config = config
        self.backend = backend
        self.num_pages = num_pages
        self.max_pages_per_seq = max_pages_per_seq or num_pages
        self.debug_nan = debug_nan
        fill = np.nan if debug_nan else 0.0
        shape = (num_pages, config.num_key_value_heads, PAGE_SIZE, config.head_dim)
        self.k = [backend.full(shape, fill, np.float16) for _ in range(config.num_hidden_layers)]
        self.v = [backend.full(shape, fill, np.float16) for _ in range(config.num_hidden_layers)]
        self.allocator = PageAllocator(num_pages, shuffle_seed)

    @property
    def capacity(self) -> int:
        """Most tokens one sequence can hold."""
        return self.max_pages_per_seq * PAGE_SIZE

    def new_sequence(self) -> "Sequence":
        return Sequence(self)

    def _release(self, pages) -> None:
        if self.debug_nan:  # a freed page must not keep plausible values that a stale read could use
            for layer in range(self.config.num_hidden_layers):
                for p in pages:
                    self.k[layer][p] = np.nan
                    self.v[layer][p] = np.nan
        self.allocator.free(pages)


class Sequence:
    """One sequence's view of the cache: its page table (host and device copies) and its length."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.length = 0
        self.pages: list[int] = []
        # -1 marks an entry with no page yet; a correct kernel never dereferences one.
        self.page_table_host = np.full(cache.max_pages_per_seq, -1, dtype=np.int32)
        self.page_table = cache.backend.asarray(self.page_table_host)

    def reserve(self, n_new: int) -> None:
        """Make room for `n_new` more tokens, allocating pages as needed."""
        need = self.length + n_new
        if need > self.cache.capacity:
            raise PromptTooLongError(f"sequence of {need} tokens does not fit the KV cache's "
                                     f"{self.cache.capacity} tokens per sequence")
        grew = False
        while len(self.pages) * PAGE_SIZE < need:
            page = self.cache.allocator.allocate()
            self.page_table_host[len(self.pages)] = page
            self.pages.append(page)
            grew = True
        if grew:
            self.page_table[...] = self.cache.backend.asarray(self.page_table_host)

    def free(self) -> None:
        self.cache._release(self.pages)
        self.pages = []
        self.length = 0
        self.page_table_host[:] = -1
        self.page_table[...] = self.cache.backend.asarray(self.page_table_host)

    def gather(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of this sequence for one layer, fp16 `[length, num_kv_heads, head_dim]` (for tests)."""
        be = self.cache.backend
        k = be.to_numpy(self.cache.k[layer])
        v = be.to_numpy(self.cache.v[layer])
        t = np.arange(self.length)
        pages = self.page_table_host[t // PAGE_SIZE]
        return k[pages, :, t % PAGE_SIZE], v[pages, :, t % PAGE_SIZE]
