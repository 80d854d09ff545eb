"""The Backend interface and the registry of backends by name.

`Backend` is the contract of docs/BACKEND.md as a class: every op of its table (`OPS`) is an abstract
method here with its signature, next to the memory helpers, `prepare_linear` and the capabilities the
engine and the ladder ask about (`supports_graphs`, `needs_device`, `device_name`). Code outside
`kernels/` never compares a backend's name: it asks a capability, or the registry.

The registry maps a name to the class's import path ("module:Class"), imported only when that backend
is asked for, so a machine without CuPy never imports `kernels.cuda`. Adding a backend is one package
(a `Backend` subclass) and one `register_backend` line (docs/BACKEND.md, "Adding a backend").
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import Any

# The op set of docs/BACKEND.md: what every backend implements and the ladder checks.
OPS = ("embed", "rmsnorm", "qkv_proj", "rope_kv_write", "attention_prefill", "attention_decode",
       "o_proj_residual", "gate_up_silu", "down_residual", "lm_head", "argmax", "decode_advance")
# Fused ops (docs/BACKEND.md, "Fused ops"): each is its parts called in order, which is what Backend does
# for every backend; a backend may run one as a single kernel. The engine calls the fused op; the ladder
# checks and wraps the parts.
FUSED_OPS = {"o_proj_residual_rmsnorm": ("o_proj_residual", "rmsnorm"),
             "down_residual_rmsnorm": ("down_residual", "rmsnorm")}
# The memory helpers of docs/BACKEND.md, plus the constructor of quantized weights.
HELPERS = ("asarray", "empty", "full", "to_numpy", "synchronize", "prepare_linear")


class BackendUnavailableError(RuntimeError):
    """A backend asked for on a machine that cannot run it (e.g. `cuda` without CuPy or a GPU)."""


class FormatNotSupportedError(NotImplementedError):
    """A backend has no kernel for a quantization format."""


@dataclasses.dataclass
class QuantizedWeight:
    """One linear layer's quantized weight `W[out_features, in_features]` as a backend holds it.

    `tensors` maps the format's stored tensor names (`qweight`, `scales`, ...) to backend arrays; a
    backend may hold a repacked layout, as long as its ops read what its `prepare_linear` made.
    """

    format: str
    out_features: int
    in_features: int
    tensors: dict[str, Any]

    def __getitem__(self, key):
        return self.tensors[key]


SWITCH_WORDS = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def switch_value(text: str, what: str) -> bool:
    """A backend switch given as text (`pdl`, `--before-set rmsnorm_held=off`): on/true/1 or off/false/0,
    any case; anything else is a ValueError naming `what`."""
    word = text.strip().lower()
    if word not in SWITCH_WORDS:
        raise ValueError(f"{what} {text!r} is not one of on, off")
    return SWITCH_WORDS[word]


class Backend(abc.ABC):
    """One device's implementation of docs/BACKEND.md. Every op writes into a caller-allocated output."""

    name: str = ""  # the registry name; for messages and reports, never for a decision outside kernels/
    formats: tuple[str, ...] = ()  # the quantization formats prepare_linear and the linears accept
    supports_graphs: bool = False  # the decode step can be captured and replayed (engine/cuda_graph.py)
    needs_device: bool = False  # runs on an accelerator (its ladder cases carry the `gpu` marker)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """(True, device name) when this machine can run the backend, else (False, the reason)."""
        return True, "cpu"

    @classmethod
    def warm_up(cls) -> None:
        """Pay a once-per-machine cost before parallel test workers start, so they share it instead of each
        paying it (CUDA: compile every module into CuPy's on-disk cache). Nothing by default."""

    @classmethod
    def test_workers(cls) -> int | None:
        """How many parallel test workers suit this backend on this machine; None: one per core."""
        return None

    @classmethod
    def worker_options(cls, worker: int) -> dict:
        """Constructor options for parallel test worker number `worker` (e.g. which GPU it takes)."""
        return {}

    @property
    def device_name(self) -> str:
        """The device this backend object runs on, in words (for reports)."""
        return "cpu"

    # --- memory -------------------------------------------------------------------------------

    @abc.abstractmethod
    def asarray(self, a, dtype=None):
        """A C-contiguous backend array holding a copy (or view) of host array `a`."""

    @abc.abstractmethod
    def empty(self, shape, dtype):
        """An uninitialised backend array."""

    @abc.abstractmethod
    def full(self, shape, value, dtype):
        """A backend array filled with `value`."""

    @abc.abstractmethod
    def to_numpy(self, a):
        """A host NumPy array with the contents of backend array `a`."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until every op queued so far has finished."""

    def release_memory(self) -> None:
        """Hand back to the device the memory this backend keeps cached for reuse after its arrays were
        dropped (engine Model.close calls it), so that another library in the process (torch) can allocate
        it. Nothing by default: a host backend's arrays go back to the allocator when dropped."""

    @abc.abstractmethod
    def prepare_linear(self, fmt: str, tensors: dict, out_features: int, in_features: int) -> QuantizedWeight:
        """The QuantizedWeight of a `[out_features, in_features]` linear from the file's host tensors;
        FormatNotSupportedError for a format without a kernel."""

    # --- ops (docs/BACKEND.md's table) --------------------------------------------------------

    @abc.abstractmethod
    def embed(self, ids, table, out):
        """out[T, H] fp32 = table[ids] (int32 [T], fp16 [V, H])."""

    @abc.abstractmethod
    def rmsnorm(self, x, weight, eps, out):
        """out[T, H] fp16 = x / sqrt(mean(x^2) + eps) * weight (x fp32, weight fp16 [H])."""

    @abc.abstractmethod
    def qkv_proj(self, x, w, bias, out):
        """out[T, (nq+2nkv) d] fp16 = x W^T + bias."""

    @abc.abstractmethod
    def rope_kv_write(self, qkv, positions, k_pages, v_pages, page_table, theta, q_out):
        """q_out[T, nq, d] = roped q; roped k and plain v of token t into the pages at positions[t]."""

    @abc.abstractmethod
    def attention_prefill(self, q, k_pages, v_pages, page_table, positions, out):
        """out[T, nq d] fp16: causal paged attention, query t over keys 0 .. positions[t]."""

    @abc.abstractmethod
    def attention_decode(self, q, k_pages, v_pages, page_table, positions, out):
        """As attention_prefill with T = 1."""

    @abc.abstractmethod
    def o_proj_residual(self, x, w, residual):
        """residual[T, H] fp32 += x W^T."""

    @abc.abstractmethod
    def gate_up_silu(self, x, w, out):
        """out[T, I] fp16 = silu(x Wg^T) * (x Wu^T), W rows [gate; up]."""

    @abc.abstractmethod
    def down_residual(self, x, w, residual):
        """residual[T, H] fp32 += x W^T."""

    # --- fused ops (FUSED_OPS): the parts in order; a backend may override with one kernel ----------

    def o_proj_residual_rmsnorm(self, x, w, residual, norm_weight, eps, out):
        """o_proj_residual(x, w, residual), then rmsnorm(residual, norm_weight, eps, out)."""
        self.o_proj_residual(x, w, residual)
        self.rmsnorm(residual, norm_weight, eps, out)

    def down_residual_rmsnorm(self, x, w, residual, norm_weight, eps, out):
        """down_residual(x, w, residual), then rmsnorm(residual, norm_weight, eps, out)."""
        self.down_residual(x, w, residual)
        self.rmsnorm(residual, norm_weight, eps, out)

    def parts_wrapped(self, fused: str) -> bool:
        """True when a part of fused op `fused` is replaced on this object (an instance attribute: the
        ladder's op recorder, a planted fault) by a wrapper that must see every call of its op. An
        override that runs the fused op as one kernel must then call the parts instead (Backend's
        method). A wrapper marked `observes_only` (it calls the op it replaced with the same arguments
        and only notes the call: the ladder's call counter) does not count: under it the rungs run the
        fused kernel itself."""
        own = vars(self)
        return any(part in own and not getattr(own[part], "observes_only", False) for part in FUSED_OPS[fused])

    @abc.abstractmethod
    def lm_head(self, x, weight, out):
        """out fp32 [T, V] (or [V] when T = 1) = x weight^T."""

    @abc.abstractmethod
    def argmax(self, logits, out):
        """out int32 [1] = the lowest index among the maxima of fp32 logits [V]."""

    @abc.abstractmethod
    def decode_advance(self, next_id, ids, positions):
        """ids[0] = next_id[0]; positions[0] += 1 (int32 [1] each): the next decode step's inputs, on the
        device, from the token argmax picked (the graph loop's glue)."""


# --- observing launches ---------------------------------------------------------------------------------

# A device backend whose kernels are launched by name reports each launch here while an observer is set
# (the ladder's launch map, ladder/changes/launches.py): the set receives "<backend folder>::<entry point>".
_launch_observer: set | None = None


def observe_launches(sink: set | None) -> None:
    """Set (or, with None, clear) the set that device kernel launches are reported into."""
    global _launch_observer
    _launch_observer = sink


def launch_observer() -> set | None:
    return _launch_observer


# --- the registry --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    target: str | type  # "module:Class" (imported on first use) or the class itself
    needs_device: bool


_REGISTRY: dict[str, _Entry] = {}


def register_backend(name: str, target, *, needs_device: bool = False) -> None:
    """Make `get_backend(name)` build `target`: a Backend subclass, or its "module:Class" path (imported
    on first use). `needs_device` says, without importing it, that it runs on an accelerator."""
    if not isinstance(target, str) and not (isinstance(target, type) and issubclass(target, Backend)):
        raise TypeError(f"backend {name!r}: expected a Backend subclass or 'module:Class', got {target!r}")
    _REGISTRY[name] = _Entry(target, needs_device)


def unregister_backend(name: str) -> None:
    """Forget a registered backend (tests that register one of their own)."""
    _REGISTRY.pop(name, None)


def backend_names() -> tuple[str, ...]:
    """Every registered backend, in registration order."""
    return tuple(_REGISTRY)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}") from None


def backend_needs_device(name: str) -> bool:
    """True for a registered backend that runs on an accelerator (asked without importing it)."""
    return _entry(name).needs_device


def backend_class(name: str) -> type[Backend]:
    """The Backend subclass registered as `name`; BackendUnavailableError when it cannot be imported."""
    target = _entry(name).target
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, OSError) as e:  # OSError: a device library that fails to load
        raise BackendUnavailableError(f"backend {name!r} cannot be imported here: {e}") from None
    return cls


def backend_available(name: str) -> tuple[bool, str]:
    """(True, device name) when backend `name` can run on this machine, else (False, the reason)."""
    try:
        cls = backend_class(name)
    except BackendUnavailableError as e:
        return False, str(e)
    return cls.is_available()


def get_backend(name: str, **options) -> Backend:
    """The Backend object for `name`; raises BackendUnavailableError where it cannot run."""
    return backend_class(name)(**options)
