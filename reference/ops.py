"""`ref_*`: the simplest correct version of every Backend op, in NumPy float64.

Each takes `dtype=` (float64 by default): the same function in float32, on inputs already rounded to
their storage dtype, is the "plain implementation" whose error sets an op's noise floor.

Naive on purpose: loops over tokens and pages, no online softmax, no fused anything. Independent of
engine/ and kernels/ (a test enforces it): quantized weights arrive here as plain float matrices (each
format's stored tensors are read, a third time, from docs/FORMAT.md, by reference/formats.py).
"""

from __future__ import annotations

import numpy as np

PAGE = 16


def ref_embed(ids, table, dtype=np.float64) -> np.ndarray:
    return np.asarray(table, dtype=dtype)[np.asarray(ids)]


def ref_rmsnorm(x, weight, eps, dtype=np.float64) -> np.ndarray:
    x = np.asarray(x, dtype=dtype)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + dtype(eps)) * np.asarray(weight, dtype=dtype)


def ref_linear(x, w, bias=None, dtype=np.float64) -> np.ndarray:
    """x [T, in] @ w[out, in].T (+ bias)."""
    y = np.asarray(x, dtype=dtype) @ np.asarray(w, dtype=dtype).T
    return y if bias is None else y + np.asarray(bias, dtype=dtype)


def ref_silu(x) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def ref_gate_up_silu(x, w_gate, w_up, dtype=np.float64) -> np.ndarray:
    return ref_silu(ref_linear(x, w_gate, dtype=dtype)) * ref_linear(x, w_up, dtype=dtype)


def ref_rope(x, positions, theta, dtype=np.float64) -> np.ndarray:
    """Rotate-half RoPE (Qwen2/HF convention) of x [T, heads, d] at integer positions."""
    x = np.asarray(x, dtype=dtype)
    d = x.shape[-1]
    inv_freq = (1.0 / dtype(theta) ** (np.arange(0, d, 2, dtype=dtype) / dtype(d))).astype(dtype)
    ang = np.asarray(positions, dtype=dtype)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def ref_gather_pages(pages, page_table, length, dtype=np.float64) -> np.ndarray:
    """[length, heads, d] from pages [num_pages, heads, 16, d] through the page table."""
    pages = np.asarray(pages)
    rows = [pages[page_table[t // PAGE], :, t % PAGE] for t in range(length)]
    return np.asarray(rows, dtype=dtype).reshape(length, pages.shape[1], pages.shape[3])


def ref_attention(q, k, v, positions, dtype=np.float64) -> np.ndarray:
    """Causal GQA attention. q [T, nq, d]; k, v [L, nkv, d] (contiguous); query t sees keys
    0 .. positions[t]. Returns [T, nq * d]."""
    q, k, v = (np.asarray(a, dtype=dtype) for a in (q, k, v))
    T, nq, d = q.shape
    group = nq // k.shape[1]
    out = np.zeros((T, nq, d), dtype=dtype)
    for t in range(T):
        n = int(positions[t]) + 1
        for h in range(nq):
            s = k[:n, h // group] @ q[t, h] / dtype(np.sqrt(d))
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[:n, h // group]
    return out.reshape(T, nq * d)


def ref_paged_attention(q, k_pages, v_pages, page_table, positions, dtype=np.float64) -> np.ndarray:
    """ref_attention over keys gathered through the page table (only the valid prefix is read)."""
    n = int(np.max(positions)) + 1
    k = ref_gather_pages(k_pages, page_table, n, dtype)
    v = ref_gather_pages(v_pages, page_table, n, dtype)
    return ref_attention(q, k, v, positions, dtype)


def ref_lm_head(x, weight, dtype=np.float64) -> np.ndarray:
    return ref_linear(x, weight, dtype=dtype)


def ref_argmax(logits) -> int:
    """Index of the maximum; the lowest index among equal maxima."""
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    return int(np.flatnonzero(logits == logits.max())[0])
