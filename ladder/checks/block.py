"""The layer rung's block check, reusable: one engine decoder block against a reference's output and K/V,
and, inside it, every op call on its own activations (ladder/checks/opcheck.py), so a red block names
its op. The layer rung's tests draw a case and call `check_block`; descend and the self-tests import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Mapping
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
from ladder.judges.reference_store import kept_synthetic_block
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
        """Seeded random weights of any shape, quantized with `quant` (one layer); `stored` holds the
        engine's tensors by name."""
        fmt = get_format(quant)
        config = _alone(config)
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
        block = cls(config, quant, lambda name, dtype, shape: stored[name], weights, f"synthetic-{seed}")
        block.stored = stored
        return block


def _alone(config: Qwen2Config) -> Qwen2Config:
    return config.replace(num_hidden_layers=1, vocab_size=128)  # the block alone: no 7B embedding to draw


class _DrawnWhenRead(Mapping):
    """A kept synthetic block's float32 reference weights, drawn again only when something reads them (the
    op search inside a red block)."""

    def __init__(self, draw):
        self._draw, self._weights = draw, None

    def _all(self) -> dict:
        if self._weights is None:
            self._weights = self._draw()
        return self._weights

    def __getitem__(self, name):
        return self._all()[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self):
        return len(self._all())


def check_synthetic_block(backend, config: Qwen2Config, seed: int, quant: str, case: LayerCase, hf_outputs,
                          against: str) -> None:
    """check_block (without `ops`) on BlockUnderTest.synthetic(config, seed, quant), with the block's
    quantized tensors, the HF outputs (`hf_outputs(hf_config, weights, layer, x)`) and the plain forward's
    kept per machine (reference_store.kept_synthetic_block): a later run reads them back and runs only
    the engine. For a block too big to draw on every run (the 7B shape)."""
    case = case.resolve(1)
    x = case.inputs(config.hidden_size)
    recipe = [config.to_hf_dict(), seed, quant, dataclasses.asdict(case), hashlib.sha256(x.tobytes()).hexdigest()]
    made = {}

    def compute() -> dict:
        block = made["block"] = BlockUnderTest.synthetic(config, seed, quant)
        ref = hf_outputs(block.hf_config, block.weights, 0, x)
        plain = ref_block(block.hf_config, block.weights, 0, x, np.arange(case.total), dtype=F32, storage=F16)
        return {**{"tensor/" + k: v for k, v in block.stored.items()},
                **{f"ref/{n}": a for n, a in zip("okv", ref)}, **{f"plain/{n}": a for n, a in zip("okv", plain)}}

    kept = kept_synthetic_block(recipe, compute)
    block = made.get("block")
    if block is None:  # read back: the engine's tensors as kept, the reference's weights only if needed
        stored = {k[len("tensor/"):]: v for k, v in kept.items() if k.startswith("tensor/")}
        block = BlockUnderTest(_alone(config), quant, lambda name, dtype, shape: stored[name],
                               _DrawnWhenRead(lambda: BlockUnderTest.synthetic(config, seed, quant).weights),
                               f"synthetic-{seed}")
    ref = tuple(kept[f"ref/{n}"] for n in "okv")
    plain = tuple(kept[f"plain/{n}"] for n in "okv")
    check_block(backend, block, case, *ref, against=against, ops=False, plain=plain)


def check_block(backend, block: BlockUnderTest, case: LayerCase, ref_out, ref_k, ref_v, against: str, ops: bool = True,
                plain=None):
    """The block against the reference; with `ops`, also every op call inside it on its own activations
    against its `ref_*` with the unit rung's tolerance (ladder/checks/opcheck.py), so an op wrong by less than the
    block's fp16 noise (fp16 accumulation) is red here and a red block names its op. Without `ops` (the 7B
    shape, whose float64 op references take minutes on a host) the ops are checked only once the block
    is red, to name the op. `plain`: the plain forward's (output, k, v) when already computed (kept)."""
    case = case.resolve(block.config.num_hidden_layers)
    x = case.inputs(block.config.hidden_size)
    with recording(backend) if ops else contextlib.nullcontext() as recorder:
        out, k, v = run_engine_block(backend, block.config, block.quant, block.get, case, shuffle_seed=case.seed)
    if plain is None:
        plain = ref_block(block.hf_config, block.weights, case.layer, x, np.arange(case.total), dtype=F32, storage=F16)
    p_out, p_k, p_v = plain
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
