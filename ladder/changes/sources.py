"""Reading the kernels' source: which function a line or a token sits in, and which CUDA function calls which.

Two readers need this and must agree: the mutants (ladder/tools/mutants.py names each mutant by the
function it sits in) and the launch map (ladder/changes/launches.py turns a mutated or changed function into
the kernels that run it). One reading, here:

- CUDA (kernels/cuda/*.cu, *.cuh): a tokenizer that skips comments, preprocessor lines and string
  literals (inline PTX lives in strings). A token belongs to the function whose body holds it: the name
  before the `(` of the parameter list whose `{` opens a top-level block; tokens outside any body
  (signatures, declarations) belong to "<file>".
- Python (kernels/numpy/*.py): the innermost `def` holding a line, "<module>" outside any.

And `cuda_module(name)`: a Python file of kernels/cuda (the loader, the catalog) read by its path, for
the readers that must work where the package kernels.cuda, which imports CuPy, cannot be imported.
And `files_digest(root, files)`: one digest of files' paths and bytes, for what must run on the same
sources (a resumed mutant sample, a kept unit rung).
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import importlib.util
import re
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cuda"


def files_digest(root: Path, files) -> str:
    """sha256 (hex) over each file's path relative to `root` (as given, '/'-separated) and bytes, in the order given."""
    h = hashlib.sha256()
    for rel in files:
        h.update(str(rel).encode() + b"\0" + (Path(root) / rel).read_bytes() + b"\0")
    return h.hexdigest()


def cuda_module(name: str, folder: Path = CUDA_DIR):
    """kernels/cuda/<name>.py of `folder` (a copy of the tree may be read), loaded by its file path without
    importing the package kernels.cuda (which imports CuPy, missing on a machine without a GPU)."""
    spec = importlib.util.spec_from_file_location(f"_nanoqwen_cuda_{name}_{abs(hash(str(folder)))}",
                                                  Path(folder) / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_CUDA_TOKEN = re.compile(r"""
    (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<pre>^[ \t]*\#[^\n]*(?:\\\n[^\n]*)*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
  | (?P<number>(?:0[xX][0-9a-fA-F]+|\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\d+(?:[eE][+-]?\d+)?)[uUlLfF]*)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op><<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||\+\+|--|->|::|[-+*/%<>=!&|^~?:;,.(){}\[\]])
  | (?P<space>\s+)
""", re.S | re.M | re.X)
_PREPROCESSOR = re.compile(r"^[ \t]*#[^\n]*(?:\\\n[^\n]*)*", re.M)
_WORD = re.compile(r"[A-Za-z_]\w*")


def cuda_tokens(source: str) -> list[tuple[str, str, int]]:
    """(kind, text, offset) of every token that is not a comment, a preprocessor line or white space."""
    out, pos = [], 0
    while pos < len(source):
        m = _CUDA_TOKEN.match(source, pos)
        if m is None:
            raise ValueError(f"cannot tokenize the CUDA source at offset {pos}: {source[pos:pos + 20]!r}")
        kind = m.lastgroup
        if kind not in ("comment", "pre", "space"):
            out.append((kind, m.group(), pos))
        pos = m.end()
    return out


_ATTRIBUTES = ("alignas", "__align__", "__attribute__", "__declspec")  # `name(...)` that names no function


def functions_of_tokens(toks) -> list[str]:
    """The function each token of `cuda_tokens` is in ("<file>" outside every body)."""
    # The candidate name of the next body: at file level and outside parentheses, the last name followed by
    # `(` (`__launch_bounds__(64) k(` names k; `float f(const u32 (&w)[4])` names f, not u32), or the name
    # after `struct` / `class` / `union` and any attribute (`struct alignas(128) Map {` names Map: a
    # struct's methods are its body); a `;` ends a declaration.
    function_of, depth, parens, current, candidate = [], 0, 0, "<file>", None
    for i, (kind, text, _) in enumerate(toks):
        if depth == 0:
            if text == "(":
                parens += 1
            elif text == ")":
                parens -= 1
            elif text == ";":
                candidate = None
            elif kind == "name" and parens == 0 and i + 1 < len(toks) and text not in _ATTRIBUTES:
                if toks[i + 1][1] == "(":
                    candidate = text
                elif text in ("struct", "class", "union"):
                    j = i + 1
                    while j + 1 < len(toks) and toks[j][1] in _ATTRIBUTES and toks[j + 1][1] == "(":
                        j = _after_parens(toks, j + 1)
                    if j < len(toks) and toks[j][0] == "name":
                        candidate = toks[j][1]
        if text == "{":
            if depth == 0:
                current = candidate or "<file>"
            depth += 1
            function_of.append(current)
            continue
        if text == "}":
            depth -= 1
            function_of.append(current)
            if depth == 0:
                current = "<file>"
            continue
        function_of.append(current if depth > 0 else "<file>")
    return function_of


def _after_parens(toks, open_: int) -> int:
    """The index after the `)` that closes the `(` at toks[open_]."""
    depth = 0
    for j in range(open_, len(toks)):
        depth += toks[j][1] == "("
        depth -= toks[j][1] == ")"
        if depth == 0:
            return j + 1
    return len(toks)


def token_index(toks, pos: int) -> int:
    """The index of the last token that starts at or before offset `pos`."""
    return max(0, bisect.bisect_right(toks, pos, key=lambda t: t[2]) - 1)


def cuda_functions_on_lines(source: str, lines: set[int]) -> set[str]:
    """The functions whose code (not a comment, not blank) is on any of `lines` (1-based)."""
    toks = cuda_tokens(source)
    function_of = functions_of_tokens(toks)
    line_starts = [0] + [m.end() for m in re.finditer("\n", source)]
    found = set()
    for i, (_, _, p) in enumerate(toks):
        if bisect.bisect_right(line_starts, p) in lines:  # its 1-based line
            found.add(function_of[i])
    # a preprocessor line (a macro, an #include) is code too, outside any function's tokens
    for m in _PREPROCESSOR.finditer(source):
        first, last = bisect.bisect_right(line_starts, m.start()), bisect.bisect_right(line_starts, m.end())
        if any(first <= line <= last for line in lines):
            found.add("<file>")
    return found


def cuda_calls(source: str) -> dict[str, set[str]]:
    """Function name -> every name its signature and body mention (calls among them; a template argument, a
    parameter's type or a variable too, which only makes the reading wider: a struct passed by value is
    reached by the kernel that takes it). Overloads and template instances share their name."""
    toks = cuda_tokens(source)
    calls: dict[str, set[str]] = {}
    statement: list[str] = []  # the names of the file-level statement so far (a body's: its signature)
    for (kind, text, _), fn in zip(toks, functions_of_tokens(toks)):
        if fn != "<file>":
            body = calls.setdefault(fn, set())
            body.update(statement)
            if kind == "name":
                body.add(text)
            statement = []
            continue
        if text == ";":
            # a file-level alias is a name that reaches what it names:
            # `typedef DecodeRowScaledBytes<Int8Bytes> DecodeInt8SymChannel;`, `using D = X<Y>;`
            if statement[:1] == ["typedef"] and len(statement) > 2:
                calls.setdefault(statement[-1], set()).update(statement[1:-1])
            elif statement[:1] == ["using"] and len(statement) > 2:
                calls.setdefault(statement[1], set()).update(statement[2:])
            statement = []
        elif kind == "name":
            statement.append(text)
    return calls


def cuda_macro_names(source: str) -> set[str]:
    """Every name a preprocessor line of `source` mentions (a macro may call a function the tokens miss)."""
    return {w for m in _PREPROCESSOR.finditer(source) for w in _WORD.findall(m.group())}


def python_functions_on_lines(source: str, lines: set[int]) -> set[str]:
    """The innermost `def` holding each of `lines` (1-based), "<module>" for a line outside every def."""
    defs = []  # (first line, last line, name); a decorator's lines belong to the function it decorates
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.append((min([n.lineno, *(x.lineno for x in n.decorator_list)]), n.end_lineno, n.name))
    found = set()
    for line in lines:
        inside = [d for d in defs if d[0] <= line <= d[1]]
        found.add(min(inside, key=lambda d: d[1] - d[0])[2] if inside else "<module>")
    return found
