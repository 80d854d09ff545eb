"""Which model the ladder runs on: a .nanoqwen file, a Hugging Face folder (converted once), or the default."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def _cache_root() -> Path:
    return Path(os.environ.get("NANOQWEN_CACHE", Path.home() / ".cache" / "nanoqwen"))


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
    out = _cache_root() / "converted" / f"{path.name}-{quant}-{h.hexdigest()[:12]}.nanoqwen"
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
