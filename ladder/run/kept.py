"""Kept results: a green unit rung is not run again on the same inputs.

The unit rung checks each kernel against its float64 reference on shapes and values of its own, drawn
by the derandomized `ci` Hypothesis profile: its outcome is a function of the project's sources, the
library versions, the device, the model, the options and the environment variables the project reads.
When every one of those is what it was at a green unit rung on this machine, `nanoqwen ladder` shows
that rung's result again instead of running it, as a build system shows a cached test result (Bazel's
"(cached) PASSED"), and says so in one line and in the report. `--fresh` (or NANOQWEN_KEPT_RESULTS=off)
runs it whatever is kept.

The key is a digest of:
- every file of the project's packages (engine/, kernels/, ladder/, reference/, fixtures/: the embedded
  default model too) and conftest.py, by content: an edit anywhere, a dirty tree included, is another key;
- Python, NumPy, torch, transformers, pytest, pytest-xdist, Hypothesis and CuPy versions, the GPU, its
  driver and NVRTC (the compiler of the CUDA kernels), the host's CPU model;
- the rung's options: backend, required backend, format, model files and prompt file (path, size and
  modification time), the launch-map flags and the arguments after `--` (a file they name, by path,
  size and modification time);
- every NANOQWEN_* variable but those that only say where files go or how often progress is printed.

Only a green rung is kept; a run with a planted fault, a shard, `--changed` or the nightly profile is
never kept nor served from what is kept. The layer and graph rungs always run: they check the engine on
the model against its kept references, and their cost is the engine's.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

KEPT_RUNGS = ("unit",)
SWITCH = "NANOQWEN_KEPT_RESULTS"  # "off": never serve nor keep (the test process sets it for the ladders it starts)
SOURCE_PACKAGES = ("engine", "kernels", "ladder", "reference", "fixtures")
# variables that say where files go or how often progress is printed: no result depends on them
NOT_IN_KEY = {"NANOQWEN_CACHE", "NANOQWEN_STALL_SECONDS", "NANOQWEN_PROGRESS_DIR", "NANOQWEN_PROGRESS_SECONDS",
              "NANOQWEN_PROGRESS_EVERY", "NANOQWEN_WORKER_LOG", "NANOQWEN_CONVERT_THREADS", "NANOQWEN_SIDE_BY_SIDE",
              "NANOQWEN_RUNG_OUTPUT", SWITCH}


def enabled(args) -> bool:
    return not getattr(args, "fresh", False) and os.environ.get(SWITCH, "on").lower() not in ("off", "0", "no")


def keepable(args, rung: str) -> bool:
    """Whether this run's `rung` may be served from, or stored into, what is kept."""
    return (rung in KEPT_RUNGS and enabled(args) and not args.plant_fault and not args.shard and not args.changed
            and (args.hypothesis_profile or "ci") == "ci")


def sources_digest(root: Path) -> str:
    """sha256 over the project's package files (relative path and bytes), in path order."""
    from ladder.changes.sources import files_digest

    files = [root / "conftest.py"] if (root / "conftest.py").is_file() else []
    for pkg in SOURCE_PACKAGES:
        files += [p for p in (root / pkg).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return files_digest(root, sorted(p.relative_to(root).as_posix() for p in files))


def _file_identity(path: str | None):
    if not path:
        return None
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError:
        return [str(p), None, None]
    return [str(p), st.st_size, st.st_mtime_ns]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvrtc() -> str | None:
    try:
        import cupy

        return ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    except Exception:  # noqa: BLE001: a probe must never fail a run
        return None


def key(args, rung: str, rung_args: list[str], root: Path, environment: dict) -> dict:
    """What the rung's outcome depends on (see the module's docstring), with its digest under "digest"."""
    parts = {
        "rung": rung,
        "sources": sources_digest(root),
        "environment": {**environment, "nvrtc": _nvrtc() if environment.get("gpu") else None, "cpu": _cpu_model()},
        "options": {"backend": args.backend, "require_backend": args.require_backend, "quant": args.quant,
                    "model": [_file_identity(f) for f in (getattr(args, "model_files", None) or [])] or None,
                    "prompts": _file_identity(args.prompts), "new_tokens": args.new_tokens,
                    "launch_flags": [f for f in getattr(args, "launch_flags", [])], "pytest": rung_args,
                    # a test file named after `--` is the user's, outside the packages: by identity
                    "named": [_file_identity(a) for a in rung_args if not a.startswith("-") and Path(a).is_file()]},
        "variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NANOQWEN_") and k not in NOT_IN_KEY},
    }
    parts["digest"] = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return parts


def folder(digest: str) -> Path:
    from engine.resolve import cache_root

    return cache_root() / "kept-results" / digest


def files_of(rung: str) -> tuple[str, str]:
    return f"{rung}.json", f"junit-{rung}.xml"


def serve(parts: dict, out: Path, rung: str) -> dict | None:
    """The kept result of `parts` copied into the report folder `out`: (the rung's JSON data, when it was
    kept); None when nothing complete is kept under that key."""
    src = folder(parts["digest"])
    try:
        meta = json.loads((src / "kept.json").read_text())
        data = json.loads((src / files_of(rung)[0]).read_text())
        for name in files_of(rung):
            shutil.copyfile(src / name, out / name)
    except (OSError, ValueError):
        return None
    return {"data": data, "kept": meta.get("kept"), "seconds": meta.get("seconds")}


def store(parts: dict, out: Path, rung: str, seconds: float) -> None:
    """Keep a green rung's files under its key: written to a temporary folder beside, then renamed, so a
    reader never sees half of it; a failure to keep is not the run's failure."""
    dest = folder(parts["digest"])
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            for name in files_of(rung):
                shutil.copyfile(out / name, tmp / name)
            (tmp / "kept.json").write_text(json.dumps(
                {"kept": datetime.datetime.now().isoformat(timespec="seconds"), "seconds": round(seconds, 1),
                 "report": str(out), "key": parts}, indent=1, default=str))
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
