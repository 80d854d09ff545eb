"""What a ladder run took of the machine, for the report: peak GPU memory, peak host memory, and disk.

`Resources` samples, once a second on a background thread from the conversion to the last rung (and
per phase: the conversion, each rung, so a red night shows which one filled the machine), the GPU memory in use
(`nvidia-smi`, which needs no CUDA context in this process, over every GPU: the rungs' workers and their
references) and the host memory in use (MemTotal - MemAvailable of /proc/meminfo, the whole machine's: a
worker killed for memory shows here first), and the GPU memory of the largest single process (`nvidia-smi
--query-compute-apps`: a rung's workers are sized by an estimate of what one holds, ladder/run/workers.py,
and this is what one held: a 7B graph rung whose workers held 52 GB against an estimate of 39 ran out of
the GPU's memory). At the end, `record()` adds the disk the run's model and its
kept results occupy: the model files under test, and the cache folder's converted models and kept
references (engine/resolve.py cache_root). A 7B run's first run writes 5 to 9 GB per format there.

Every probe is guarded: a missing `nvidia-smi` or /proc leaves its figure out, never fails a run.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

GB = 1 << 30
KEPT = ("converted", "graph-references", "graph-bounds", "layer-references", "golden")  # the cache's folders a run fills


def _smi(query: str) -> list[str] | None:
    """The values nvidia-smi prints for `query` (one per GPU or process, no header, no units); None where
    nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        return subprocess.run([smi, query, "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_used() -> int | None:
    """Bytes of GPU memory in use, summed over the GPUs (None where nvidia-smi cannot say)."""
    values = _smi("--query-gpu=memory.used")
    try:
        return None if values is None else sum(int(float(v)) for v in values) * (1 << 20)
    except ValueError:
        return None


def gpu_largest_process() -> int | None:
    """Bytes of GPU memory held by the process that holds the most (nvidia-smi's compute apps, over every
    GPU); None where nvidia-smi cannot say or no process holds any."""
    values = _smi("--query-compute-apps=used_memory")
    held = [int(float(v)) for v in values or () if v.replace(".", "", 1).isdigit()]
    return max(held) * (1 << 20) if held else None


def host_used() -> int | None:
    """Bytes of host memory in use (MemTotal - MemAvailable), None where /proc/meminfo is not there."""
    try:
        info = {k: int(v.split()[0]) * 1024 for k, _, v in
                (line.partition(":") for line in Path("/proc/meminfo").read_text().splitlines()) if v}
        return info["MemTotal"] - info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def folder_bytes(path: Path) -> int:
    total = 0
    try:
        for p in path.rglob("*"):
            try:
                if p.is_file():
                    total += p.stat().st_size
            except OSError:
                continue
    except OSError:
        pass
    return total


class Resources:
    """Peak GPU and host memory while the rungs run (a sample a second), and the disk at the end."""

    def __init__(self, every: float = 1.0):
        self.every = every
        self.peak_gpu = self.peak_host = None
        self.phase = "start"  # what the run is doing: "convert", then each rung (set by the runner)
        self.by_phase: dict[str, list] = {}  # phase -> [peak GPU, peak host, peak of the largest GPU process]
        # in use before the run (another process's): reported beside the peak. Read by the sampler's first
        # sample, not here: nvidia-smi takes its time, and the run need not wait for it to start.
        self.base_gpu = self.base_host = None
        self._first = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> "Resources":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def _sample(self) -> None:
        while True:
            g, h = gpu_used(), host_used()
            if self._first:
                self.base_gpu, self.base_host, self._first = g, h, False
            one = gpu_largest_process() if g else None  # no GPU memory in use: no process to ask about
            peaks = self.by_phase.setdefault(self.phase, [None, None, None])
            if g is not None:
                self.peak_gpu = max(self.peak_gpu or 0, g)
                peaks[0] = max(peaks[0] or 0, g)
            if one is not None:
                peaks[2] = max(peaks[2] or 0, one)
            if h is not None:
                self.peak_host = max(self.peak_host or 0, h)
                peaks[1] = max(peaks[1] or 0, h)
            if self._stop.wait(self.every):
                return

    def record(self, model_files) -> dict:
        """The figures for report.json's meta (GB, rounded): peak memory, and the disk of the run's files."""
        from engine.resolve import cache_root

        def gb(n):
            return None if n is None else round(n / GB, 2)

        root = cache_root()
        return {"peak_gpu_memory_gb": gb(self.peak_gpu), "gpu_memory_before_gb": gb(self.base_gpu),
                "peak_host_memory_gb": gb(self.peak_host), "host_memory_before_gb": gb(self.base_host),
                "model_files_gb": gb(sum(Path(f).stat().st_size for f in model_files if Path(f).exists())),
                "cache_gb": {k: gb(folder_bytes(root / k)) for k in KEPT if (root / k).exists()},
                "peaks_by_phase_gb": {k: {"gpu": gb(g), "host": gb(h), "gpu_one_process": gb(p)}
                                      for k, (g, h, p) in self.by_phase.items()}}


def _gb(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def describe(r: dict) -> str:
    """One line for report.md and the terminal."""
    parts = []
    if r.get("peak_gpu_memory_gb") is not None:
        parts.append(f"peak GPU memory {r['peak_gpu_memory_gb']:.1f} GB (before the run {r['gpu_memory_before_gb']:.1f})")
    if r.get("peak_host_memory_gb") is not None:
        parts.append(f"peak host memory {r['peak_host_memory_gb']:.1f} GB (before {r['host_memory_before_gb']:.1f})")
    if r.get("model_files_gb"):
        parts.append(f"model files {r['model_files_gb']:.1f} GB")
    phases = r.get("peaks_by_phase_gb") or {}
    if len(phases) > 1:
        parts.append("peaks by phase (GPU/host GB) " + ", ".join(
            f"{k} {_gb(v.get('gpu'))}/{_gb(v.get('host'))}" for k, v in phases.items()))
    largest = {k: v["gpu_one_process"] for k, v in phases.items() if v.get("gpu_one_process") is not None}
    if largest:
        parts.append("the largest process on the GPU by phase (GB) " + ", ".join(f"{k} {v:.1f}" for k, v in largest.items()))
    cache = r.get("cache_gb") or {}
    if cache:
        parts.append("cache " + ", ".join(f"{k} {v:.1f} GB" for k, v in cache.items()))
    return "; ".join(parts) or "not measured"
