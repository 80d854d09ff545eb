"""Which model a command runs on (a .nanoqwen file, a Hugging Face folder converted once into the cache,
or the embedded default model) and the prompt it gives it (token ids, or text through the model's own
tokenizer). The product command line (engine/cli.py) and the ladder's commands share these.

The default model is the one thing here that comes from fixtures/: `fixtures.default_model`, imported
only when no model is named (the arrow is in ladder/selftest/arrows.py)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from engine.formats import DEFAULT_FORMAT


def cache_root() -> Path:
    """Where built and converted models are cached (NANOQWEN_CACHE, else ~/.cache/nanoqwen)."""
    return Path(os.environ.get("NANOQWEN_CACHE", Path.home() / ".cache" / "nanoqwen"))


def resolve_model(spec: str | None, quant: str = DEFAULT_FORMAT, progress=True) -> Path:
    """A .nanoqwen path for `spec` in format `quant`: None -> the default model; a folder -> its cached
    conversion; a file -> itself (in the format it was written in).

    A folder is converted once into the cache, with a progress bar on stderr (`progress=False` for
    none, or a callable `progress(i, n, name)`), announced once the converter's checks have passed. The
    conversion writes through a temporary file that an interrupted run removes, and temporary files a
    killed run left in the cache are removed on the cache's next use (engine/outpath.py)."""
    if spec is None:
        from fixtures.default_model import default_model_file

        return default_model_file(quant)
    path = Path(spec)
    if not path.is_dir():
        return path
    from engine.convert import CheckpointError, convert
    from engine.errors import OutputPathError
    from engine.outpath import remove_stale_temp_files

    h = hashlib.sha256()
    try:
        for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the folder ({e.strerror or e})") from None
    folder = cache_root() / "converted"
    out = folder / f"{path.resolve().name}-{quant}-{h.hexdigest()[:12]}.nanoqwen"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(folder, f"cannot create the cache folder ({e.strerror or e}); NANOQWEN_CACHE moves it") from None
    remove_stale_temp_files(folder)
    if not out.exists():
        if progress is True:
            progress = _announced_bar(f"nanoqwen: converting {path} once, into {out}\n")
        # Atomic (a temporary file, then a rename): parallel workers converting the same folder both succeed.
        convert(path, out, quant, progress=progress or None)
    return out


def _announced_bar(announcement: str):
    """A progress bar that writes `announcement` before its first step: a folder the converter refuses
    (every check runs before the first tensor is written) is one line on stderr, the error."""
    from engine.progress import progress_bar

    bar = progress_bar("convert")
    said = []

    def show(i: int, n: int, name: str) -> None:
        if not said:
            said.append(True)
            sys.stderr.write(announcement)
        bar(i, n, name)

    return show


def prompt_ids(path, text: str | None, ids_csv: str | None):
    """(token ids, the model's tokenizer or None) for `--prompt TEXT` or `--prompt-ids 1,2,3` (the
    latter already checked by the argument's type, engine.cli.token_ids_arg)."""
    tok = model_tokenizer(path, required=text is not None)
    if text is not None:
        return tok.encode(text).ids, tok
    return [int(s) for s in ids_csv.split(",")], tok  # checked and normalized by engine.cli.token_ids_arg


def model_tokenizer(path, required: bool = True):
    """The tokenizer embedded in a .nanoqwen file; None (or SystemExit when required) if it has none."""
    from engine.tokenizer import embedded_tokenizer

    tok = embedded_tokenizer(path, verify_checksums=False)
    if tok is None and required:
        raise SystemExit(f"nanoqwen: error: {path} carries no tokenizer.json; use --prompt-ids")
    return tok
