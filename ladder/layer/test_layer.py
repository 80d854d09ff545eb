"""Layer rung: one engine decoder block against transformers' Qwen2DecoderLayer (float32, same
dequantized weights), and against the golden activations the reference wrote.

Each case is a prefill of L tokens followed by decode steps across at least two page boundaries, with
a shuffled page table and NaN in every free page and unwritten slot. Compared: the block output at
every position, and the K/V gathered from the pages against the reference's own K (after RoPE) and V.
The floor is the error of the plain implementation (`reference.model.ref_block` in fp32 with the
precision contract's fp16 storage points) against the same reference: TOL[("layer", ...)].
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engine.config import SHAPES, Qwen2Config
from engine.formats import DEFAULT_FORMAT, get_format
from engine.modelfile import ModelFile
from fixtures.dequantized import LayerWeights
from fixtures.golden import GoldenError, load_golden
from fixtures.layer_cases import MODEL_CASES, SEVEN_B_CASES, LayerCase
from fixtures.tiny_model import random_weights
from ladder.checks.blockrun import run_engine_block
from ladder.checks.harness import host_threads
from ladder.checks.opcheck import first_op_over_its_bound, op_checks, recording
from ladder.compare import assert_close
from ladder.reference_store import kept_block, missing_library
from reference.model import ref_block

F16, F32 = np.float16, np.float32


class BlockUnderTest:
    """One model's weights, as the engine loads them (`get`) and as the reference sees them (`weights`)."""

    def __init__(self, config: Qwen2Config, quant: str, get, weights: dict, label: str):
        self.config, self.quant, self.get, self.weights, self.label = config, quant, get, weights, label
        self.hf_config = config.to_hf_dict()

    @classmethod
    def from_file(cls, path) -> "BlockUnderTest":
        """The model file's blocks, each dequantized for the reference when a case first reads it (three
        of a 7B model's 28 layers: 2.8 GB of float32, not 30)."""
        mf = ModelFile(path)
        weights = LayerWeights(path)
        return cls(Qwen2Config.from_hf_dict(weights.config), mf.quant, mf.expect, weights, path.name)

    @classmethod
    def synthetic(cls, config: Qwen2Config, seed: int, quant: str = DEFAULT_FORMAT) -> "BlockUnderTest":
        """Seeded random weights of any shape, quantized with `quant` (one layer)."""
        fmt = get_format(quant)
        config = config.replace(num_hidden_layers=1, vocab_size=128)  # the block alone: no 7B embedding to draw
        raw = {k: v for k, v in random_weights(config, seed).items() if k.startswith("model.layers.0.")}

        def store(name_w):  # (stored tensors, the reference's float32 weight) of one weight
            name, w = name_w
            if not name.endswith("proj.weight"):
                return {name: w.astype(F16)}, w.astype(F16).astype(F32)
            t = fmt.quantize(w)
            return {name[: -len(".weight")] + "." + k: v for k, v in t.items()}, fmt.dequantize(t)

        # The 7B shape's seven linears (233 M weights) are quantized side by side: NumPy releases the GIL in
        # its array work, and one after another they took most of the case (fp8: 6 s of 14 on an H200 host).
        big = sum(w.size for w in raw.values()) > 10_000_000
        with ThreadPoolExecutor(host_threads() if big else 1) as pool:
            made = list(pool.map(store, raw.items()))
        stored = {k: v for tensors, _ in made for k, v in tensors.items()}
        weights = {name: w for name, (_, w) in zip(raw, made)}
        return cls(config, quant, lambda name, dtype, shape: stored[name], weights, f"synthetic-{seed}")


def check_block(backend, block: BlockUnderTest, case: LayerCase, ref_out, ref_k, ref_v, against: str, ops: bool = True):
    """The block against the reference; with `ops`, also every op call inside it on its own activations
    against its `ref_*` with the unit rung's tolerance (ladder/checks/opcheck.py), so an op wrong by less than the
    block's fp16 noise (fp16 accumulation) is red here and a red block names its op. Without `ops` (the 7B
    shape, whose float64 op references take minutes on a host) the ops are checked only once the block
    is red, to name the op."""
    case = case.resolve(block.config.num_hidden_layers)
    x = case.inputs(block.config.hidden_size)
    with recording(backend) if ops else contextlib.nullcontext() as recorder:
        out, k, v = run_engine_block(backend, block.config, block.quant, block.get, case, shuffle_seed=case.seed)
    p_out, p_k, p_v = ref_block(block.hf_config, block.weights, case.layer, x, np.arange(case.total),
                                dtype=F32, storage=F16)
    label = f"{block.label} {case} vs {against}"
    try:
        assert_close("block_output", out, ref_out, p_out, backend=backend.name, case=label, seed=case.seed, tol_op="layer")
        assert_close("block_k_pages", k, ref_k, p_k.astype(F16), backend=backend.name, case=label, seed=case.seed,
                     tol_op="layer_kv")
        assert_close("block_v_pages", v, ref_v, p_v.astype(F16), backend=backend.name, case=label, seed=case.seed,
                     tol_op="layer_kv")
    except AssertionError as e:  # a red block: name the op inside it
        raise AssertionError(f"{e}\n{culprit(backend, block, case, recorder)}") from None
    if recorder:
        first = first_op_over_its_bound(op_checks(recorder.calls, block.config, block.weights, case.layer))
        if first is not None:
            pytest.fail(f"{label} on backend {backend.name!r}: the block is within its bound, but "
                        f"{_describe(first)}", pytrace=False)
    if backend.supports_graphs:  # the decode steps again, as one captured graph: equal to eager, bit for bit
        g_out, g_k, g_v = run_engine_block(backend, block.config, block.quant, block.get, case,
                                           shuffle_seed=case.seed, captured=True)
        for name, a, b in (("output", g_out, out), ("k", g_k, k), ("v", g_v, v)):
            assert np.array_equal(a, b, equal_nan=True), f"{label}: captured block {name} differs from eager"


def _describe(first) -> str:
    return (f"the first op over its bound inside the block is {first.name} (call {first.call}): max abs error "
            f"{first.max_abs:.4g} > bound {first.bound:.4g}, {first.multiple:.3g}x its floor")


def culprit(backend, block: BlockUnderTest, case: LayerCase, recorder=None) -> str:
    """Every op call of the block checked on its own activations (ladder/checks/opcheck.py; recorded again when
    the run was not): the first op over its bound, in call order, or that none is (then the error is in
    how they compose)."""
    if recorder is None:
        with recording(backend) as recorder:
            run_engine_block(backend, block.config, block.quant, block.get, case, shuffle_seed=case.seed)
    checks = op_checks(recorder.calls, block.config, block.weights, case.layer)
    first = first_op_over_its_bound(checks)
    if first is None:
        return f"inside the block, every one of its {len(checks)} op calls is within its own bound"
    return _describe(first)


@pytest.fixture(scope="session")
def model_block(model_path) -> BlockUnderTest:
    return BlockUnderTest.from_file(model_path)


@pytest.fixture(scope="session")
def hf_block():
    """transformers' Qwen2DecoderLayer on a block's weights and input: (output, k, v). Kept per machine
    (ladder/reference_store.py kept_block), so a run whose blocks are kept imports neither torch nor
    transformers; only their presence is checked here."""
    if missing_library():
        pytest.skip(f"the HF reference needs {missing_library()} (pip install -e '.[test]')")

    def outputs(config, weights, layer, x):
        def compute():
            from reference.hf import hf_block_outputs

            return hf_block_outputs(config, weights, layer, x)

        return kept_block(config, weights, layer, x, compute)

    return outputs


@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
def test_block_matches_hf_decoder_layer(backend, model_block, hf_block, case):
    c = case.resolve(model_block.config.num_hidden_layers)
    ref = hf_block(model_block.hf_config, model_block.weights, c.layer, c.inputs(model_block.config.hidden_size))
    check_block(backend, model_block, case, *ref, against="HF Qwen2DecoderLayer")


@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
def test_block_matches_golden_activations(backend, model_block, model_path, request, case):
    c = case.resolve(model_block.config.num_hidden_layers)
    try:  # a user's model gets its own, computed by the reference once and kept (fixtures/golden.py)
        golden = load_golden(model_path, c, keep=request.config.getoption("--model") is not None)
    except GoldenError as e:
        pytest.fail(str(e))  # the default model ships its golden files: missing or stale is a bug
    except ImportError as e:  # only a user's model's first run computes them
        pytest.skip(f"the golden activations of a user's model are computed by the HF reference, which needs "
                    f"{e.name} (pip install -e '.[test]')")
    assert np.array_equal(golden["x"], c.inputs(model_block.config.hidden_size)), "golden inputs differ from the case's"
    check_block(backend, model_block, case, golden["out"], golden["k"], golden["v"], against="golden activations")


# Shapes the default model does not have: the 7B head layout (GQA 7, head 128), a 14-head GQA-7 at
# head 64 (Qwen2.5-0.5B), and MHA (ratio 1).
SYNTHETIC = {
    "gqa7-d128": SHAPES["qwen2.5-coder-7b"].replace(hidden_size=896, intermediate_size=1024, num_attention_heads=7,
                                                    num_key_value_heads=1, vocab_size=128),
    "gqa7-d64": SHAPES["qwen2.5-0.5b"].replace(intermediate_size=512, vocab_size=128, tie_word_embeddings=False),
    "mha-d64": SHAPES["tiny"].replace(num_key_value_heads=4, vocab_size=128),
}


@pytest.mark.parametrize("shape", sorted(SYNTHETIC))
def test_block_at_other_head_layouts(backend, quant_name, hf_block, shape):
    block = BlockUnderTest.synthetic(SYNTHETIC[shape], seed=11, quant=quant_name)
    case = LayerCase(layer=0, L=15, steps=20, seed=5)  # decode crosses 16 and 32
    ref = hf_block(block.hf_config, block.weights, 0, case.inputs(block.config.hidden_size))
    check_block(backend, block, case, *ref, against="HF Qwen2DecoderLayer")


@pytest.mark.gpu
@pytest.mark.parametrize("case", SEVEN_B_CASES, ids=str)
def test_block_at_the_exact_7b_shape(backend, quant_name, hf_block, case):
    if not backend.needs_device:
        pytest.skip("the 7B-shape block is a GPU case (minutes on a CPU backend)")
    block = BlockUnderTest.synthetic(SHAPES["qwen2.5-coder-7b"], seed=7, quant=quant_name)
    ref = hf_block(block.hf_config, block.weights, 0, case.inputs(block.config.hidden_size))
    check_block(backend, block, case, *ref, against="HF Qwen2DecoderLayer", ops=False)
