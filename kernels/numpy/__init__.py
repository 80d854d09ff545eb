"""The NumPy backend: every op of DESIGN.md's table on the CPU, the same algorithms as the GPU.

Not the reference: it stores what the GPU stores (fp16 activations and KV pages, an fp32 residual)
and computes in fp32, unpacks the packed INT4 words itself, reads K/V through the page table, and
runs attention page by page with an online softmax. Every op writes into a caller-allocated `out`
(assignment into `out[...]` rounds to the buffer's dtype, as a GPU store would). Signatures:
docs/BACKEND.md.
"""

from __future__ import annotations

import numpy as np

from kernels import FormatNotSupportedError, QuantizedWeight
from kernels.numpy.attention import paged_attention
from kernels.numpy.int4 import LINEAR_KERNELS


class NumpyBackend:
    name = "numpy"
    formats = tuple(LINEAR_KERNELS)

    # --- memory -------------------------------------------------------------------------------

    def asarray(self, a, dtype=None):
        return np.ascontiguousarray(a, dtype=dtype)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def full(self, shape, value, dtype):
        return np.full(shape, value, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        return np.asarray(a)

    def synchronize(self) -> None:
        pass

    def prepare_linear(self, fmt: str, tensors: dict, out_features: int, in_features: int) -> QuantizedWeight:
        if fmt not in LINEAR_KERNELS:
            raise FormatNotSupportedError(f"backend 'numpy' has no kernel for format {fmt!r}")
        return QuantizedWeight(fmt, out_features, in_features,
                               {k: np.ascontiguousarray(v) for k, v in tensors.items()})

    def _linear(self, x, w: QuantizedWeight) -> np.ndarray:
        try:
            kernel = LINEAR_KERNELS[w.format]
        except KeyError:
            raise FormatNotSupportedError(f"backend 'numpy' has no kernel for format {w.format!r}") from None
        return kernel(x, w)

    # --- ops (DESIGN.md's table) --------------------------------------------------------------

    def embed(self, ids, table, out):
        out[...] = table[np.asarray(ids, dtype=np.int64)]

    def rmsnorm(self, x, weight, eps, out):
        xf = x.astype(np.float32)
        inv = 1.0 / np.sqrt((xf * xf).mean(axis=-1, keepdims=True) + np.float32(eps))
        out[...] = xf * inv * weight.astype(np.float32)

    def qkv_proj(self, x, w, bias, out):
        out[...] = self._linear(x, w) + bias.astype(np.float32)

    def rope_kv_write(self, qkv, positions, k_pages, v_pages, page_table, theta, q_out):
        T, nq, d = q_out.shape
        nkv = k_pages.shape[1]
        pos = np.asarray(positions, dtype=np.int64)
        # Rotation angles in fp32, as the GPU computes them: inv_freq[i] = theta^(-2i/d).
        inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(np.float32)
        ang = pos.astype(np.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]  # [T, 1, d/2]

        def rotate(x):  # x fp32 [T, heads, d], rotate-half convention of Qwen2/HF
            x1, x2 = x[..., : d // 2], x[..., d // 2:]
            return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

        qkv32 = qkv.astype(np.float32)
        q = qkv32[:, : nq * d].reshape(T, nq, d)
        k = qkv32[:, nq * d: (nq + nkv) * d].reshape(T, nkv, d)
        v = qkv[:, (nq + nkv) * d:].reshape(T, nkv, d)
        q_out[...] = rotate(q)
        k_rot = rotate(k).astype(np.float16)
        pages = np.asarray(page_table)[pos // 16]
        slots = pos % 16
        for t in range(T):
            k_pages[pages[t], :, slots[t]] = k_rot[t]
            v_pages[pages[t], :, slots[t]] = v[t]

    def attention_prefill(self, q, k_pages, v_pages, page_table, positions, out):
        paged_attention(q, k_pages, v_pages, page_table, positions, out)

    def attention_decode(self, q, k_pages, v_pages, page_table, positions, out):
        paged_attention(q, k_pages, v_pages, page_table, positions, out)

    def o_proj_residual(self, x, w, residual):
        residual += self._linear(x, w)

    def gate_up_silu(self, x, w, out):
        inter = w.out_features // 2
        gu = self._linear(x, w)  # rows [gate; up] -> [T, 2I]
        g, u = gu[:, :inter], gu[:, inter:]
        out[...] = g / (np.float32(1.0) + np.exp(-g)) * u

    def down_residual(self, x, w, residual):
        residual += self._linear(x, w)

    def lm_head(self, x, weight, out):
        out[...] = (x.astype(np.float32) @ weight.astype(np.float32).T).reshape(out.shape)

    def argmax(self, logits, out):
        out[...] = np.argmax(logits.reshape(-1))  # first maximum: the lowest index wins a tie
