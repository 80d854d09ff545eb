"""The layer rung's block check, reusable: one engine decoder block against a reference's output and K/V,
and, inside it, every op call on its own activations (ladder/checks/opcheck.py), so a red block names
its op. The layer rung's tests draw a case and call `check_block`; descend and the self-tests import it.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.config import Qwen2Config
from engine.formats import DEFAULT_FORMAT, get_format
from engine.modelfile import ModelFile
from fixtures.dequantized import LayerWeights
from fixtures.layer_cases import LayerCase
from fixtures.tiny_model import random_weights
from ladder.checks.blockrun import run_engine_block
from ladder.checks.harness import host_threads
from ladder.checks.opcheck import first_op_over_its_bound, op_checks, recording
from ladder.judges.compare import assert_close
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
    except AssertionError as e:  # a red block: name the op inside it (not under `nanoqwen mutate`: a kill is a kill)
        if os.environ.get("NANOQWEN_NAME_CULPRIT", "1") == "0":
            raise AssertionError(f"{e}\n(the op inside the block is not searched for: NANOQWEN_NAME_CULPRIT=0)") from None
        raise AssertionError(f"{e}\n{culprit(backend, block, case, recorder)}") from None
    if recorder:
        first = first_op_over_its_bound(op_checks(recorder.calls, block.config, block.weights, case.layer))
        if first is not None:
            raise AssertionError(f"{label} on backend {backend.name!r}: the block is within its bound, but "
                                 f"{_describe(first)}")
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
