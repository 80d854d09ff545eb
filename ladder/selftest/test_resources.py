"""Self-tests of ladder/run/resources.py: what a ladder run took of the machine, in its report."""

from __future__ import annotations

import time

from ladder.run import resources
from ladder.run.resources import Resources, describe


def test_peaks_are_kept_overall_and_per_phase(tmp_path, monkeypatch):
    seen = iter([1, 5, 3, 2, 9, 4] + [0] * 1000)
    monkeypatch.setattr(resources, "gpu_used", lambda: next(seen) << 30)
    monkeypatch.setattr(resources, "host_used", lambda: 2 << 30)
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    (tmp_path / "converted").mkdir()
    (tmp_path / "converted" / "m.nanoqwen").write_bytes(b"\0" * (1 << 20))
    r = Resources(every=0.001)
    r.phase = "convert"
    r.start()
    time.sleep(0.05)
    r.phase = "graph"
    time.sleep(0.05)
    r.stop()
    rec = r.record([str(tmp_path / "converted" / "m.nanoqwen")])
    assert rec["peak_gpu_memory_gb"] == 9 and rec["peak_host_memory_gb"] == 2
    assert set(rec["peaks_by_phase_gb"]) <= {"start", "convert", "graph"} and "convert" in rec["peaks_by_phase_gb"]
    assert rec["cache_gb"]["converted"] == round(1 / 1024, 2) and rec["model_files_gb"] == round(1 / 1024, 2)
    line = describe(rec)
    assert line.startswith("peak GPU memory 9.0 GB") and "peak host memory 2.0 GB" in line and "convert" in line


def test_a_machine_without_nvidia_smi_or_proc_leaves_the_figures_out(monkeypatch, tmp_path):
    monkeypatch.setattr(resources, "gpu_used", lambda: None)
    monkeypatch.setattr(resources, "host_used", lambda: None)
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    r = Resources(every=0.001).start()
    r.stop()
    rec = r.record([])
    assert rec["peak_gpu_memory_gb"] is None and rec["peak_host_memory_gb"] is None
    assert describe(rec) == "not measured"
