"""The catalogue of planted faults: proof that the ladder catches the bugs kernel engineers write.

Each fault is minimal (one wrong position, not a wrecked tensor) and is installed only through `pytest
--plant-fault NAME[@LAYER][:FORMAT]`, by wrapping one op of the Backend object. `@LAYER` limits it to
one layer's blocks (read from `engine.block.CURRENT_LAYER`); ops called outside a block (the unit rung)
are always affected. `:FORMAT` limits a fault that reads quantized weights (`per_format`) to the weights
of that format, so a red run in one format only can be rehearsed: the other formats stay green.
Each fault names the unit rung's checks that must catch it (`checks`, functions of ladder/checks/ops.py):
ladder/unit/test_planted_faults.py runs them on their explicit examples against a planted backend, on
every backend and format, and at least one must fail and name the op; ladder/selftest/test_faults.py
runs real rungs with a fault in a subprocess. A rung that stays green under its fault is a bug in the rung.

The wrappers work on any backend and any format: they change an op's inputs (a quantized weight's
through its format's own `swap_pair` / `shift_scale`), or, for fp16 accumulation, recompute the op's
contribution on the host from the weights `prepare_linear` was given, dequantized by their format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.block import CURRENT_LAYER
from engine.formats import FORMATS, get_format
from kernels import QuantizedWeight
from ladder.checks import ops as op_checks


@dataclass(frozen=True)
class Fault:
    name: str
    ops: tuple[str, ...]  # the ops it wraps (the failure must name one of them, or an op they feed)
    describes: str
    install: Callable  # install(backend, active: Callable[[], bool]); per_format: also in_format: Callable[[str], bool]
    checks: tuple[Callable, ...]  # the unit rung's checks that must catch it (ladder/checks/ops.py), on their examples
    names: tuple[str, ...]  # what the failure message must mention
    per_format: bool = False  # it reads quantized weights: every format's kernels must catch it


def _wrap(backend, op: str, make):
    original = getattr(backend, op)
    setattr(backend, op, make(original))


def _host(backend, a) -> np.ndarray:
    return np.array(backend.to_numpy(a), copy=True)


# --- attention ---------------------------------------------------------------------------------


def _attention_page_edge(backend, active):
    """A query at the first slot of a page (position 16k, k > 0) does not see its own key."""
    def make(original):
        def op(q, k_pages, v_pages, page_table, positions, out):
            if active():
                pos = _host(backend, positions)
                edge = (pos % 16 == 0) & (pos > 0)
                if edge.any():
                    positions = backend.asarray(np.where(edge, pos - 1, pos).astype(np.int32))
            return original(q, k_pages, v_pages, page_table, positions, out)
        return op
    for name in ("attention_decode", "attention_prefill"):
        _wrap(backend, name, make)


def _stale_page_read(backend, active):
    """Decode attention reads the page table as it was before the newest page was added."""
    def make(original):
        def op(q, k_pages, v_pages, page_table, positions, out):
            if active():
                pos = _host(backend, positions)
                if len(pos) == 1 and pos[0] % 16 == 0 and pos[0] > 0:
                    table = _host(backend, page_table)
                    table[pos[0] // 16] = table[pos[0] // 16 - 1]  # the update not yet visible
                    page_table = backend.asarray(table)
            return original(q, k_pages, v_pages, page_table, positions, out)
        return op
    _wrap(backend, "attention_decode", make)


# --- the unpack of a quantized weight (any format, through its own definition) -------------------


def _every_format(fmt: str) -> bool:
    return True


def _retensor(backend, original_prepare, edit_name: str, in_format=_every_format):
    """prepare_linear that hands the backend the tensors as the format's `edit_name` edit misreads them
    (the weights of the formats `in_format` accepts; the others as they are)."""
    def prepare(fmt, tensors, out_features, in_features):
        if in_format(fmt):
            tensors = getattr(get_format(fmt), edit_name)(tensors)
        return original_prepare(fmt, tensors, out_features, in_features)
    return prepare


def _nibble_swap(backend, active, in_format=_every_format):
    """The unpack swaps elements 0 and 1 of every row (INT4: nibbles 0 and 4 of the first word;
    the format's `swap_pair`)."""
    _wrap(backend, "prepare_linear", lambda original: _retensor(backend, original, "swap_pair", in_format))


def _wrong_group_scale(backend, active, in_format=_every_format):
    """The last group of every row uses the scale of the group before it (per-row formats: the last row
    uses its neighbour's; the format's `shift_scale`)."""
    _wrap(backend, "prepare_linear", lambda original: _retensor(backend, original, "shift_scale", in_format))


# --- projections, RoPE ---------------------------------------------------------------------------


def _dropped_qkv_bias(backend, active):
    """qkv_proj ignores its bias."""
    def make(original):
        zeros = {}

        def op(x, w, bias, out):
            if active():
                if id(bias) not in zeros:
                    zeros[id(bias)] = (bias, backend.asarray(np.zeros(_host(backend, bias).shape, np.float16)))
                bias = zeros[id(bias)][1]
            return original(x, w, bias, out)
        return op
    _wrap(backend, "qkv_proj", make)


def _wrong_rope_theta(backend, active):
    """RoPE uses the Qwen2 default theta 1e6 where the model says otherwise (or 1e4 where it says 1e6)."""
    def make(original):
        def op(qkv, positions, k_pages, v_pages, page_table, theta, q_out):
            if active():
                theta = 1e4 if theta == 1e6 else 1e6
            return original(qkv, positions, k_pages, v_pages, page_table, theta, q_out)
        return op
    _wrap(backend, "rope_kv_write", make)


def _fp16_accumulation(backend, active, in_format=_every_format):
    """down_residual accumulates its dot products in fp16 (sequentially over 128-wide groups)."""
    hosts: dict[int, tuple] = {}
    groups: dict[int, np.ndarray] = {}  # id(w) -> its float32 weight as (groups, 128, out), made at first use

    def prepare_make(original):
        def prepare(fmt, tensors, out_features, in_features):
            w = original(fmt, tensors, out_features, in_features)
            if in_format(fmt):  # a weight it does not keep runs the real op
                hosts[id(w)] = (w, {k: np.array(v, copy=True) for k, v in tensors.items()})
                groups.pop(id(w), None)
            return w
        return prepare

    def grouped(w: QuantizedWeight) -> np.ndarray:
        # Dequantized once per weight, not at every call, and laid out so that each group's slice is
        # contiguous: at the 7B shape one down projection is 68 M weights, and a 29-token call took 0.37 s
        # on 2 cores when each call dequantized it (0.13 s now), on every step of a layer case.
        if id(w) not in groups:
            wf = get_format(w.format).dequantize(hosts[id(w)][1]).astype(np.float32, copy=False)
            g = -(-w.in_features // 128)
            padded = np.zeros((w.out_features, g * 128), np.float32)
            padded[:, :w.in_features] = wf
            groups[id(w)] = np.ascontiguousarray(padded.reshape(w.out_features, g, 128).transpose(1, 2, 0))
        return groups[id(w)]

    def op_make(original):
        def op(x, w: QuantizedWeight, residual):
            if not active() or id(w) not in hosts:
                return original(x, w, residual)
            wg = grouped(w)
            xf = np.zeros((x.shape[0], wg.shape[0] * 128), np.float32)
            xf[:, :w.in_features] = _host(backend, x).astype(np.float16)
            acc = np.zeros((xf.shape[0], w.out_features), np.float16)
            for g in range(wg.shape[0]):  # partial sums rounded to fp16 after every group
                acc = (acc.astype(np.float32) + xf[:, g * 128:(g + 1) * 128] @ wg[g]).astype(np.float16)
            r = _host(backend, residual) + acc.astype(np.float32)
            residual[...] = backend.asarray(r)
        return op

    _wrap(backend, "prepare_linear", prepare_make)
    _wrap(backend, "down_residual", op_make)


# The checks a fault must fail, by function: a renamed or removed check fails here, at import.
DECODE_CHECKS = (op_checks.check_attention_decode, op_checks.check_attention_decode_at_page_edge)
ATTENTION_CHECKS = (*DECODE_CHECKS, op_checks.check_attention_prefill)
LINEAR_CHECKS = (op_checks.check_qkv_proj, op_checks.check_o_proj_residual, op_checks.check_down_residual,
                 op_checks.check_gate_up_silu)
LINEAR_OPS = ("qkv_proj", "o_proj_residual", "down_residual", "gate_up_silu")

FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("attention_page_edge", ("attention_decode", "attention_prefill"), "off-by-one at a page boundary",
          _attention_page_edge, ATTENTION_CHECKS, ("attention",)),
    Fault("stale_page_read", ("attention_decode",), "a stale page-table entry at a new page",
          _stale_page_read, DECODE_CHECKS, ("attention_decode",)),
    Fault("nibble_swap", ("prepare_linear",), "two elements of a row swapped in the unpack",
          _nibble_swap, LINEAR_CHECKS, LINEAR_OPS, per_format=True),
    Fault("wrong_group_scale", ("prepare_linear",), "the wrong group's scale",
          _wrong_group_scale, LINEAR_CHECKS, LINEAR_OPS, per_format=True),
    Fault("dropped_qkv_bias", ("qkv_proj",), "a dropped q/k/v bias",
          _dropped_qkv_bias, (op_checks.check_qkv_proj,), ("qkv_proj",)),
    Fault("wrong_rope_theta", ("rope_kv_write",), "a wrong RoPE theta",
          _wrong_rope_theta, (op_checks.check_rope_kv_write,), ("rope",)),
    Fault("fp16_accumulation", ("down_residual",), "fp16 accumulation in a GEMV",
          _fp16_accumulation, (op_checks.check_down_residual,), ("down_residual",), per_format=True),
)}


def parse(spec: str) -> tuple[Fault, int | None, str | None]:
    """`NAME[@LAYER][:FORMAT]` -> (Fault, layer or None, format or None). A bad spec is a ValueError of
    one line: an unknown fault or format, a layer that is not a number, a format on a fault that reads no
    quantized weight (it would change nothing in any format but run as if it did)."""
    head, colon, fmt = spec.partition(":")
    name, _, layer = head.partition("@")
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; the catalogue: {', '.join(sorted(FAULTS))}")
    try:
        at = int(layer) if layer else None
    except ValueError:
        raise ValueError(f"--plant-fault {spec!r}: the part after @ must be a layer number") from None
    if not colon:
        return FAULTS[name], at, None
    fault = FAULTS[name]
    if not fault.per_format:
        takes = ", ".join(sorted(n for n, f in FAULTS.items() if f.per_format))
        raise ValueError(f"fault {name!r} in {spec!r} reads no quantized weight, so it takes no :FORMAT "
                         f"(the faults that do: {takes})")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} in {spec!r}; the formats: {', '.join(sorted(FORMATS))}")
    return fault, at, fmt


def plant(backend, spec: str) -> Fault:
    """Install the fault on this Backend object (instance attributes shadow the class's ops)."""
    fault, layer, fmt = parse(spec)

    def active() -> bool:
        current = CURRENT_LAYER.get()
        return layer is None or current is None or current == layer

    if fault.per_format:
        fault.install(backend, active, (lambda f: True) if fmt is None else (lambda f: f == fmt))
    else:
        fault.install(backend, active)
    return fault
