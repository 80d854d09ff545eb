"""Self-tests of `nanoqwen bench --quant`: the formats it takes, the torch reading of int4_sym_g128 its
float32 check uses (against reference/formats.py), and the table that puts the formats side by side.
The bench needs a GPU; these parts do not. bench/ is a leaf (ladder/selftest/arrows.py): its functions
run in a child interpreter, as `python -m bench...` runs them, never imported here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.formats import FORMATS

REPO = Path(__file__).resolve().parents[2]


def in_bench(code: str) -> str:
    """Run `code` in a child interpreter at the repository root, `decode_bench` imported; its stdout."""
    script = "from bench import decode_bench\n" + textwrap.dedent(code)
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_quant_takes_all_or_a_list_in_order_once_each_and_refuses_the_rest():
    """The bench's own parser: `--quant` is read by engine/cli.py `formats_arg`, as quant-report's is; a bad
    value is one line naming it, exit 2, before any GPU is asked for."""
    got = json.loads(in_bench("""
        import argparse, contextlib, io, json
        p = argparse.ArgumentParser(prog="nanoqwen bench")
        decode_bench.add_arguments(p)
        bad = {}
        for text in ("", "int3", "int4_sym_g128,,nope"):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    p.parse_args(["--quant", text])
                except SystemExit as e:
                    bad[text] = [e.code, err.getvalue().strip().splitlines()[-1]]
        print(json.dumps({"all": p.parse_args(["--quant", "all"]).quant, "bad": bad, "default": p.parse_args([]).quant,
                          "list": p.parse_args(["--quant", " int8_sym_channel,int4_sym_g128 ,int8_sym_channel"]).quant}))
    """))
    assert got["all"] == list(FORMATS)
    assert got["default"] == ["int4_sym_g128"]
    assert got["list"] == ["int8_sym_channel", "int4_sym_g128"]
    assert set(got["bad"]) == {"", "int3", "int4_sym_g128,,nope"}
    assert all(code == 2 for code, _ in got["bad"].values()), got["bad"]
    assert "unknown quantization format 'int3'" in got["bad"]["int3"][1]
    assert "an empty item in 'int4_sym_g128,,nope'" in got["bad"]["int4_sym_g128,,nope"][1]


def test_a_count_or_shape_out_of_range_is_one_line_and_exit_2_before_any_work():
    """The bench's own parser refuses what would fail late on the GPU or time nothing: an empty prompt, fewer
    than 4 new tokens (the protocol times the steps between tokens and drops two eager ones: a median of
    nothing is NaN), a negative seed, a shape it does not know; each in one line naming the argument."""
    got = json.loads(in_bench("""
        import argparse, contextlib, io, json
        p = argparse.ArgumentParser(prog="nanoqwen bench")
        decode_bench.add_arguments(p)
        out = {}
        for argv in (["--prompt-len", "0"], ["--prompt-len", "x"], ["--new-tokens", "3"], ["--seed", "-1"],
                     ["--shape", "qwen9"]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    p.parse_args(argv)
                except SystemExit as e:
                    out[" ".join(argv)] = [e.code, err.getvalue().strip().splitlines()[-1]]
        ok = p.parse_args(["--prompt-len", "1", "--new-tokens", "4", "--seed", "0", "--shape", "qwen2.5-coder-7b"])
        print(json.dumps({"bad": out, "ok": [ok.prompt_len, ok.new_tokens, ok.seed, ok.shape]}))
    """))
    bad = got["bad"]
    assert set(bad) == {"--prompt-len 0", "--prompt-len x", "--new-tokens 3", "--seed -1", "--shape qwen9"}
    assert all(code == 2 for code, _ in bad.values()), bad
    assert "argument --prompt-len: expected a prompt of at least 1 token, got 0" in bad["--prompt-len 0"][1]
    assert "got 'x'" in bad["--prompt-len x"][1]
    assert "argument --new-tokens: expected at least 4 new tokens, got 3" in bad["--new-tokens 3"][1]
    assert "argument --seed: expected a non-negative integer, got -1" in bad["--seed -1"][1]
    assert "argument --shape: unknown shape 'qwen9'; one of " in bad["--shape qwen9"][1]
    assert got["ok"] == [1, 4, 0, "qwen2.5-coder-7b"]


def test_before_set_gives_a_numeric_knob_its_type_and_restores_every_knob():
    """`--before-set att_blocks=528` must set the int 528 (the launcher does arithmetic with it) and
    `rmsnorm_held=off` the bool False (the text "off" would be true), an optional count that is None now
    (pages_per_split) an int or None, a text knob keeps the text, a table entry is set by key, everything
    is restored after the block, and a value that is not a number (or not on/off) for such a knob is
    refused with a line naming it, as are a table's unknown entry (a typo would change nothing) and a
    table named without its entry. A nested table takes its entry by both keys."""
    got = json.loads(in_bench("""
        import json, types
        be = types.SimpleNamespace(att_blocks=264, pdl="on", rmsnorm_held=True, pages_per_split=None,
                                   gemv_config={"int4_sym_g128": {"down_residual": "tc_w8_u4"}})
        spec = "att_blocks=528,pdl=off,rmsnorm_held=off,pages_per_split=2,gemv_config.int4_sym_g128.down_residual=x"
        with decode_bench.backend_settings(be, spec) as settings:
            inside = [be.att_blocks, type(be.att_blocks).__name__, be.pdl, be.rmsnorm_held, be.pages_per_split,
                      dict(be.gemv_config["int4_sym_g128"])]
        after = [be.att_blocks, be.pdl, be.rmsnorm_held, be.pages_per_split, be.gemv_config["int4_sym_g128"]]
        with decode_bench.backend_settings(be, "pages_per_split=None"):
            none_inside = be.pages_per_split
        refused = {}
        for bad in ("att_blocks=lots", "rmsnorm_held=maybe", "pages_per_split=few", "pages_per_split=-1",
                    "gemv_config.int4_sym_g128.down=x", "gemv_config.int3.down_residual=x",
                    "gemv_config.int4_sym_g128=x", "att_blocks.x=1"):
            try:
                with decode_bench.backend_settings(be, bad):
                    pass
            except SystemExit as e:
                refused[bad] = str(e)
        print(json.dumps({"inside": inside, "after": after, "settings": settings, "refused": refused,
                          "none_inside": none_inside, "restored": [be.att_blocks, be.rmsnorm_held, be.pages_per_split]}))
    """))
    assert got["inside"] == [528, "int", "off", False, 2, {"down_residual": "x"}]
    assert got["after"] == [264, "on", True, None, {"down_residual": "tc_w8_u4"}]
    assert got["none_inside"] is None
    assert got["settings"] == {"att_blocks": "528", "pdl": "off", "rmsnorm_held": "off", "pages_per_split": "2",
                               "gemv_config.int4_sym_g128.down_residual": "x"}
    assert got["refused"] == {
        "att_blocks=lots": "nanoqwen bench: --before-set att_blocks='lots': expected int",
        "rmsnorm_held=maybe": "nanoqwen bench: --before-set rmsnorm_held='maybe': expected on or off",
        "pages_per_split=few": "nanoqwen bench: --before-set pages_per_split='few': expected an integer >= 0 or none",
        "pages_per_split=-1": "nanoqwen bench: --before-set pages_per_split='-1': expected an integer >= 0 or none",
        "gemv_config.int4_sym_g128.down=x": "nanoqwen bench: --before-set gemv_config.int4_sym_g128.down: "
                                            "gemv_config.int4_sym_g128 has no entry 'down' (its keys: down_residual)",
        "gemv_config.int3.down_residual=x": "nanoqwen bench: --before-set gemv_config.int3.down_residual: "
                                            "gemv_config has no entry 'int3' (its keys: int4_sym_g128)",
        "gemv_config.int4_sym_g128=x": "nanoqwen bench: --before-set gemv_config.int4_sym_g128: a table; name one of "
                                       "its entries (down_residual)",
        "att_blocks.x=1": "nanoqwen bench: --before-set att_blocks.x: att_blocks has no entry 'x' (its keys: none: "
                          "not a table)"}
    assert got["restored"] == [264, True, None]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_benchs_torch_reading_of_every_format_is_the_references_to_the_bit(fmt):
    """The bench's float32 check dequantizes on the GPU in torch (bench/decode_bench.py torch_dequant);
    on the host here, the same code must give reference/formats.py's float32 weights bit for bit, on
    weights with every nibble, zero point and fp8 code in play."""
    pytest.importorskip("torch", reason="the bench's float32 check runs in torch")
    out = in_bench(f"""
        import numpy as np, torch
        from engine.formats import get_format
        from reference.formats import REF_DEQUANT
        rng = np.random.default_rng(3)
        w = (rng.standard_normal((24, 384)) * rng.uniform(0.01, 3, (24, 1))).astype(np.float32)
        w[:, :128] += 1.5  # a shifted group: the asymmetric format's zero points away from 8
        stored = get_format({fmt!r}).quantize(w)
        t = {{k: torch.from_numpy(v.view(np.int32) if v.dtype == np.uint32 else v) for k, v in stored.items()}}
        got = decode_bench.torch_dequant({fmt!r}, t)
        want = REF_DEQUANT[{fmt!r}](stored, np.float32)
        print(got.dtype, bool(np.array_equal(got.numpy(), want)), float(np.abs(want).max()), len(np.unique(want)))
    """)
    dtype, equal, peak, distinct = out.split()
    assert (dtype, equal) == ("torch.float32", "True") and float(peak) > 0 and int(distinct) > 30, out


def test_the_formats_table_gives_each_format_its_rate_per_byte_against_int4_sym():
    out = in_bench("""
        def row(b, ms):
            floor = b / 4.3e12 * 1e3
            return {"passed": True, "bytes_per_step": b, "floor_ms": floor,
                    "decode": {"ttft_ms": 20.0, "graph_ms_median": ms, "ratio_to_floor": ms / floor,
                               "achieved_tbs": b / (ms * 1e-3) / 1e12}}
        decode_bench.print_formats({"prompt_len": 512, "formats": {
            "int4_sym_g128": row(4.5e9, 2.5), "int8_sym_channel": row(8.1e9, 9.0), "fp8_e4m3_channel": {"passed": False}}})
        print("--")
        decode_bench.print_formats({"prompt_len": 512, "formats": {"int4_sym_g128": row(4.5e9, 2.5)}})
    """)
    table, alone = out.split("--\n")
    rows = {ln.split()[0]: ln.split() for ln in table.splitlines() if ln.split() and ln.split()[0] in FORMATS}
    assert set(rows) == {"int4_sym_g128", "int8_sym_channel"}  # a format that failed its checks has no times
    assert rows["int4_sym_g128"][-1] == "1.00"
    assert rows["int8_sym_channel"][-1] == f"{(8.1e9 / 9.0) / (4.5e9 / 2.5):.2f}" == "0.50"
    assert alone == ""  # one format: the main table says it all
