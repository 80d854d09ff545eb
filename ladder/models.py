"""Which model the ladder runs on (a .nanoqwen file, a Hugging Face folder converted once, or the
default), and the prompt a command gives it (token ids, or text through the model's own tokenizer)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from fixtures.tiny_model import cache_root


def resolve_model(spec: str | None, quant: str = "int4_sym_g128") -> Path:
    """A .nanoqwen path for `spec`: None -> the default model; a folder -> its cached conversion."""
    if spec is None:
        from fixtures.default_model import default_model_file

        return default_model_file()
    path = Path(spec)
    if not path.is_dir():
        return path
    from engine.convert import convert

    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = cache_root() / "converted" / f"{path.name}-{quant}-{h.hexdigest()[:12]}.nanoqwen"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".nanoqwen")
        os.close(fd)
        try:
            convert(path, tmp, quant)
            os.replace(tmp, out)  # atomic: parallel workers converting the same folder both succeed
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def prompt_ids(path, text: str | None, ids_csv: str | None):
    """(token ids, the model's tokenizer or None) for `--prompt TEXT` or `--prompt-ids 1,2,3`."""
    tok = model_tokenizer(path, required=text is not None)
    if text is not None:
        return tok.encode(text).ids, tok
    try:
        return [int(s) for s in ids_csv.split(",") if s.strip()], tok
    except ValueError:
        raise SystemExit(f"nanoqwen: error: --prompt-ids must be comma-separated integers, got {ids_csv!r}") from None


def model_tokenizer(path, required: bool = True):
    """The tokenizer embedded in a .nanoqwen file; None (or SystemExit when required) if it has none."""
    from engine.modelfile import ModelFile

    blob = ModelFile(path, verify_checksums=False).file("tokenizer.json")
    if blob is None:
        if required:
            raise SystemExit(f"nanoqwen: error: {path} carries no tokenizer.json; use --prompt-ids")
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_str(blob.decode())
