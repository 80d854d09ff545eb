"""Self-test of the shipped default model, the tiny coder (fixtures/tiny_coder.py).

The artifact is what was trained, nothing else: its manifest's checksums match the shipped weights and
held-out sources, every manifest field is present, the shape fits the issue's limits, the prompts file
is what `heldout_prompts` makes, and the model is sharp enough for the graph rung to judge (its logits
are far from flat, unlike the seeded random model's).

Retrain with `python fixtures/train_tiny_coder.py --device cuda --out fixtures/data/tiny_coder`, then
`python fixtures/eval_tiny_coder.py` (INT4 figures) and `python -m fixtures.tiny_coder` (prompts).
"""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

from engine.config import PAGE_SIZE
from engine.formats import FORMATS
from engine.weights import check_linears
from fixtures import tiny_coder
from ladder.judges.tolerances import NEAR_TIE_EPS

MAX_FOLDER_BYTES = 16_000_000  # issue 6: the shipped folder is at most 16 MB
MAX_PARAMETERS = 8_000_000  # issue 6: at most 8 M parameters
MARGIN_FACTOR = 4  # "well above" the near-tie epsilon: the median margin is at least this many epsilons
MIN_PAGE_PROMPTS = 20  # issue 6: at least 20 prompts on a page boundary or one off it

REQUIRED = {
    "": ["name", "description", "seed", "steps", "steps_run", "selected_step", "training", "model",
         "tokenizer", "weights", "data", "heldout", "quantization", "versions"],
    "training": ["batch", "seq_len", "lr", "tokens_seen", "device", "curve", "command"],
    "model": ["architecture", "parameters", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads"],
    "tokenizer": ["eos_token", "eos_token_id", "entries", "sha256"],
    "weights": ["file", "dtype", "sha256", "bytes"],
    "data": ["source", "python_version", "train", "validation", "heldout", "heldout_sources", "train_tokens"],
    "heldout": ["loss", "perplexity", "tokens", "window"],
    "quantization": ["format", "window", "tokens", "fp16", "int4_hf_simulation", "int4_engine",
                     "top1_agreement_int4_engine_vs_fp16"],
    "versions": ["python", "torch", "transformers", "tokenizers", "safetensors", "numpy"],
}


@pytest.fixture(scope="module")
def manifest():
    return tiny_coder.manifest()


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_weights_checksum_matches_manifest(manifest):
    folder = tiny_coder.trained_model_dir()
    assert sha256(folder / manifest["weights"]["file"]) == manifest["weights"]["sha256"], (
        "model.safetensors differs from the manifest's checksum: retrain or restore the shipped weights")
    assert (folder / "model.safetensors").stat().st_size == manifest["weights"]["bytes"]
    assert sha256(folder / "tokenizer.json") == manifest["tokenizer"]["sha256"]
    assert sha256(folder / "heldout_sources.json") == manifest["data"]["heldout_sources"]["sha256"]


@pytest.mark.parametrize("section", list(REQUIRED))
def test_manifest_fields_present(manifest, section):
    block = manifest if not section else manifest[section]
    missing = [k for k in REQUIRED[section] if k not in block]
    assert not missing, f"manifest.json section {section or '(top)'!r} lacks {missing}"


def test_manifest_lists_every_file_with_sha256(manifest):
    data = manifest["data"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", data["python_version"])
    for split in ("train", "validation", "heldout"):
        assert data[split], f"no {split} files listed"
        for entry in data[split]:
            assert entry["path"].startswith("Lib/") and entry["path"].endswith(".py"), entry
            assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]), entry
    paths = [[e["path"] for e in data[s]] for s in ("train", "validation", "heldout")]
    assert not set(paths[2]) & (set(paths[0]) | set(paths[1])), "a held-out file was trained on"
    # the shipped held-out text is the listed files, byte for byte
    assert sorted(tiny_coder.heldout_sources()) == sorted(paths[2])


def test_quantization_figures_are_sane(manifest):
    q = manifest["quantization"]
    for key in ("fp16", "int4_hf_simulation", "int4_engine"):
        assert np.isclose(np.exp(q[key]["loss"]), q[key]["perplexity"], rtol=1e-3), key
    assert 0.0 <= q["top1_agreement_int4_engine_vs_fp16"] <= 1.0


def test_shape_fits_the_issue(manifest):
    cfg = tiny_coder.config()
    folder = tiny_coder.trained_model_dir()
    assert sum(p.stat().st_size for p in folder.iterdir()) <= MAX_FOLDER_BYTES
    assert manifest["model"]["parameters"] <= MAX_PARAMETERS
    for name in FORMATS:  # the default model runs the ladder in every format
        check_linears(cfg, name)
    assert cfg.vocab_size % 128 == 0
    assert cfg.num_key_value_heads < cfg.num_attention_heads, "the default model must exercise GQA"
    assert cfg.eos_token_id == manifest["tokenizer"]["eos_token_id"]


def test_prompts_file_is_what_heldout_prompts_makes():
    lines = tiny_coder.PROMPTS_FILE.read_text(encoding="utf-8").splitlines()
    shipped = [json.loads(line) for line in lines if line.strip()]
    assert shipped == tiny_coder.heldout_prompts(len(shipped)), (
        "fixtures/data/prompts.jsonl is stale: regenerate it with `python -m fixtures.tiny_coder`")
    lengths = [p["length"] for p in shipped]
    assert len(shipped) == 100 and min(lengths) == 1
    assert sum(1 for n in lengths if n >= PAGE_SIZE - 1 and n % PAGE_SIZE in (PAGE_SIZE - 1, 0, 1)) >= MIN_PAGE_PROMPTS
    sources = tiny_coder.heldout_token_ids()
    for p in shipped:
        assert len(p["ids"]) == p["length"]
        assert sources[p["source"]][p["start"]: p["start"] + p["length"]] == p["ids"], p["id"]


def test_logits_are_sharp_enough_to_judge():
    """Median top-1/top-2 logit margin over prompt ends and a few greedy steps: many near-tie epsilons."""
    import engine

    model = engine.load(tiny_coder.trained_model_file(), backend="numpy")
    prompts = tiny_coder.heldout_prompts(100)[:6]
    margins = []
    for p in prompts:
        seq = model.new_sequence()
        try:
            logits = model.prefill(seq, p["ids"])
            for _ in range(6):
                top2 = np.sort(logits)[-2:]
                margins.append(float(top2[1] - top2[0]))
                logits = model.decode_step(seq, int(np.argmax(logits)))
        finally:
            seq.free()
    margins = np.array(margins)
    assert np.median(margins) > MARGIN_FACTOR * NEAR_TIE_EPS, f"median margin {np.median(margins):.4f}"
