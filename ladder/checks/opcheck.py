"""Op-level checks on a block's real activations: every op call recorded inside a decoder block (inputs
before, outputs after) and checked against its `ref_*` on those same inputs, with the unit rung's
tolerance. `nanoqwen descend` walks a model with them; the layer rung uses them to name the op when a
block goes red (an op can also be wrong by less than a block's fp16 noise and still be found here).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from engine.config import PAGE_SIZE, Qwen2Config
from ladder.judges.compare import measure
from reference import ops as ref_ops

F16, F32 = np.float16, np.float32
PAGE = PAGE_SIZE


@dataclass
class Check:
    """One comparison: where, the error, its floor and the bound TOL gives."""

    name: str
    max_abs: float
    floor: float
    bound: float
    where: tuple = ()
    call: int | None = None  # for an op: its index among the layer's recorded calls

    @property
    def multiple(self) -> float:
        return self.max_abs / self.floor if self.floor > 0 else (0.0 if self.max_abs == 0 else float("inf"))

    @property
    def diverged(self) -> bool:
        return not self.max_abs <= self.bound  # NaN diverges

    def as_dict(self) -> dict:
        return {"name": self.name, "max_abs": self.max_abs, "floor": self.floor, "bound": self.bound,
                "multiple": self.multiple, "diverged": self.diverged, "where": list(self.where), "call": self.call}


def check(name: str, out, ref, plain, tol_key: tuple[str, str], call: int | None = None) -> Check:
    m = measure(out, ref, plain, tol_key)
    return Check(name, m["max_abs"], m["floor"], m["bound"], m["where"], call)


# --- op-level checks on recorded calls ----------------------------------------------------------


class Recorder:
    """Wraps the ops of one Backend object: while `on`, every call's inputs (before) and outputs
    (after) are copied to the host."""

    OPS = ("rmsnorm", "qkv_proj", "rope_kv_write", "attention_prefill", "attention_decode",
           "o_proj_residual", "gate_up_silu", "down_residual")

    def __init__(self, backend):
        self.backend, self.on, self.calls = backend, False, []
        self._had = {op: op in vars(backend) for op in self.OPS}  # an instance wrapper already there
        self._inner = {op: getattr(backend, op) for op in self.OPS}
        for op in self.OPS:
            setattr(backend, op, self._wrap(op, self._inner[op]))

    def restore(self) -> None:
        """Take the wrappers off again (a shared Backend object must leave as it came)."""
        for op in self.OPS:
            if self._had[op]:
                setattr(self.backend, op, self._inner[op])
            else:
                delattr(self.backend, op)

    def _host(self, a):
        if isinstance(a, (int, float, str)) or a is None or hasattr(a, "tensors"):
            return a
        return np.array(self.backend.to_numpy(a), copy=True)

    def _wrap(self, op, inner):
        def recorded(*args):
            if not self.on:
                return inner(*args)
            before = [self._host(a) for a in args]
            result = inner(*args)
            self.backend.synchronize()
            self.calls.append((op, before, [self._host(a) for a in args]))
            return result
        return recorded


@contextlib.contextmanager
def recording(backend):
    """A Recorder on `backend` for the block of the `with`, taken off again after it (even on an error)."""
    recorder = Recorder(backend)
    recorder.on = True
    try:
        yield recorder
    finally:
        recorder.on = False
        recorder.restore()


def op_checks(calls, config: Qwen2Config, w: dict, layer: int) -> list[Check]:
    """Each recorded op call against its reference on the same inputs, in call order."""
    p = f"model.layers.{layer}."
    W = {k[len(p):]: w[k] for k in w if k.startswith(p)}  # the layer's names alone: `w` may read layers lazily
    qkv_w = np.concatenate([W[f"self_attn.{x}_proj.weight"] for x in "qkv"])
    qkv_b = np.concatenate([W[f"self_attn.{x}_proj.bias"] for x in "qkv"])
    gate, up = W["mlp.gate_proj.weight"], W["mlp.up_proj.weight"]
    # The float64 references read each weight at every decode step: convert each once, not at each call
    # (at the 7B shape the conversions alone were 12 of the 20 seconds of a block's checks).
    w64 = {k: np.asarray(v, dtype=np.float64) for k, v in (("qkv", qkv_w), ("qkv_b", qkv_b), ("gate", gate), ("up", up),
                                                              ("o", W["self_attn.o_proj.weight"]),
                                                              ("down", W["mlp.down_proj.weight"]))}
    nq, nkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    linears = {  # op -> (float64 reference, float32 plain implementation) of its input rows
        "qkv_proj": (lambda x: ref_ops.ref_linear(x, w64["qkv"], w64["qkv_b"]),
                     lambda x: ref_ops.ref_linear(x, qkv_w, qkv_b, dtype=F32)),
        "o_proj_residual": (lambda x: ref_ops.ref_linear(x, w64["o"]),
                            lambda x: ref_ops.ref_linear(x, W["self_attn.o_proj.weight"], dtype=F32)),
        "down_residual": (lambda x: ref_ops.ref_linear(x, w64["down"]),
                          lambda x: ref_ops.ref_linear(x, W["mlp.down_proj.weight"], dtype=F32)),
        "gate_up_silu": (lambda x: ref_ops.ref_gate_up_silu(x, w64["gate"], w64["up"]),
                         lambda x: ref_ops.ref_gate_up_silu(x, gate, up, dtype=F32)),
    }
    # Each linear's calls (the prefill, then one row per decode step) in one product per op: every row of
    # a product is its own dot products, so each call's rows are what its own call would give, and the
    # weight is read once instead of once a step (a 7B block's 21 steps read its float64 weights 21 times).
    done: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for op, (ref64, plain32) in linears.items():
        idx = [i for i, (o, _, _) in enumerate(calls) if o == op]
        if not idx:
            continue
        xs = [calls[i][1][0] for i in idx]
        cut = np.cumsum([x.shape[0] for x in xs])[:-1]
        rows = np.concatenate(xs)
        for i, r, pl in zip(idx, np.split(ref64(rows), cut), np.split(plain32(rows), cut)):
            done[i] = (r, pl)
    out: list[Check] = []
    norms = 0
    for i, (op, before, after) in enumerate(calls):
        label = op
        if op == "rmsnorm":
            x, weight, eps = before[0], before[1], before[2]
            name = "input_layernorm" if norms % 2 == 0 else "post_attention_layernorm"
            norms += 1
            out.append(check(f"{label} ({name})", after[3], ref_ops.ref_rmsnorm(x, weight, eps),
                             ref_ops.ref_rmsnorm(x, weight, eps, dtype=F32).astype(F16), ("rmsnorm", "float16"), i))
        elif op == "qkv_proj":
            out.append(check(label, after[3], done[i][0], done[i][1].astype(F16), ("qkv_proj", "float16"), i))
        elif op == "rope_kv_write":
            qkv, pos, table, theta = before[0], before[1], before[4], before[5]
            T = qkv.shape[0]
            q_in = qkv[:, : nq * d].reshape(T, nq, d)
            k_in = qkv[:, nq * d: (nq + nkv) * d].reshape(T, nkv, d)
            out.append(check(f"{label} (q)", after[6], ref_ops.ref_rope(q_in, pos, theta),
                             ref_ops.ref_rope(q_in, pos, theta, dtype=F32).astype(F16), ("rope_kv_write", "float16"), i))
            k_pages = after[2]
            k_written = np.stack([k_pages[table[t // PAGE], :, t % PAGE] for t in pos])
            out.append(check(f"{label} (k)", k_written, ref_ops.ref_rope(k_in, pos, theta),
                             ref_ops.ref_rope(k_in, pos, theta, dtype=F32).astype(F16), ("rope_kv_write", "float16"), i))
        elif op in ("attention_prefill", "attention_decode"):
            q, kp, vp, table, pos = before[:5]
            out.append(check(label, after[5], ref_ops.ref_paged_attention(q, kp, vp, table, pos),
                             ref_ops.ref_paged_attention(q, kp, vp, table, pos, dtype=F32).astype(F16), ("attention", "float16"), i))
        elif op in ("o_proj_residual", "down_residual"):
            resid = before[2]
            out.append(check(label, after[2], resid + done[i][0], resid + done[i][1], (op, "float32"), i))
        elif op == "gate_up_silu":
            out.append(check(label, after[2], done[i][0], done[i][1].astype(F16), ("gate_up_silu", "float16"), i))
    return out


def first_op_over_its_bound(checks: list[Check]) -> Check | None:
    """In call order: the earliest op whose error is past its bound (the kernel to look at)."""
    return next((c for c in checks if c.diverged), None)
