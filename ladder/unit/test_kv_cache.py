"""Unit rung: the paged KV cache's allocator, page tables and debug NaN fill."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import SHAPES
from engine.errors import OutOfPagesError, PromptTooLongError
from engine.kv_cache import PageAllocator, PagedKVCache
from kernels import get_backend

CFG = SHAPES["tiny"]


def test_allocator_hands_out_every_page_once_then_refuses():
    a = PageAllocator(num_pages=5, shuffle_seed=3)
    pages = [a.allocate() for _ in range(5)]
    assert sorted(pages) == list(range(5)) and pages != sorted(pages)
    with pytest.raises(OutOfPagesError, match="out of pages"):
        a.allocate()
    a.free(pages[:2])
    assert a.num_free == 2


def test_page_table_maps_token_t_to_page_t_div_16():
    cache = PagedKVCache(CFG, get_backend("numpy"), num_pages=8, shuffle_seed=1)
    seq = cache.new_sequence()
    seq.reserve(33)
    assert len(seq.pages) == 3 and len(set(seq.pages)) == 3
    assert list(seq.page_table_host[:3]) == seq.pages and (seq.page_table_host[3:] == -1).all()
    seq.length = 33
    seq.reserve(15)  # 48 tokens still fit three pages
    assert len(seq.pages) == 3
    seq.reserve(16)
    assert len(seq.pages) == 4


def test_two_sequences_share_the_pool_without_sharing_pages():
    cache = PagedKVCache(CFG, get_backend("numpy"), num_pages=4)
    a, b = cache.new_sequence(), cache.new_sequence()
    a.reserve(32)
    b.reserve(32)
    assert not set(a.pages) & set(b.pages)
    with pytest.raises(OutOfPagesError):
        cache.new_sequence().reserve(1)
    a.free()
    cache.new_sequence().reserve(32)


def test_sequence_longer_than_its_page_table_is_refused():
    cache = PagedKVCache(CFG, get_backend("numpy"), num_pages=16, max_pages_per_seq=2)
    with pytest.raises(PromptTooLongError, match="32 tokens"):
        cache.new_sequence().reserve(33)


def test_debug_mode_keeps_free_pages_and_unwritten_slots_nan():
    cache = PagedKVCache(CFG, get_backend("numpy"), num_pages=4, debug_nan=True)
    assert np.isnan(cache.k[0]).all() and np.isnan(cache.v[-1]).all()
    seq = cache.new_sequence()
    seq.reserve(3)
    cache.k[0][seq.pages[0], :, :3] = 1.0
    seq.free()
    assert np.isnan(cache.k[0]).all(), "a freed page must be NaN again"
