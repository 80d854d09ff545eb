"""Self-tests of fixtures/dequantized.py: the references' float32 weights, whole or a layer at a time."""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.dequantized import LayerWeights, dequantized_weights
from fixtures.tiny_model import random_model_file


@pytest.fixture(scope="module")
def path():
    return random_model_file()


def test_the_threaded_reading_is_the_one_threads(path):
    config, one = dequantized_weights(path)
    _, threaded = dequantized_weights(path, device="cpu")
    assert list(one) == list(threaded) and all(np.array_equal(one[k], threaded[k]) for k in one)


def test_layer_weights_hold_the_same_values_and_read_only_the_layers_asked_for(path):
    _, whole = dequantized_weights(path)
    lazy = LayerWeights(path)
    assert list(lazy) == list(whole) and len(lazy) == len(whole)
    assert np.array_equal(lazy["model.layers.1.mlp.down_proj.weight"], whole["model.layers.1.mlp.down_proj.weight"])
    assert {n.split(".")[2] for n in lazy._loaded} == {"1"}  # one layer read, not the model
    with pytest.raises(KeyError):
        lazy["model.layers.1.nope"]


def test_the_layer_rungs_block_check_reads_only_its_layer(path):
    """A 7B model's float32 weights are 30 GB: a layer case must dequantize its own block alone (an op
    check that iterated the mapping's items once read every layer)."""
    from fixtures.layer_cases import LayerCase
    from kernels import get_backend
    from ladder.checks.block import BlockUnderTest, check_block
    from reference.model import ref_block

    block = BlockUnderTest.from_file(path)
    case = LayerCase(layer=1, L=5, steps=12, seed=3)
    x = case.inputs(block.config.hidden_size)
    ref = ref_block(block.hf_config, block.weights, 1, x, np.arange(case.total))
    check_block(get_backend("numpy"), block, case, ref[0], ref[1], ref[2], against="float64 ref_block")
    assert {n.split(".")[2] for n in block.weights._loaded} == {"1"}
