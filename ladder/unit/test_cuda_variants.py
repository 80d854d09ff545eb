"""Unit rung: every shipped kernel variant and tile edge of the quantized linears, against reference/.

- Every GEMV variant of every format's CUDA launcher (`VARIANTS` of kernels/cuda/<format>.py, read
  through kernels/cuda/catalog.py) for each of the four quantized ops, at T = 1 (the GEMV path), on
  row counts below, on and one past each variant's rows per block, and on inputs of 1, 2, 5 and 37
  128-groups (one group, a partial load batch, several batches); a format that reads rows in 16-byte
  chunks of 16 weights also on 1, 3, 129 and 257 chunks (one chunk, fewer chunks than threads, one past
  128 and 256 threads' worth); and on the variant's own edges, derived from its constants in the catalog
  (`gemv_edges`: inputs short of, on and past one and two strides of its loop, rows short of, on and past
  its rows per block), and Hypothesis draws more inside those strata (fixtures/strategies.py
  `edge_strata`; the nightly profile draws fifteen times as many). The cases are the pairs (format,
  variant) of the formats `--quant` selects. A backend without a `gemv_config` (one GEMV per op,
  nothing to pick) skips them with that reason.
- The prefill path (T above `gemv_max_tokens`) at its tile edges: T and rows on, below and past the
  64 x 128 tensor-core tile; the wgmma kernel also at its ring's depth (WG_STAGES groups, twice that),
  its consumer warpgroups' 64 rows, weight tiles past a group of its launch order, and spread over fewer
  blocks than tiles (tiles cut between two blocks; bit for bit one block a tile, and at the 7B qkv shape).
- The Qwen2.5-Coder-7B shapes of the four ops (decode and a 64-token prefill); every prefill attention
  kernel (wgmma, tensor cores, warp, block) at its tile and page edges; every decode attention kernel (the
  tensor-core one; the same in a thread block cluster that merges its splits; the warp-per-page one;
  paged_attention_f16) with fixed and dynamic split sizes (one page per split: splits past the length are
  empty; more used pages than splits; a page table far longer than the keys; more splits than the combine
  kernel has threads) and on every page edge, decode and prefill; the cluster's merge on, at and past its
  edge (its most pages), launched three times in a row; head layouts the tensor-core and warp kernels do
  not hold going to paged_attention_f16 (a head_dim of 256: the combine's second pass over the columns);
  rmsnorm reading rows of a larger buffer, and on both sides of the row length it holds in
  registers (RMS_HELD elements a thread; longer rows take its loop), for the decode step's one row and a
  prefill's rows; the residual ops fused with the rmsnorm after them on the prefill path, on both sides of
  that row length, bit for bit as their two ops, and run as their one kernel under the rungs' call
  counter; RoPE and the KV write on prefills long enough that a token gets fewer blocks; the captured
  decode graph following a wrapped op and its unwrapping, kept across turning it off and on, and captured
  again for a changed backend setting.

The comparisons are the unit rung's op checks (ladder/checks/ops.py): `check_*` against `reference.ops`
with TOL.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.formats import get_format
from fixtures.cases import PAGE, PAGE_BOUNDARY_LENGTHS, PagedCase, quantizable_weight, rng_for
from fixtures.strategies import edge_strata
from kernels import FUSED_OPS
from ladder.plugin import selected_formats
from ladder.changes.sources import cuda_module
from ladder.checks.edges import gemv_edges
from ladder.checks.harness import quantized
from ladder.checks.ops import check_attention, check_linear, check_rmsnorm, check_rope_kv_write, quantized_and_read

# kernels/cuda/catalog.py's launchers (format -> variants, default config), read by file path: the package
# kernels.cuda imports CuPy, and the cases are collected (and skip with a reason) where CuPy is missing
CATALOG = cuda_module("catalog")
LAUNCHERS = CATALOG.launchers()
LINEAR_OPS = ("qkv_proj", "o_proj_residual", "gate_up_silu", "down_residual")
GROUPS = (1, 2, 5, 37)  # input features in 128-groups: one, two, a partial batch, several batches
CHUNKS = (1, 3, 129, 257)  # input features in 16-weight chunks, for formats read 16 weights at a time
ROWS = (5, 8, 13, 16, 17, 72, 136)  # output rows: under, on and past 4, 8 and 16 rows per block
SILU_ROWS = (3, 4, 5, 8, 9, 17, 40)  # gate/up blocks own half as many output rows


def pytest_generate_tests(metafunc):
    """`format_variant`: every (format, GEMV variant) its CUDA launcher ships, for the --quant formats."""
    if "format_variant" in metafunc.fixturenames:
        pairs = [(f, v) for f in selected_formats(metafunc.config) for v in LAUNCHERS.get(f, {}).get("variants", ())]
        metafunc.parametrize("format_variant", pairs, ids=[f"{f}-{v}" for f, v in pairs])


def _in_features(fmt) -> list[int]:
    """The input sizes a GEMV variant is checked on: group edges, and chunk edges for a 16-weight load."""
    sizes = {128 * g for g in GROUPS}
    if fmt.in_multiple < 128:
        sizes |= {fmt.in_multiple * c for c in CHUNKS}
    return sorted(sizes)


def _tiling(fmt, variant: str, silu: bool) -> tuple[int, int, int]:
    """A variant's tiling constants from the catalog: its loop stride (`loop_stride`: threads x the inputs
    of a 16-byte load, or warps x groups per batch x 128), its rows per block (`variant_geometry`), and
    the format's input multiple."""
    return (CATALOG.loop_stride(variant, LAUNCHERS[fmt.name]["chunk_inputs"]),
            CATALOG.variant_geometry(variant, silu)[1], fmt.in_multiple)


@contextlib.contextmanager
def _gemv_variant(backend, name: str, op: str, variant: str):
    """`op` of format `name` runs GEMV `variant` inside the block; the backend's choice is restored after."""
    config = backend.gemv_config[name]
    saved = config[op]
    config[op] = variant
    try:
        yield
    finally:
        config[op] = saved


@pytest.mark.parametrize("op", LINEAR_OPS)
def test_gemv_variant_matches_reference_at_every_tile_edge(backend, format_variant, op):
    name, variant = format_variant
    if not hasattr(backend, "gemv_config"):
        pytest.skip("the backend has no gemv_config: GEMV variants belong to a backend that picks one per op")
    assert name in backend.gemv_config, f"backend {backend.name} has no GEMV config for format {name}"
    assert backend.gemv_max_tokens >= 1, "T = 1 must take the GEMV path"
    fmt = get_format(name)
    with _gemv_variant(backend, name, op, variant):
        for in_f in _in_features(fmt):
            for rows in SILU_ROWS if op == "gate_up_silu" else ROWS:
                check_linear(backend, fmt, op, 1, in_f, rows, seed=in_f * 1000 + rows, case=f",variant={variant}")
        # the variant's own edges (ladder/checks/edges.py), from its tiling constants
        for in_f, rows in gemv_edges(*_tiling(fmt, variant, op == "gate_up_silu")):
            check_linear(backend, fmt, op, 1, in_f, rows, seed=in_f * 1000 + rows, case=f",variant={variant},edge")


# A tenth of the profile's examples per (format, variant, op): 2 in the ci profile, 30 in the nightly.
@pytest.mark.parametrize("op", LINEAR_OPS)
@settings(max_examples=max(2, settings().max_examples // 10))
@given(data=st.data())
def test_gemv_variant_matches_reference_inside_its_edge_strata(backend, format_variant, op, data):
    """Shapes drawn inside the strata whose boundaries `gemv_edges` checks: a few loop strides and block
    counts, each just short of, on, just past or anywhere between its edges."""
    name, variant = format_variant
    if not hasattr(backend, "gemv_config"):
        pytest.skip("the backend has no gemv_config: GEMV variants belong to a backend that picks one per op")
    fmt = get_format(name)
    in_f, rows = data.draw(edge_strata(*_tiling(fmt, variant, op == "gate_up_silu")), label="inputs, rows")
    with _gemv_variant(backend, name, op, variant):
        check_linear(backend, fmt, op, 1, in_f, rows, seed=in_f * 1000 + rows, case=f",variant={variant},drawn")


def _prefill_kernels(backend, fmt) -> tuple:
    """The prefill kernels the format's launcher lists (catalog.py); (None,) where the backend has no
    choice (one kernel per format: its only path)."""
    if getattr(backend, "prefill_variant", None) is None:
        return (None,)
    return LAUNCHERS.get(fmt.name, {}).get("prefill_variants") or (None,)


@contextlib.contextmanager
def _prefill_kernel(backend, fmt, variant):
    """The backend's prefill kernel for `fmt` set to `variant` for the block (None: left alone), restored
    after, also when a check inside fails (a failed case must not leave its kernel to the next)."""
    if variant is None:
        yield
        return
    chosen = backend.prefill_variant
    saved = chosen.get(fmt.name)
    chosen[fmt.name] = variant
    try:
        yield
    finally:
        chosen[fmt.name] = saved


@pytest.mark.parametrize("op", LINEAR_OPS)
def test_prefill_path_matches_reference_at_every_tile_edge(backend, quant_format, op):
    """Every prefill kernel of the format, T and rows on, below and past its tiles (64 x 128 and 128 x
    128), inputs of one, three and five groups (a pipeline deeper than the K steps, and wrapping it)."""
    gemv_max = getattr(backend, "gemv_max_tokens", 1)
    for variant in _prefill_kernels(backend, quant_format):
        with _prefill_kernel(backend, quant_format, variant):
            for T in (2, 63, 64, 65, 127, 128, 130):
                if T <= gemv_max:
                    continue
                for in_f in (128, 384, 640) + ((3 * quant_format.in_multiple,) if quant_format.in_multiple < 128 else ()):
                    for rows in ((7, 64, 65, 129) if op == "gate_up_silu" else (8, 127, 128, 129, 257)):
                        check_linear(backend, quant_format, op, T, in_f, rows, seed=T * 1000 + rows,
                                      case=f",prefill{'=' + variant if variant else ''}")


def test_every_prefill_kernel_at_the_7b_depth_of_inputs(backend, quant_format):
    """Every prefill kernel over the 7B shape's deepest input, down_proj's 18,944 (148 groups: past the
    127 where a pipelined kernel's group counter or ring index could wrap), on a few rows so the float64
    reference stays cheap; 65 tokens, one past a 64-token tile. The other cases' inputs stop at five groups,
    and the full-size cases take the default kernel only."""
    in_f = 18944
    for variant in _prefill_kernels(backend, quant_format):
        with _prefill_kernel(backend, quant_format, variant):
            check_linear(backend, quant_format, "down_residual", 65, in_f, 129, seed=in_f,
                         case=f",7B depth{',prefill=' + variant if variant else ''}")


EW_GRID_CAP = 65535 * 256  # the element-wise epilogues' most threads (kernels/cuda/__init__.py _blocks)


def test_the_residual_epilogue_past_its_grid_cap(backend, quant_format):
    """down_residual on the prefill path at 4,100 tokens x 4,096 rows (16,793,600 elements): past the
    element-wise epilogue's grid, 65,535 blocks of 256 threads (16,776,960), so epi_residual_f32's
    grid-stride loop takes a second pass over the last 16,640 elements. In the engine only the 8192-token
    prefill's last down_residual (29 M elements) reaches that pass; the other cases end in the first."""
    if not backend.needs_device:
        pytest.skip("a host backend's residual add has no grid (the capped one is kernels/cuda/epilogues.cu's)")
    T, rows = 4100, 4096
    assert EW_GRID_CAP < T * rows < 2 * EW_GRID_CAP
    check_linear(backend, quant_format, "down_residual", T, 128, rows, seed=T, case=",past the epilogue's grid")


WGMMA = CATALOG.defines("int4_wgmma.cuh")  # the wgmma kernel's tiling and ring, read from its source


def test_the_wgmma_prefill_at_its_ring_and_warpgroup_edges(backend, quant_format):
    """The wgmma kernel (int4_wgmma.cuh) where its own structure has edges the shared tile-edge case does not
    reach: inputs of exactly WG_STAGES groups and of twice that (the producer's ring filled once, and
    wrapped to the same stage), one group past it; rows on and one past a consumer warpgroup's 64 and a
    tile and a half; tokens one past a tile and on and past two."""
    if "wgmma" not in _prefill_kernels(backend, quant_format):
        pytest.skip(f"{quant_format.name} has no wgmma prefill kernel on this backend")
    stages, bm, half = WGMMA["WG_STAGES"], WGMMA["WG_BM"], WGMMA["WG_BN"] // 2
    with _prefill_kernel(backend, quant_format, "wgmma"):
        for groups in (stages, stages + 1, 2 * stages):
            for T in (bm + 1, 2 * bm, 2 * bm + 1):
                for rows in (half, half + 1, 3 * half):
                    check_linear(backend, quant_format, "o_proj_residual", T, 128 * groups, rows,
                                 seed=groups * 10000 + T * 10 + rows, case=f",wgmma,{groups} groups")


def test_the_wgmma_prefill_covers_every_tile_of_its_grouped_launch_order(backend, quant_format):
    """Past WG_GROUP_N token tiles the wgmma kernel takes its tile from a grouped launch order (WG_GROUP_N
    weight tiles by every token tile, then the next group): one token tile past the group, the last one
    partial, by weight tiles one and two past a whole group (a short last group), so a wrong tile map leaves
    rows or tokens unwritten or written twice."""
    if "wgmma" not in _prefill_kernels(backend, quant_format):
        pytest.skip(f"{quant_format.name} has no wgmma prefill kernel on this backend")
    bm, bn, group = WGMMA["WG_BM"], WGMMA["WG_BN"], WGMMA["WG_GROUP_N"]
    with _prefill_kernel(backend, quant_format, "wgmma"):
        for rows in ((group + 1) * bn, (group + 1) * bn + 1):
            check_linear(backend, quant_format, "o_proj_residual", group * bm + 1, 256, rows, seed=rows,
                         case=f",wgmma,{group + 1} x {-(-rows // bn)} tiles")


# The wgmma kernel spread over fewer blocks than tiles (int4_wgmma.cuh, kernels/cuda/linear.py
# wgmma_spread_blocks): (token tiles' T, rows, groups, blocks), each where the launcher spreads. 4 tiles of 3
# groups on 3 blocks: a head and a tail of one group, a block with no whole tile; 5 tiles of one group: no
# tile cut; 7 tiles of 2 WG_STAGES + 1 groups on 5 blocks: the ring wraps inside and across segments; 3 x 3
# partial tiles (T and rows one past whole tiles) of 5 groups on 4 blocks.
SPREAD_CASES = ((128, 512, 3, 3), (128, 640, 1, 3), (128, 896, 2 * WGMMA["WG_STAGES"] + 1, 5), (257, 321, 5, 4))


def _spread_or_tiled(backend, qw, x, T, rows, blocks):
    """down_residual's fp32 sum from a zero residual (0 + y: the GEMM's bits) with the wgmma kernel spread
    over `blocks` (0: one block a tile)."""
    out = backend.asarray(np.zeros((T, rows), np.float32))
    with _backend_setting(backend, wgmma_spread_blocks=blocks):
        backend.down_residual(x, qw, out)
    return backend.to_numpy(out).view(np.uint32)


@pytest.mark.parametrize("T, rows, groups, blocks", SPREAD_CASES)
def test_the_wgmma_prefill_spread_over_fewer_blocks_gives_the_bits_of_one_block_a_tile(backend, quant_format, T, rows,
                                                                                       groups, blocks):
    """The spread launch: each block takes an equal share of the tiles' groups, so a tile may be cut between
    two blocks, the second continuing from the first one's fp32 totals (left in a carry slot, a flag set
    once they are there). Against the reference, and bit for bit against one block a tile, called twice
    (each launch must leave the flags as it found them: a second call reading a stale flag would not wait
    for its carry)."""
    if "wgmma" not in _prefill_kernels(backend, quant_format):
        pytest.skip(f"{quant_format.name} has no wgmma prefill kernel on this backend")
    from kernels.cuda.linear import wgmma_spread_blocks

    assert wgmma_spread_blocks(T, rows, blocks) == blocks, f"the launcher would not spread {T} x {rows} on {blocks}"
    rng = rng_for(T * rows + groups)
    qw, _ = quantized_and_read(backend, quant_format, quantizable_weight(rng, rows, 128 * groups))
    with _prefill_kernel(backend, quant_format, "wgmma"):
        with _backend_setting(backend, wgmma_spread_blocks=blocks):
            check_linear(backend, quant_format, "o_proj_residual", T, 128 * groups, rows, seed=T + rows + groups,
                         case=f",wgmma spread on {blocks} blocks")
        for call in (1, 2):
            x = backend.asarray(rng.standard_normal((T, 128 * groups)).astype(np.float16))
            spread, tiled = (_spread_or_tiled(backend, qw, x, T, rows, b) for b in (blocks, 0))
            assert np.array_equal(spread, tiled), (
                f"{quant_format.name}: spread on {blocks} blocks differs from one block a tile "
                f"(T={T}, rows={rows}, {groups} groups, call {call}) at {np.argwhere(spread != tiled)[:4].tolist()}")


def test_the_wgmma_prefill_spread_at_the_7b_qkv_shape_gives_the_bits_of_one_block_a_tile(backend, quant_format):
    """qkv_proj's GEMM at the 7B shape and 512 tokens, the case the spread launch is for (144 tiles: on an
    H200's 132 SMs, one block a tile runs a second wave of 12), spread over the backend's own block count,
    bit for bit against one block a tile."""
    if "wgmma" not in _prefill_kernels(backend, quant_format):
        pytest.skip(f"{quant_format.name} has no wgmma prefill kernel on this backend")
    from kernels.cuda.linear import wgmma_spread_blocks

    T, rows, in_f = 512, 4608, 3584
    blocks = backend.wgmma_spread_blocks
    if not wgmma_spread_blocks(T, rows, blocks):
        pytest.skip(f"{blocks} blocks do not spread 512 x 4608 (one block a tile is as good on this device)")
    rng = rng_for(4608)
    qw, _ = quantized(backend, quant_format, quantizable_weight(rng, rows, in_f, scale=0.05))
    x = backend.asarray(rng.standard_normal((T, in_f)).astype(np.float16))
    with _prefill_kernel(backend, quant_format, "wgmma"):
        spread, tiled = (_spread_or_tiled(backend, qw, x, T, rows, b) for b in (blocks, 0))
    assert np.array_equal(spread, tiled), (
        f"{quant_format.name}: the 7B qkv GEMM spread on {blocks} blocks differs from one block a tile "
        f"at {np.argwhere(spread != tiled)[:4].tolist()}")


_FULL_SIZE: dict = {}  # (backend, format, op) -> (backend weight, reference weight): the last one made


def _full_size_weights(backend, fmt, op, in_f, rows):
    """A 7B-shape weight and its float64 reading, made once for the decode and the prefill case (drawing,
    quantizing and reading 135 M weights is most of such a case's time); one kept at a time (1 GB)."""
    key = (backend.name, fmt.name, op)
    if key not in _FULL_SIZE:
        _FULL_SIZE.clear()
        rng = rng_for(100 + LINEAR_OPS.index(op))
        w = quantizable_weight(rng, 2 * rows if op == "gate_up_silu" else rows, in_f, scale=0.1 if op == "gate_up_silu" else 0.05)
        # quantized and read by row blocks side by side: the same tensors and values as one call, in a
        # fraction of the time (fp8's gate_up: 135 M weights)
        _FULL_SIZE[key] = quantized_and_read(backend, fmt, w, by_rows=True)
    return _FULL_SIZE[key]


@pytest.mark.long
@pytest.mark.same_worker("backend_name", "quant_name", "op")  # decode and prefill: one weight, one worker
@pytest.mark.parametrize("T", (1, 64))  # T varies fastest: a format's two cases of an op run one after the other
@pytest.mark.parametrize("op", LINEAR_OPS)
def test_full_size_linears_match_reference(backend, quant_format, op, T):
    if not hasattr(backend, "gemv_config"):
        pytest.skip("full-size (7B) shapes run where GEMV variants are tuned; a float64 reference of them is slow on CPU")
    H, I, qkv = 3584, 18944, (28 + 2 * 4) * 128
    in_f, rows = {"qkv_proj": (H, qkv), "o_proj_residual": (28 * 128, H), "gate_up_silu": (H, I), "down_residual": (I, H)}[op]
    check_linear(backend, quant_format, op, T, in_f, rows, seed=T, case=",7B",
                  weights=_full_size_weights(backend, quant_format, op, in_f, rows))


# the attention variants the backend ships (kernels/cuda/catalog.py, read without CuPy): every one is checked
ATTENTION_VARIANTS, ATTENTION_PREFILL_VARIANTS = CATALOG.ATTENTION_VARIANTS, CATALOG.ATTENTION_PREFILL_VARIANTS


@contextlib.contextmanager
def _backend_setting(backend, **values):
    """The backend's knobs set for the block, restored after; skips on a backend without them."""
    missing = [k for k in values if not hasattr(backend, k)]
    if missing:
        pytest.skip(f"the backend has no {', '.join(missing)}: nothing to choose there")
    saved = {k: getattr(backend, k) for k in values}
    for k, v in values.items():
        setattr(backend, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(backend, k, v)


RMS = CATALOG.defines("rmsnorm.cu")  # rmsnorm's block and the row it holds in registers, read from its source


def test_the_prefill_rmsnorm_fold_gives_the_bits_of_its_two_ops(backend, quant_format):
    """The fused residual ops on the prefill path (`rmsnorm_fold`: the GEMM, then one kernel adding into the
    residual and normalising) against the reference, and bit for bit against the two ops they replace,
    on rows held in registers (RMS_HELD x RMS_THREADS) and one group past them (the loop), at 2 tokens and
    65 (one past a 64-token tile)."""
    if not hasattr(backend, "rmsnorm_fold"):
        pytest.skip("the backend has no rmsnorm_fold: its fused ops are their two ops")
    held = RMS["RMS_HELD"] * RMS["RMS_THREADS"]
    rng = rng_for(7)
    for rows in (held, held + 128):
        qw, _ = quantized_and_read(backend, quant_format, quantizable_weight(rng, rows, 256))
        norm_w = backend.asarray((1 + 0.1 * rng.standard_normal(rows)).astype(np.float16))
        for T in (2, 65):
            for op in FUSED_OPS:
                check_linear(backend, quant_format, op, T, 256, rows, seed=rows + T, case=",prefill fold")
            x = backend.asarray(rng.standard_normal((T, 256)).astype(np.float16))
            start = rng.standard_normal((T, rows)).astype(np.float32) * 4
            got = {}
            for fold in (True, False):
                with _backend_setting(backend, rmsnorm_fold=fold):
                    resid, out = backend.asarray(start.copy()), backend.asarray(np.zeros((T, rows), np.float16))
                    backend.down_residual_rmsnorm(x, qw, resid, norm_w, 1e-6, out)
                    got[fold] = (backend.to_numpy(resid), backend.to_numpy(out))
            for name, a, b in zip(("residual", "norm"), got[True], got[False]):
                assert np.array_equal(a.view(np.uint32 if a.dtype == np.float32 else np.uint16),
                                      b.view(np.uint32 if b.dtype == np.float32 else np.uint16)), (
                    f"{quant_format.name}: the fold's {name} differs from the two ops' at T={T}, rows={rows}")


@contextlib.contextmanager
def _kernels_launched():
    """The names of the kernels launched inside the block (filled when it ends), the launches also handed on
    to the observer that was set (the launch map's recording, when the rung records one): watching here hides
    nothing from it."""
    from kernels.base import launch_observer, observe_launches

    onward = launch_observer()
    tee = _LaunchTee(onward)
    names: set[str] = set()
    observe_launches(tee)
    try:
        yield names
    finally:
        observe_launches(onward)
        names.update(u.split("::")[-1] for u in tee)


class _LaunchTee(set):
    """A set of launch units that also hands each on to `onward` (_kernels_launched)."""

    def __init__(self, onward):
        super().__init__()
        self.onward = onward

    def add(self, unit):
        super().add(unit)
        if self.onward is not None:
            self.onward.add(unit)


def test_the_rungs_backend_runs_the_fused_prefill_kernel(backend, quant_format):
    """The rungs' backend object carries the ladder's call counter on every op (ladder/plugin/instrument.py),
    which only observes: under it a fused op must still run as its one kernel, or no rung would check that
    kernel (the nightly's mutants of it survived when the counter forced the parts). With `rmsnorm_fold`
    off the same call runs the two ops' kernels."""
    if not hasattr(backend, "rmsnorm_fold"):
        pytest.skip("the backend has no rmsnorm_fold: its fused ops are their two ops")
    rng = rng_for(11)
    qw, _ = quantized_and_read(backend, quant_format, quantizable_weight(rng, 136, 256))
    x = backend.asarray(rng.standard_normal((3, 256)).astype(np.float16))
    norm_w = backend.asarray(np.ones(136, np.float16))
    launched = {}
    for fold in (True, False):
        with _backend_setting(backend, rmsnorm_fold=fold), _kernels_launched() as launched[fold]:
            resid = backend.asarray(np.zeros((3, 136), np.float32))
            out = backend.asarray(np.zeros((3, 136), np.float16))
            backend.down_residual_rmsnorm(x, qw, resid, norm_w, 1e-6, out)
            backend.synchronize()
    assert "residual_add_rmsnorm_f32_f16" in launched[True], f"the fold on launched {sorted(launched[True])}"
    assert "residual_add_rmsnorm_f32_f16" not in launched[False] and "rmsnorm_f32_f16" in launched[False], (
        f"the fold off launched {sorted(launched[False])}")


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
@pytest.mark.parametrize("pages_per_split", (1, 8, None))
def test_attention_decode_with_fixed_split_sizes(backend, variant, pages_per_split):
    """Each attention kernel with one page per split (splits past the length are empty), eight, and the
    dynamic spread; 600 keys put several pages on each warp of the warp kernel."""
    with _backend_setting(backend, pages_per_split=pages_per_split, attention_variant=variant):
        for L, nkv, ratio, d in ((33, 2, 1, 64), (33, 2, 7, 128), (600, 4, 7, 128), (1000, 1, 8, 64)):
            case = PagedCase.build(seed=L, L=L, T=1, nq=nkv * ratio, nkv=nkv, d=d, layout="shuffled")
            check_attention(backend, "attention_decode", case)


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_attention_decode_spreads_more_pages_than_splits(backend, variant):
    """The dynamic spread where the used pages outnumber the splits, as on a GPU with few SMs: att_blocks 4
    makes one to four splits per KV head, so a split spans many pages and the last one fewer (3 pages over
    2 splits: 2 and 1). On an H200 the dynamic spread gives the block kernel a split per page, so without
    this case a wrong span size went unseen (the nightly's fixed sample, seed 0)."""
    with _backend_setting(backend, pages_per_split=None, attention_variant=variant, att_blocks=4):
        for L, nkv, ratio, d in ((33, 2, 1, 64), (250, 2, 3, 64), (600, 4, 7, 128), (1000, 1, 8, 64)):
            case = PagedCase.build(seed=L + 7, L=L, T=1, nq=nkv * ratio, nkv=nkv, d=d, layout="shuffled")
            check_attention(backend, "attention_decode", case)


COMBINE = CATALOG.defines("paged_attention.cu")  # attention_combine_f16's block and its most splits


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_attention_decode_with_more_splits_than_the_combine_has_threads(backend, variant):
    """One page a split over COMBINE_THREADS + 44 pages of keys: attention_combine_f16's loops over the
    splits (each thread's m and l, the weights it leaves in shared memory) take a second pass, which no
    other case reaches (the most splits elsewhere are 64)."""
    splits = COMBINE["COMBINE_THREADS"] + 44
    assert splits <= COMBINE["COMBINE_MAX_SPLITS"]  # the launcher refuses more
    with _backend_setting(backend, pages_per_split=1, attention_variant=variant):
        L = 16 * splits
        check_attention(backend, "attention_decode",
                        PagedCase.build(seed=L, L=L, T=1, nq=2, nkv=1, d=64, layout="shuffled"))


def _table_of_used_pages(case: PagedCase) -> PagedCase:
    """`case` with its page table cut to the pages its keys use. The launch plan goes by the table's width
    (the engine's tables are as wide as a sequence may grow, fixed while a graph is captured), and a case's
    table has spare entries past the used ones."""
    used = -(-case.L // PAGE)
    assert (case.page_table[used:] == -1).all(), case
    return dataclasses.replace(case, page_table=case.page_table[:used])


def _merged_by_the_kernel_itself(backend, case, kernel: str, merges: bool):
    """The decode of `case` three times in a row, each checked against the reference and with the first's
    bits; `kernel` and no attention_combine_f16 launched where it `merges`, the combine and not `kernel`
    elsewhere."""
    with _kernels_launched() as launched:
        outs = [check_attention(backend, "attention_decode", case)[0] for _ in range(3)]
    assert (kernel in launched) == merges, f"{case}: launched {sorted(launched)}"
    assert ("attention_combine_f16" in launched) != merges, f"{case}: launched {sorted(launched)}"
    for again in outs[1:]:
        assert np.array_equal(again.view(np.uint16), outs[0].view(np.uint16)), (
            f"{case}: a second launch of the same decode gave other bits")


CLUSTER_MAX_PAGES = CATALOG.CLUSTER_MAX_PAGES  # the cluster kernel's page tables: two pages a warp at most


@pytest.mark.parametrize("pages", (1, CLUSTER_MAX_PAGES, CLUSTER_MAX_PAGES + 1))
def test_the_cluster_merges_its_splits_up_to_two_pages_a_warp_and_hands_longer_tables_to_the_combine(backend, pages):
    """attention_variant "tc_cluster", the dynamic spread: a page table of one page (seven of the cluster's
    eight splits empty) and of CLUSTER_MAX_PAGES (two pages on every warp) run the cluster kernel, whose
    blocks merge the splits after one cluster barrier; one page more takes the plain kernel and the combine.
    Three launches in a row, right and with the same bits each time. The 7B head layout and 8 heads of 64."""
    with _backend_setting(backend, pages_per_split=None, attention_variant="tc_cluster"):
        for nkv, ratio, d in ((4, 7, 128), (2, 8, 64)):
            L = 16 * pages - 3
            case = _table_of_used_pages(PagedCase.build(seed=L + d, L=L, T=1, nq=nkv * ratio, nkv=nkv, d=d,
                                                        layout="shuffled"))
            assert len(case.page_table) == pages, case
            _merged_by_the_kernel_itself(backend, case, f"paged_attention_tc_cluster_d{d}", pages <= CLUSTER_MAX_PAGES)


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
@pytest.mark.parametrize("L", PAGE_BOUNDARY_LENGTHS)
def test_attention_variant_at_every_page_edge(backend, variant, L):
    """Each kernel, decode and a 5-token prefill chunk, on every page edge: a page that holds 1, 15 or
    16 valid slots, on one warp or several. The variant that merges a decode's splits inside the kernel
    (tc_cluster) is not a prefill variant (a prefill has one split a block): its case is the decode alone."""
    prefill = variant in ATTENTION_PREFILL_VARIANTS
    with _backend_setting(backend, attention_variant=variant, **({"attention_prefill_variant": variant} if prefill else {})):
        for nkv, ratio, d in ((2, 2, 64), (4, 7, 128)):
            check_attention(backend, "attention_decode",
                             PagedCase.build(seed=L, L=L, T=1, nq=nkv * ratio, nkv=nkv, d=d, layout="shuffled"))
            if prefill:
                check_attention(backend, "attention_prefill",
                                PagedCase.build(seed=L + 1, L=L, T=min(5, L), nq=nkv * ratio, nkv=nkv, d=d, layout="sparse"))


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
@pytest.mark.parametrize("pages_per_split", (1, None))
def test_attention_decode_splits_past_the_length_weigh_nothing(backend, variant, pages_per_split):
    """A page table far longer than the keys (as the engine's, sized for the longest sequence): at one
    page a split, most splits lie past the length, hold no key and write l = 0 for the combine to weigh
    0; the dynamic spread gives the blocks of a short length one page or none."""
    with _backend_setting(backend, pages_per_split=pages_per_split, attention_variant=variant):
        for L, nkv, ratio, d in ((20, 4, 7, 128), (40, 2, 3, 64)):
            case = PagedCase.build(seed=L, L=L, T=1, nq=nkv * ratio, nkv=nkv, d=d, layout="shuffled")
            table = np.concatenate([case.page_table, np.full(61, -1, np.int32)])  # 63+ pages
            check_attention(backend, "attention_decode", dataclasses.replace(case, page_table=table))


@pytest.mark.parametrize("variant", ATTENTION_PREFILL_VARIANTS)
def test_attention_prefill_kernels_are_causal_at_every_tile_and_page_edge(backend, variant):
    """Each prefill kernel on prompts that end on, before and past its tiles (the tensor-core kernels'
    qt = 64 / group tokens) and pages, chunks after a cached prefix, head groups that do not divide 64
    (rows left over in a tile), and the 7B layout over 300 keys with scores of std 64. The wgmma kernel's
    64-key steps: keys ending on (64), one past (65) and inside a step, a step whose last pages lie past
    the used ones (300 keys, 19 pages: the fifth step's fourth page is the table's unused -1 entry, never
    read), and a short chunk after a long prefix (whole steps below every row's position, then the
    masked one)."""
    with _backend_setting(backend, attention_prefill_variant=variant):
        cases = [
            dict(L=2, T=2, nq=2, nkv=1, d=64, layout="contiguous"),
            dict(L=9, T=9, nq=28, nkv=4, d=128, layout="shuffled"),      # one full tile of 9 tokens (group 7)
            dict(L=10, T=10, nq=28, nkv=4, d=128, layout="shuffled"),    # one token into a second tile
            dict(L=64, T=64, nq=4, nkv=4, d=64, layout="sparse"),        # group 1: one tile of 64 tokens
            dict(L=65, T=65, nq=4, nkv=4, d=64, layout="shuffled"),
            dict(L=47, T=30, nq=12, nkv=2, d=128, layout="sparse"),      # a chunk after a 17-token prefix
            dict(L=33, T=33, nq=10, nkv=2, d=64, layout="shuffled"),     # group 5: 60 of 64 rows used
            dict(L=130, T=130, nq=24, nkv=1, d=128, layout="shuffled"),  # group 24: 2 tokens a tile
            dict(L=300, T=300, nq=28, nkv=4, d=128, layout="sparse", scale=8.0),
            dict(L=200, T=10, nq=28, nkv=4, d=128, layout="shuffled"),   # a chunk after a 190-token prefix
            dict(L=129, T=129, nq=8, nkv=4, d=64, layout="sparse"),      # group 2 at d 64: 3 steps, the last 1 key
        ]
        for i, kw in enumerate(cases):
            if variant == "block" or (variant == "warp" and kw["nq"] // kw["nkv"] > 8):
                if kw["nq"] // kw["nkv"] * kw["d"] > 2048:
                    continue  # paged_attention_f16 holds group x head_dim <= 2048 accumulators (it says so: ValueError)
            check_attention(backend, "attention_prefill", PagedCase.build(seed=100 + i, **kw))


@pytest.mark.parametrize("variant", ("tc", "tc_cluster", "warp"))
@pytest.mark.parametrize("nq, nkv, d", [(18, 2, 64), (4, 2, 96), (2, 1, 32), (4, 2, 36), (2, 1, 256)])
def test_attention_layouts_the_warp_kernel_does_not_hold_take_the_block_kernel(backend, variant, nq, nkv, d):
    """9 query heads per KV head, or a head_dim other than 64 and 128: the registers of the tensor-core and
    warp kernels do not hold them, so the backend runs paged_attention_f16, and the answer is still right.
    A head_dim that is not a multiple of 8 (36) takes that kernel's scalar loads of K and V instead of its
    16-byte ones; one above 128 (256) takes the split combine's second pass over the columns (a block
    merges 128 columns a pass: attention_combine_f16)."""
    with _backend_setting(backend, attention_variant=variant):
        assert backend.attention_kernel(nq, nkv, d) == "paged_attention_f16"
        for L, T in ((40, 1), (40, 6)):
            op = "attention_decode" if T == 1 else "attention_prefill"
            check_attention(backend, op, PagedCase.build(seed=L, L=L, T=T, nq=nq, nkv=nkv, d=d, layout="shuffled"))


RMS = CATALOG.defines("rmsnorm.cu")  # rmsnorm_f32_f16: elements a thread holds, its blocks for T > 1 and T = 1


@pytest.mark.parametrize("held", [True, False], ids=["held", "loop"])
@pytest.mark.parametrize("T,threads", [(1, None), (1, 128), (1, RMS["RMS_THREADS_ONE"]), (3, RMS["RMS_THREADS"])],
                         ids=["decode", "decode128", "decode_most", "prefill"])
def test_rmsnorm_on_both_sides_of_the_row_it_holds_in_registers(backend, T, threads, held):
    """Rows of RMS_HELD x threads elements or fewer are held in registers, longer ones take the loop:
    one short of, on and one past that length, with the block the launcher gives T rows (a decode row:
    the backend's `rmsnorm_threads_one`, as shipped, at 128 and at its most, RMS_THREADS_ONE); and the same
    lengths with `rmsnorm_held` off (the loop at every length, the path the bench times it against)."""
    knob = {"rmsnorm_held": held} if hasattr(backend, "rmsnorm_held") or not held else {}  # one rmsnorm: held runs it
    if T == 1 and hasattr(backend, "rmsnorm_threads_one"):
        threads = threads or backend.rmsnorm_threads_one
        knob["rmsnorm_threads_one"] = threads
    threads = threads or RMS["RMS_THREADS_ONE"]
    with _backend_setting(backend, **knob):
        length = RMS["RMS_HELD"] * threads
        for H in (length - 1, length, length + 1):
            check_rmsnorm(backend, T, H, 1e-6, "normal", seed=H)


@pytest.mark.parametrize("T", [200, 1100])
def test_rope_kv_write_on_prefills_long_enough_for_fewer_blocks_a_token(backend, T):
    """The launcher gives a token fewer blocks as T grows (no more than `rope_blocks_per_sm` an SM in all,
    8 by default; on an H200's 132 SMs, 6 a token at 200 tokens and 1 at 1100), so each block's threads
    stride over more rotation pairs; and with the knob at 0, 16 blocks a token at the same lengths."""
    knobs = [{"rope_blocks_per_sm": backend.rope_blocks_per_sm}, {"rope_blocks_per_sm": 0}] \
        if hasattr(backend, "rope_blocks_per_sm") else [{}]
    for knob in knobs:
        with _backend_setting(backend, **knob):
            check_rope_kv_write(backend, T, start=5, nkv=4, ratio=7, d=128, theta=1e6, layout="shuffled", seed=T)


@pytest.mark.long
def test_captured_decode_follows_a_wrapped_op_and_its_unwrapping(backend, model_path):
    if not backend.supports_graphs:
        pytest.skip("the backend does not capture graphs")
    model = engine.load(model_path, backend=backend)
    model.enable_cuda_graph(True)
    prompt = list(range(3, 16))

    def step():
        seq = model.new_sequence()
        model.prefill(seq, prompt)
        logits = model.decode_step(seq, 7)
        seq.free()
        return logits

    base = step()
    original = backend.rmsnorm  # the bound op, or the ladder's recording wrapper around it

    def doubled_rmsnorm(x, weight, eps, out):
        original(x, weight, eps, out)
        out *= 2  # a planted fault the replay must show

    captures = model._graph.captures
    backend.rmsnorm = doubled_rmsnorm
    try:
        faulty = step()
    finally:
        backend.rmsnorm = original
    again = step()
    assert model._graph.captures > captures, "wrapping an op did not capture the decode step again"
    assert not np.array_equal(faulty, base), "the replay ignored the wrapped rmsnorm"
    assert np.array_equal(again.view(np.uint32), base.view(np.uint32)), "unwrapping did not restore the logits bit for bit"


@pytest.mark.long
def test_a_kept_decode_graph_replays_after_off_and_on_and_is_captured_again_for_a_changed_setting(backend, model_path):
    """`enable_cuda_graph(False)` keeps the captured decode step: turned on again it replays the same graph,
    with eager's bits. A changed backend setting (another GEMV variant of qkv_proj) is in the graph's key:
    the next step captures again, and its logits are the new variant's eager ones."""
    if not backend.supports_graphs:
        pytest.skip("the backend does not capture graphs")
    prompt = list(range(3, 16))
    with engine.load(model_path, backend=backend) as model:
        def step(graph: bool):
            model.enable_cuda_graph(graph)
            seq = model.new_sequence()
            model.prefill(seq, prompt)
            logits = model.decode_step(seq, 7)
            seq.free()
            return logits.view(np.uint32)

        base = step(graph=True)
        kept, captures = model._graph, model._graph.captures
        eager = step(graph=False)
        again = step(graph=True)
        assert model._graph is kept and kept.captures == captures, "turning the graph off and on captured it again"
        assert np.array_equal(again, base) and np.array_equal(eager, base), "the kept graph's replay differs from eager"
        table = backend.gemv_config[model.quant]
        shipped = table["qkv_proj"]
        table["qkv_proj"] = next(v for v in backend.linears[model.quant].variants if v != shipped)
        try:
            changed = step(graph=True)
            assert kept.captures == captures + 1, f"gemv_config {table['qkv_proj']!r} replayed the graph of {shipped!r}"
            assert np.array_equal(changed, step(graph=False)), "the graph captured for the new variant differs from its eager run"
        finally:
            table["qkv_proj"] = shipped
        assert np.array_equal(step(graph=True), base) and kept.captures == captures + 2


@pytest.mark.long
@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_the_captured_decode_step_replays_each_attention_variant_with_eager_bits(backend, model_path, variant):
    """Each decode-attention variant inside the captured step, where its kernel is launched with
    programmatic dependent launch (eager launches never are), and replayed: the cluster's barrier must hold
    under the overlap. A cache of 512 tokens (32 pages: 8 splits a KV head, merged by the cluster), three
    decode steps: the graph's logits are the eager steps' bit for bit."""
    if not backend.supports_graphs:
        pytest.skip("the backend does not capture graphs")
    prompt = list(range(3, 40))
    with _backend_setting(backend, attention_variant=variant), \
            engine.load(model_path, backend=backend, cache_tokens=512) as model:
        def steps(graph: bool) -> list[np.ndarray]:
            model.enable_cuda_graph(graph)
            seq = model.new_sequence()
            model.prefill(seq, prompt)
            logits = [model.decode_step(seq, token).view(np.uint32).copy() for token in (7, 8, 9)]
            seq.free()
            return logits

        eager, graphed = steps(graph=False), steps(graph=True)
        for i, (a, b) in enumerate(zip(eager, graphed)):
            assert np.array_equal(a, b), f"attention_variant {variant!r}: decode step {i} replayed other logits than eager"
