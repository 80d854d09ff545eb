"""Self-tests of ladder/run/resources.py: what a ladder run took of the machine, in its report."""

from __future__ import annotations

import time

from ladder.run import resources
from ladder.run.resources import Resources, describe


def test_peaks_are_kept_overall_and_per_phase(tmp_path, monkeypatch):
    seen = iter([1, 5, 3, 2, 9, 4] + [0] * 1000)
    monkeypatch.setattr(resources, "gpu_used", lambda: next(seen) << 30)
    monkeypatch.setattr(resources, "host_used", lambda: 2 << 30)
    one = iter([1, 3, 2, 1, 6, 2] + [0] * 1000)
    monkeypatch.setattr(resources, "gpu_largest_process", lambda: next(one) << 30)
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
    # what was in use before the run: the first sample, taken on the sampler's thread (nvidia-smi is slow)
    assert rec["gpu_memory_before_gb"] == 1 and rec["host_memory_before_gb"] == 2
    assert set(rec["peaks_by_phase_gb"]) <= {"start", "convert", "graph"} and "convert" in rec["peaks_by_phase_gb"]
    assert rec["cache_gb"]["converted"] == round(1 / 1024, 2) and rec["model_files_gb"] == round(1 / 1024, 2)
    line = describe(rec)
    assert line.startswith("peak GPU memory 9.0 GB") and "peak host memory 2.0 GB" in line and "convert" in line
    # the largest single process: what one rung worker held, against the estimate its count was sized by
    assert max(v["gpu_one_process"] or 0 for v in rec["peaks_by_phase_gb"].values()) == 6
    assert "the largest process on the GPU by phase (GB) " in line and " 6.0" in line


def test_a_machine_without_nvidia_smi_or_proc_leaves_the_figures_out(monkeypatch, tmp_path):
    monkeypatch.setattr(resources, "gpu_used", lambda: None)
    monkeypatch.setattr(resources, "host_used", lambda: None)
    monkeypatch.setattr(resources, "gpu_largest_process", lambda: None)
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    r = Resources(every=0.001).start()
    r.stop()
    rec = r.record([])
    assert rec["peak_gpu_memory_gb"] is None and rec["peak_host_memory_gb"] is None
    assert describe(rec) == "not measured"


def test_the_largest_process_is_read_from_nvidia_smis_compute_apps(monkeypatch, tmp_path):
    """nvidia-smi lists each process on the GPU with the MiB it holds; the largest is the figure."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   'case "$1" in --query-compute-apps=*) printf "518\\n40817\\n52930\\n";; *) printf "94265\\n";; esac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert resources.gpu_largest_process() == 52930 << 20
    assert resources.gpu_used() == 94265 << 20
    smi.write_text("#!/bin/sh\nexit 0\n")  # a GPU with no process on it
    assert resources.gpu_largest_process() is None
