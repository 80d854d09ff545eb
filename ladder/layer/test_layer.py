"""Layer rung: one engine decoder block against transformers' Qwen2DecoderLayer (float32, same
dequantized weights), and against the golden activations the reference wrote.

Each case is a prefill of L tokens followed by decode steps across at least two page boundaries, with
a shuffled page table and NaN in every free page and unwritten slot. Compared: the block output at
every position, and the K/V gathered from the pages against the reference's own K (after RoPE) and V.
The floor is the error of the plain implementation (`reference.model.ref_block` in fp32 with the
precision contract's fp16 storage points) against the same reference: TOL[("layer", ...)].
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import SHAPES
from fixtures.golden import GoldenError, load_golden
from fixtures.layer_cases import MODEL_CASES, SEVEN_B_CASES, LayerCase
from ladder.checks.block import BlockUnderTest, check_block, check_synthetic_block
from ladder.judges.reference_store import kept_block, missing_library


@pytest.fixture(scope="session")
def model_block(model_path) -> BlockUnderTest:
    return BlockUnderTest.from_file(model_path)


@pytest.fixture(scope="session")
def hf_block():
    """transformers' Qwen2DecoderLayer on a block's weights and input: (output, k, v). Kept per machine
    (ladder/judges/reference_store.py kept_block), so a run whose blocks are kept imports neither torch nor
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
    # the block's tensors and both references' outputs are kept per machine: a second run draws nothing
    check_synthetic_block(backend, SHAPES["qwen2.5-coder-7b"], 7, quant_name, case, hf_block, against="HF Qwen2DecoderLayer")
