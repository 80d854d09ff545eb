"""Comparisons with the one tolerance table, and failure messages that say where and by how much.

`assert_close(op, out, ref, plain, ...)` is the unit rung's check: `ref` is the float64 reference,
`plain` the same reference in fp32 on storage-rounded inputs (its error is the op's noise floor, see
ladder/judges/tolerances.py). NaN anywhere in `out` fails (outputs start sentinel-filled with NaN, so an
element never written fails too). A failure prints the relative L2 error, the max abs error and where,
the first few `(out, ref)` pairs, the shape, the case and its seed, and the command that reruns it.
Every check is recorded (op, backend, error as a multiple of the floor, the bound) for the end-of-run
table; the record's "format" is filled in by the plugin from the case's `quant_name` (None for a case
that runs in no format), since a check does not know which format made its weights.
"""

from __future__ import annotations

import os
import shlex

import numpy as np

from ladder.judges.tolerances import TOL

# Records of this process's checks; the pytest plugin moves them onto each test's report.
RECORDS: list[dict] = []


def case_id(nodeid: str) -> str:
    """A node id without the `@group` suffix pytest-xdist gives it under `--dist loadgroup`: a rerun would
    not find it with the suffix, and the launch map is read by runs with and without workers (`nanoqwen
    mutate` runs each mutant's cases in one process)."""
    head, at, group = nodeid.rpartition("@")
    return head if at and not any(c in group for c in "[]:/") else nodeid


def rerun_command() -> str:
    node = case_id(os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0])
    return f"python -m pytest {shlex.quote(node)}" if node else "python -m pytest"


def describe_mismatch(out: np.ndarray, ref: np.ndarray, n: int = 5) -> str:
    diff = np.abs(out.astype(np.float64) - ref)
    order = np.argsort(np.nan_to_num(diff, nan=np.inf).ravel())[::-1][:n]
    pairs = ", ".join(f"{tuple(int(i) for i in np.unravel_index(k, out.shape))}: ({out.ravel()[k]!r}, {ref.ravel()[k]!r})"
                      for k in order)
    return f"worst (out, ref) pairs: {pairs}"


def error_stats(out: np.ndarray, ref: np.ndarray) -> dict:
    out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
    diff = np.abs(out64 - ref64)
    where = np.unravel_index(int(np.nanargmax(diff)), diff.shape) if diff.size and not np.isnan(diff).all() else ()
    norm = np.linalg.norm(ref64)
    return {
        "max_abs": float(np.nanmax(diff)) if diff.size else 0.0,
        "where": tuple(int(i) for i in where),
        "rel_l2": float(np.linalg.norm(np.nan_to_num(out64 - ref64, nan=np.inf)) / norm) if norm else float(np.linalg.norm(out64 - ref64)),
    }


def measure(out, ref, plain, key: tuple[str, str]) -> dict:
    """The error of `out` against `ref`, the noise floor (`plain`'s error), TOL[key]'s bound, and the
    verdict. NaN in `out` makes the error NaN, which no bound passes."""
    out, ref = np.asarray(out), np.asarray(ref, dtype=np.float64)
    stats = error_stats(out, ref)
    if np.isnan(out.astype(np.float64)).any():
        stats["max_abs"] = float("nan")
    floor = error_stats(np.asarray(plain), ref)["max_abs"] if plain is not None else 0.0
    bound = TOL[key].bound(floor, float(np.abs(ref).max()) if ref.size else 0.0, np.dtype(key[1]))
    err = stats["max_abs"]
    multiple = err / floor if floor > 0 else (0.0 if err == 0 else float("inf"))
    return {**stats, "floor": floor, "bound": bound, "multiple": multiple, "passed": bool(err <= bound)}


def assert_close(op: str, out, ref, plain=None, *, dtype=None, backend: str = "?", case: str = "",
                 seed: int | None = None, tol_op: str | None = None) -> dict:
    """Fail unless `out` is within TOL[(op, dtype)] of `ref`; return the recorded errors."""
    __tracebackhide__ = True
    out = np.asarray(out)
    ref = np.asarray(ref, dtype=np.float64)
    dtype = np.dtype(dtype or out.dtype).name
    key = (tol_op or op, dtype)
    tol = TOL[key]
    head = f"{op}[{case}] on backend {backend!r}" + (f", seed {seed}" if seed is not None else "")
    if out.shape != ref.shape:
        raise AssertionError(f"{head}: shape {out.shape}, reference {ref.shape}\nrerun: {rerun_command()}")
    nan = np.isnan(out.astype(np.float64))
    if nan.any():
        first = tuple(int(i) for i in np.argwhere(nan)[0])
        raise AssertionError(f"{head}: {int(nan.sum())} NaN in the output (first at {first}; unwritten "
                             f"or read past the valid length?), shape {out.shape}\nrerun: {rerun_command()}")
    m = measure(out, ref, plain, key)
    stats, floor, bound, multiple = m, m["floor"], m["bound"], m["multiple"]
    record = {"op": op, "backend": backend, "format": None, "case": case, "seed": seed, "max_abs": m["max_abs"],
              "rel_l2": m["rel_l2"], "floor": floor, "multiple": multiple, "bound": bound, "passed": m["passed"]}
    RECORDS.append(record)
    if not record["passed"]:
        raise AssertionError(
            f"{head}: max abs error {stats['max_abs']:.4g} at {stats['where']} exceeds the bound {bound:.4g} "
            f"({tol.factor}x noise floor {floor:.4g} + {tol.ulps} ulp; {multiple:.3g}x the floor)\n"
            f"relative L2 error {stats['rel_l2']:.4g}; shape {out.shape}; tolerance TOL[{key}]: {tol.reason}\n"
            f"{describe_mismatch(out, ref)}\nrerun: {rerun_command()}")
    return record


def assert_equal(op: str, out, ref, *, backend: str = "?", case: str = "", seed: int | None = None) -> None:
    """Exact comparison (indices, token ids, integer tables)."""
    __tracebackhide__ = True
    out, ref = np.asarray(out), np.asarray(ref)
    ok = out.shape == ref.shape and np.array_equal(out, ref)
    RECORDS.append({"op": op, "backend": backend, "format": None, "case": case, "seed": seed,
                    "max_abs": 0.0 if ok else float("inf"),
                    "rel_l2": 0.0, "floor": 0.0, "multiple": 0.0 if ok else float("inf"), "bound": 0.0, "passed": ok})
    if not ok:
        bad = np.argwhere(out != ref)[:5].tolist() if out.shape == ref.shape else "shape"
        raise AssertionError(f"{op}[{case}] on backend {backend!r}" + (f", seed {seed}" if seed is not None else "")
                             + f": {out.ravel()[:8]} != reference {ref.ravel()[:8]} (differs at {bad})\n"
                             f"rerun: {rerun_command()}")
