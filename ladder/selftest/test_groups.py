"""Self-test: under `--dist loadgroup` the plugin's groups reach pytest-xdist.

A format's model-bound cases (the layer and graph rungs') must share one worker, which builds the
model and its HF simulation once; the unit rung's other cases must not be grouped (they spread over every
worker); a test marked `same_worker(...)` keeps the cases that share those parameters together (the
7B-shape linears' decode and prefill cases share one weight). pytest-xdist names a grouped case
`nodeid@group` in the JUnit file, which is what is read here.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from ladder.nested import child_env, skip_inside_nested_run

REPO = Path(__file__).resolve().parents[2]


def _groups(tmp_path: Path, *args: str) -> dict[str, str]:
    """test name -> its group ("" where none), from a two-worker run's JUnit file."""
    junit = tmp_path / "junit.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "ladder.plugin", "-c", "/dev/null", "--rootdir",
                        str(REPO), "--confcutdir", str(REPO), "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                        "--junitxml", str(junit), "-q"], cwd=REPO, capture_output=True, text=True,
                       env=child_env("numpy"), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    names = [c.get("name") for c in ET.parse(junit).getroot().iter("testcase")]
    return {n.partition("@")[0]: n.partition("@")[2] for n in names}


@skip_inside_nested_run
def test_a_format_s_model_bound_cases_share_a_group_and_unit_cases_are_free(tmp_path):
    got = _groups(tmp_path, str(REPO / "ladder" / "layer" / "test_layer.py"), str(REPO / "ladder" / "unit" / "test_ops.py"),
                  "--backend", "numpy", "-k", "(golden and layer0) or rmsnorm")
    layer = {n: g for n, g in got.items() if "golden" in n}  # ...[numpy-FORMAT-layer0-...]
    assert len(layer) == 4 and all(g == n.split("[numpy-")[1].split("-layer")[0] + "-numpy" for n, g in layer.items()), layer
    unit = {n: g for n, g in got.items() if "rmsnorm" in n}
    assert unit and not any(unit.values()), unit


@skip_inside_nested_run
def test_same_worker_keeps_a_weight_s_decode_and_prefill_cases_together(tmp_path):
    got = _groups(tmp_path, str(REPO / "ladder" / "unit" / "test_cuda_variants.py"), "--backend", "cuda",
                  "-k", "full_size")  # collected and skipped without a GPU: the groups are what is checked
    assert len(got) == 32
    for name, group in got.items():
        op_t = name.rsplit("-", 1)[0]  # ...[cuda-FORMAT-OP-T] -> ...[cuda-FORMAT-OP
        assert group == "test_full_size_linears_match_reference-" + op_t.split("[", 1)[1], (name, group)
    assert len(set(got.values())) == 16  # four formats x four ops, two cases each


def test_a_grouped_case_s_rerun_hint_names_the_case_pytest_can_find(monkeypatch):
    from ladder.compare import rerun_command

    case = "ladder/graph/test_graph.py::test_greedy_tokens_match_the_hf_simulation[heldout-000-numpy-int4_sym_g128]"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{case}@int4_sym_g128-numpy (call)")
    assert rerun_command() == f"python -m pytest '{case}'"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "ladder/unit/test_ops.py::test_x[a@b] (call)")  # an @ inside the id stays
    assert rerun_command() == "python -m pytest 'ladder/unit/test_ops.py::test_x[a@b]'"
