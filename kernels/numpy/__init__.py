"""The NumPy backend: every op of docs/BACKEND.md's table on the CPU, the same algorithms as the GPU.

Not the reference: it stores what the GPU stores (fp16 activations and KV pages, an fp32 residual)
and computes in fp32, unpacks the packed INT4 words itself, reads K/V through the page table, and
runs attention page by page with an online softmax. Every op writes into a caller-allocated `out`
(assignment into `out[...]` rounds to the buffer's dtype, as a GPU store would). Signatures:
docs/BACKEND.md.

Speed at a real size (bench/numpy_decode.py, bench/NOTES.md) comes from widening once instead of per
call, within a size budget per backend object (`repack_bytes`; default DEFAULT_REPACK_MB, or the
environment's NANOQWEN_NUMPY_REPACK_MB), and from running BLAS on no more threads than this process's
share of the cores (`threads`; kernels/numpy/blas.py):

- `prepare_linear` dequantizes a quantized weight once into its fp32 copy while the budget lasts, and
  past it keeps what its format's module repacks (int4_sym_g128: int8 values) and dequantizes per call,
  a block of rows at a time (kernels/numpy/linear.py). The stored tensors stay in the QuantizedWeight
  as they came. A format's kernels are the module `kernels/numpy/<format>.py`, found by name (its
  `FORMAT`); a format without one raises FormatNotSupportedError.
- `lm_head` widens an fp16 table `[V, H]` to its fp32 transpose `[H, V]` (`x @ t` ran 2x faster than
  `x @ w.T` at the 0.5 B vocab) once per table object, when the table is read-only down to its memory
  (a model file's mapped tensor is): such a table cannot change under the cached copy. The cache holds
  a weak reference to the table, so a freed table's copy goes, and a new array that gets the freed
  one's id() is widened afresh. Any other table is widened per call, a block of rows at a time. A tied
  model's table (embed and lm_head share it) is widened once; `embed` reads the fp16 rows as before.

Repacked bytes are returned to the budget when their weight or table is freed.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import weakref

import numpy as np

from kernels.base import Backend, FormatNotSupportedError, QuantizedWeight
from kernels.numpy.attention import paged_attention
from kernels.numpy.blas import blas_threads, default_threads
from kernels.numpy import linear

# fp32 repack budget per backend object: a 0.5 B model needs 1.4 GB (linears) + 0.5 GB (its lm_head table)
DEFAULT_REPACK_MB = 4096


def _read_only(a) -> bool:
    """True when no one can write `a`'s memory through it or anything it views (ndarray bases, buffers)."""
    while a is not None:
        if not isinstance(a, np.ndarray):
            try:
                return memoryview(a).readonly
            except TypeError:
                return False
        if a.flags.writeable:
            return False
        a = a.base
    return True


def _format_modules() -> dict:
    """format name -> its kernel module: every module of this package that names a FORMAT."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if getattr(mod, "FORMAT", None) == info.name:
            found[info.name] = mod
    return found


class NumpyBackend(Backend):
    name = "numpy"
    formats = ()  # set below, once the package's modules can be imported
    supports_graphs = False  # nothing to capture: the decode step runs eagerly

    def __init__(self, repack_bytes: int | None = None, threads: int | None = None):
        if repack_bytes is None:
            env = os.environ.get("NANOQWEN_NUMPY_REPACK_MB", str(DEFAULT_REPACK_MB))
            try:
                repack_bytes = int(float(env) * 2**20)
            except ValueError:
                raise ValueError(f"NANOQWEN_NUMPY_REPACK_MB={env!r} is not a number of megabytes") from None
        self.repack_bytes = int(repack_bytes)
        self.threads = threads or default_threads()  # BLAS threads inside the matmuls
        self.repacked_bytes = 0  # fp32 bytes held now by this backend's weights and lm_head tables
        self._tables: dict[int, tuple[weakref.ref, np.ndarray]] = {}  # id(fp16 table) -> (ref, fp32 copy)

    def _take(self, nbytes: int) -> bool:
        if self.repacked_bytes + nbytes > self.repack_bytes:
            return False
        self.repacked_bytes += nbytes
        return True

    def _give_back(self, nbytes: int) -> None:
        self.repacked_bytes -= nbytes

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

    @staticmethod
    def _kernels(fmt: str):
        try:
            return _FORMAT_MODULES[fmt]
        except KeyError:
            raise FormatNotSupportedError(f"backend 'numpy' has no kernel for format {fmt!r}") from None

    def prepare_linear(self, fmt: str, tensors: dict, out_features: int, in_features: int) -> QuantizedWeight:
        k = self._kernels(fmt)
        stored = {name: np.ascontiguousarray(v) for name, v in tensors.items()}
        fp32_bytes = k.repacked_nbytes(out_features, in_features, True)
        fp32 = self._take(fp32_bytes)
        w = QuantizedWeight(fmt, out_features, in_features, {**stored, **k.repack(stored, fp32)})
        if fp32:
            weakref.finalize(w, self._give_back, fp32_bytes).atexit = False
        return w

    def _linear(self, x, w: QuantizedWeight) -> np.ndarray:
        k = self._kernels(w.format)
        with blas_threads(self.threads):
            return k.matmul(x, w)

    # --- ops (docs/BACKEND.md's table) --------------------------------------------------------

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

    def _wide_table(self, weight) -> np.ndarray | None:
        """The fp32 transpose `[H, V]` of a read-only fp16 table `[V, H]`, made on first use; None where it
        may not be cached."""
        key, nbytes = id(weight), weight.size * 4
        hit = self._tables.get(key)
        if hit is not None:
            if hit[0]() is weight:
                return hit[1]
            del self._tables[key]  # a freed table's entry whose callback has not run yet
            self._give_back(hit[1].nbytes)
        if not _read_only(weight) or not self._take(nbytes):
            return None

        def drop(ref, key=key, nbytes=nbytes):  # the table was freed: forget its copy, return the bytes
            if self._tables.get(key, (None,))[0] is ref:
                del self._tables[key]
                self._give_back(nbytes)

        wide_t = np.empty(weight.shape[::-1], dtype=np.float32)
        for r0 in range(0, weight.shape[0], 256):  # by blocks of rows: 3.6x faster than one strided copy
            wide_t[:, r0:r0 + 256] = weight[r0:r0 + 256].astype(np.float32).T
        self._tables[key] = (weakref.ref(weight, drop), wide_t)
        return wide_t

    def lm_head(self, x, weight, out):
        xf = x.astype(np.float32)
        logits = out if out.ndim == 2 else out[None, :]  # a view of `out` either way ([T, V] or [V])
        wide_t = self._wide_table(weight)
        with blas_threads(self.threads):
            if wide_t is not None:
                logits[...] = xf @ wide_t
                return
            step = max(1, linear.BLOCK_FLOATS // weight.shape[1])
            for r0 in range(0, weight.shape[0], step):
                logits[:, r0:r0 + step] = xf @ weight[r0:r0 + step].astype(np.float32).T

    def argmax(self, logits, out):
        out[...] = np.argmax(logits.reshape(-1))  # first maximum: the lowest index wins a tie

    def decode_advance(self, next_id, ids, positions):
        ids[0] = next_id[0]
        positions[0] += 1


_FORMAT_MODULES = _format_modules()
NumpyBackend.formats = tuple(sorted(_FORMAT_MODULES))
