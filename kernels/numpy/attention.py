"""Paged attention for the NumPy backend: page by page, with an online (streaming) softmax.

The algorithm the CUDA kernel uses, in NumPy: K/V are read only through the page table (token `t` in
page `page_table[t // 16]`, slot `t % 16`), one 16-token page at a time; a running max `m`, running
sum `l` and unnormalised accumulator `acc` are rescaled as each page arrives. Only the slots below the
sequence's length are read, so the NaN that fills free pages and unwritten slots in tests is never
touched: a kernel that reads one slot too far turns the output NaN.

Query head `h` uses KV head `h // (nq / nkv)` (GQA). Arithmetic in fp32; the output is fp16.
"""

from __future__ import annotations

import numpy as np

PAGE = 16


def paged_attention(q, k_pages, v_pages, page_table, positions, out):
    """Causal attention: the query at `positions[t]` sees keys at positions `0 .. positions[t]`.

    q fp16 [T, nq, d]; k_pages, v_pages fp16 [num_pages, nkv, 16, d]; page_table int32 [>= pages];
    positions int32 [T]; out fp16 [T, nq * d].
    """
    T, nq, d = q.shape
    nkv = k_pages.shape[1]
    group = nq // nkv
    pos = np.asarray(positions, dtype=np.int64)
    scale = np.float32(1.0 / np.sqrt(d))
    qf = q.astype(np.float32).reshape(T, nkv, group, d) * scale  # [T, kv head, q per kv, d]

    n_keys = int(pos.max()) + 1
    m = np.full((T, nkv, group), -np.inf, dtype=np.float32)
    l = np.zeros((T, nkv, group), dtype=np.float32)
    acc = np.zeros((T, nkv, group, d), dtype=np.float32)
    for p in range(-(-n_keys // PAGE)):
        page = int(page_table[p])
        valid = min(PAGE, n_keys - p * PAGE)  # never read an unwritten slot
        k = k_pages[page, :, :valid].astype(np.float32)  # [nkv, valid, d]
        v = v_pages[page, :, :valid].astype(np.float32)
        s = np.einsum("tkgd,ksd->tkgs", qf, k)  # [T, nkv, group, valid]
        key_pos = p * PAGE + np.arange(valid)
        causal = key_pos[None, :] <= pos[:, None]  # [T, valid]
        s = np.where(causal[:, None, None, :], s, -np.inf)
        # Page 0 always holds key 0, which every query sees, so m is finite after the first page.
        m_new = np.maximum(m, s.max(axis=-1))
        alpha = np.exp(m - m_new)
        prob = np.exp(s - m_new[..., None])
        l = l * alpha + prob.sum(axis=-1)
        acc = acc * alpha[..., None] + np.einsum("tkgs,ksd->tkgd", prob, v)
        m = m_new
    out[...] = (acc / l[..., None]).reshape(T, nq * d)
