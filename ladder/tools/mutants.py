"""Mutants of the kernels' source: one small edit each, the rest of the file byte-identical.

A mutant is the kind of slip a kernel engineer makes (a `<` for a `<=`, an `fp16` for an `fp32`, a
missing barrier), written into one copy of one file. `nanoqwen mutate` (ladder/tools/mutate.py) runs the rungs
against each; a mutant the rungs pass "survived": the ladder could not tell that kernel from a broken
one. This module only finds the mutation sites and makes the edits.

- Python (kernels/numpy/*.py): the sites come from the `ast` (binary, comparison, boolean and unary
  operators, number literals, and the NumPy precision names `float32` / `float16` / `float64`; never in
  an annotation, which does not run); the
  operator's token is located between its operands with `tokenize`, so a docstring or a comment is
  never touched. A mutant that no longer parses is "did not compile".
- CUDA (kernels/cuda/*.cu, *.cuh): a tokenizer that skips comments, preprocessor lines and string
  literals (inline PTX lives in strings), then comparison, arithmetic, logical, bitwise and shift
  operators, integer and float literals, and barriers (`__syncthreads()`, `__syncwarp()`) and shuffle
  offsets (`__shfl_xor_sync(mask, v, k)` with another k). Angle brackets of templates and casts are not
  operators and are left alone.

Every mutant has a `signature` that does not move when unrelated lines change: the file, the function
it sits in, the original and the replacement text, and which occurrence of that text in that function
it is. The reviewed list of equivalent mutants (ladder/tools/equivalent_mutants.json) is keyed by it.
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import threading
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

from ladder.changes.sources import cuda_tokens, functions_of_tokens, token_index


@dataclass(frozen=True)
class Mutant:
    file: str  # path relative to the repository root
    line: int
    function: str  # the enclosing function ("<module>" outside any)
    kind: str  # operator, literal, precision, barrier, shuffle
    start: int  # byte offset of the replaced text in the file
    original: str
    replacement: str
    occurrence: int  # which occurrence of `original` -> `replacement` within `function`

    @property
    def signature(self) -> str:
        return f"{self.file}::{self.function}::{self.original}->{self.replacement}#{self.occurrence}"

    @property
    def id(self) -> str:
        return hashlib.sha1(self.signature.encode()).hexdigest()[:10]

    def apply(self, source: str) -> str:
        end = self.start + len(self.original)
        if source[self.start:end] != self.original:
            raise ValueError(f"{self.signature}: the source at offset {self.start} is not {self.original!r}")
        return source[:self.start] + self.replacement + source[end:]

    def describe(self) -> str:
        return f"{self.file}:{self.line} in {self.function}: {self.original!r} -> {self.replacement!r} ({self.kind})"

    def record(self) -> dict:
        return {**asdict(self), "signature": self.signature, "id": self.id}


# Operators and what each becomes (the classic "relational / arithmetic / logical operator replacement").
OPERATORS = {
    "<": ("<=", ">"), "<=": ("<", ">="), ">": (">=", "<"), ">=": (">", "<="), "==": ("!=",), "!=": ("==",),
    "+": ("-", "*"), "-": ("+",), "*": ("/", "+"), "/": ("*",), "%": ("/",), "//": ("/",),
    "<<": (">>",), ">>": ("<<",), "&": ("|",), "|": ("&",), "^": ("|",),
    "&&": ("||",), "||": ("&&",), "and": ("or",), "or": ("and",),
}
PRECISION = {"float32": ("float16",), "float16": ("float32",), "float64": ("float32",)}


def _number_mutations(text: str) -> list[str]:
    """An integer n -> n + 1, n - 1 (n > 0) and 0 -> 1; a float f -> 2 f and 0."""
    core = text.rstrip("uUlLfF")
    suffix = text[len(core):]
    if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", core):
        n = int(core, 0)
        out = [n + 1] + ([n - 1] if n > 0 else [])
        return [(hex(v) if core.lower().startswith("0x") else str(v)) + suffix for v in out]
    try:
        f = float(core)
    except ValueError:
        return []
    return [repr(2 * f) + suffix, ("0.0" if "." in core or "e" in core.lower() else "0") + suffix] if f else ["1.0" + suffix]


# --- Python ------------------------------------------------------------------------------------------


def _offsets(source: str) -> list[int]:
    starts, pos = [0], 0
    for line in source.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def python_mutants(path: Path, rel: str) -> list[Mutant]:
    source = path.read_text()
    tree = ast.parse(source)
    line_start = _offsets(source)
    off = lambda line, col: line_start[line - 1] + col  # noqa: E731
    ops = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.OP or (t.type == tokenize.NAME and t.string in ("and", "or"))]

    functions: list[tuple[int, int, str]] = []  # (start, end, name), innermost last wins
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append((off(node.lineno, node.col_offset), off(node.end_lineno, node.end_col_offset), node.name))

    def function_at(pos: int) -> str:
        inside = [f for f in functions if f[0] <= pos < f[1]]
        return min(inside, key=lambda f: f[1] - f[0])[2] if inside else "<module>"

    def op_between(a: ast.AST, b: ast.AST, texts) -> tuple[int, str, int] | None:
        lo, hi = off(a.end_lineno, a.end_col_offset), off(b.lineno, b.col_offset)
        for t in ops:
            p = off(*t.start)
            if lo <= p < hi and t.string in texts:
                return p, t.string, t.start[0]
        return None

    # Annotations (`-> int | None`, `x: float | None`) are not code that runs: an edit there changes nothing.
    annotations = {id(n) for a in ast.walk(tree) for ann in _annotations(a) for n in ast.walk(ann)}
    sites: list[tuple[int, int, str, str, list[str]]] = []  # (offset, line, kind, text, replacements)
    for node in ast.walk(tree):
        if id(node) in annotations:
            continue
        found = []
        if isinstance(node, ast.BinOp):
            found.append(op_between(node.left, node.right, OPERATORS))
        elif isinstance(node, ast.Compare):
            left = node.left
            for right in node.comparators:
                found.append(op_between(left, right, OPERATORS))
                left = right
        elif isinstance(node, ast.BoolOp):
            for a, b in zip(node.values, node.values[1:]):
                found.append(op_between(a, b, ("and", "or")))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float) and not isinstance(node.value, bool):
            p = off(node.lineno, node.col_offset)
            text = source[p:off(node.end_lineno, node.end_col_offset)]
            sites.append((p, node.lineno, "literal", text, _number_mutations(text)))
        elif isinstance(node, ast.Attribute) and node.attr in PRECISION:
            p = off(node.end_lineno, node.end_col_offset) - len(node.attr)
            sites.append((p, node.end_lineno, "precision", node.attr, list(PRECISION[node.attr])))
        for hit in found:
            if hit is not None:
                p, text, line = hit
                sites.append((p, line, "operator", text, list(OPERATORS[text])))
    return _mutants(rel, sites, function_at)


def _annotations(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
        return [x for x in (node.returns, *(arg.annotation for arg in args)) if x is not None]
    if isinstance(node, ast.AnnAssign):
        return [node.annotation]
    return []


# --- CUDA --------------------------------------------------------------------------------------------

_CUDA_OPS = {k: v for k, v in OPERATORS.items() if k not in ("and", "or", "//")}
_BARRIERS = ("__syncthreads", "__syncwarp")


def _is_template_bracket(source: str, toks, i: int) -> bool:
    """`<` / `>` of `template <...>`, `gemv_rows<D, ...>(...)` or `static_cast<T>(...)`, not a comparison:
    the house style writes a comparison with spaces around it and a template's `<` against its name."""
    text = toks[i][1]
    if text == "<":
        prev_kind, prev, prev_pos = toks[i - 1] if i else ("op", "", 0)
        glued = prev_kind == "name" and prev_pos + len(prev) == toks[i][2]
        return prev == "template" or glued
    if text == ">":
        depth = 0
        for j in range(i - 1, max(-1, i - 60), -1):
            t = toks[j][1]
            if t in (";", "{", "}") or (t in ("&&", "||") and depth == 0):
                return False
            if t == ">":
                depth += 1
            elif t == "<":
                if depth == 0:
                    return _is_template_bracket(source, toks, j)
                depth -= 1
    return False


_TYPES = {"float", "int", "u32", "f16_bits", "uint4", "char", "short", "unsigned", "size_t", "float2", "float4", "uint2",
          "void", "signed", "uint8_t", "int8_t", "uint32_t", "int32_t", "double", "half", "Scale", "Aux", "auto", "bool"}


def _is_unary_or_declarator(toks, i: int) -> bool:
    """A sign, a dereference or address-of, or a pointer / reference declarator: not a binary operator."""
    prev_kind, prev, _ = toks[i - 1] if i else ("op", "(", 0)
    if prev_kind == "op" and prev not in (")", "]") or prev in ("return", "case"):
        return True  # nothing to its left that could be an operand
    if toks[i][1] in ("*", "&") and prev in _TYPES:
        return True  # `float* x`, `const uint4*>`
    return False


def cuda_mutants(path: Path, rel: str) -> list[Mutant]:
    source = path.read_text()
    toks = cuda_tokens(source)
    line_of = lambda p: source.count("\n", 0, p) + 1  # noqa: E731

    function_of = functions_of_tokens(toks)

    sites = []
    for i, (kind, text, p) in enumerate(toks):
        if function_of[i] == "<file>":
            continue  # declarations and signatures: a mutant there is a different kernel, not a slip in one
        if kind == "op" and text in _CUDA_OPS:
            if _is_template_bracket(source, toks, i) or (text in ("-", "+", "*", "&") and _is_unary_or_declarator(toks, i)):
                continue
            sites.append((p, line_of(p), "operator", text, list(_CUDA_OPS[text])))
        elif kind == "number":
            sites.append((p, line_of(p), "literal", text, _number_mutations(text)))
        elif kind == "name" and text in _BARRIERS and i + 2 < len(toks) and toks[i + 1][1] == "(":
            close = next(j for j in range(i + 1, len(toks)) if toks[j][1] == ")")
            end = toks[close + 1][2] + 1 if close + 1 < len(toks) and toks[close + 1][1] == ";" else toks[close][2] + 1
            sites.append((p, line_of(p), "barrier", source[p:end], [";"]))
        elif kind == "name" and text.startswith("__shfl_xor_sync") and toks[i + 1][1] == "(":
            # the lane offset: the last argument before the call's `)`
            depth_, j = 0, i + 1
            while j < len(toks):
                depth_ += toks[j][1] == "("
                depth_ -= toks[j][1] == ")"
                if depth_ == 0:
                    break
                j += 1
            last = toks[j - 1]
            if last[0] in ("name", "number") and toks[j - 2][1] == ",":
                sites.append((last[2], line_of(last[2]), "shuffle", last[1], [f"({last[1]}) >> 1"]))
    return _mutants(rel, sites, lambda pos: function_of[token_index(toks, pos)])


def _mutants(rel: str, sites, function_at) -> list[Mutant]:
    out, seen = [], {}
    for p, line, kind, text, replacements in sorted(sites, key=lambda s: s[0]):
        fn = function_at(p)
        for r in replacements:
            key = (fn, text, r)
            seen[key] = seen.get(key, -1) + 1
            out.append(Mutant(rel, line, fn, kind, p, text, r, seen[key]))
    return out


def mutants_of(root: Path, rel: str) -> list[Mutant]:
    """Every mutant of one kernel source file (`rel` relative to the repository root)."""
    path = root / rel
    if path.suffix == ".py":
        return python_mutants(path, rel)
    if path.suffix in (".cu", ".cuh"):
        return cuda_mutants(path, rel)
    raise ValueError(f"{rel}: not a Python or CUDA source")


# `nanoqwen mutate`'s workers are threads, and each asks `compiles`. CPython 3.11 keeps the AST builder's
# recursion count per interpreter, not per thread: two parses at once can fail with "SystemError: AST
# constructor recursion depth mismatch" (python/cpython gh-106905; it failed a CI run's mutate self-test).
# One parse at a time.
_PARSE = threading.Lock()


def compiles(rel: str, source: str) -> bool:
    """Whether a mutated Python source still parses (CUDA sources are compiled by the rungs themselves)."""
    if not rel.endswith(".py"):
        return True
    try:
        with _PARSE:
            ast.parse(source)
    except SyntaxError:
        return False
    return True
