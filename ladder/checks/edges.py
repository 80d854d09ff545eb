"""Edge shapes derived from a kernel's own tiling constants, not listed by hand.

A GEMV variant's constants (kernels/cuda/catalog.py, read from its name and its launcher) give the stride
of its loop over the inputs and the rows a block owns; the shapes worth checking are on either side of
each: a loop that runs short, exactly once, wraps and wraps twice, and a last block that is partial, full,
or one row into a new block. The unit rung (ladder/unit/test_cuda_variants.py) and the sanitizer script
(its op sweep, ladder/tools/opsweep.py) take their shapes from here, so a new variant or a changed constant gets its edges
without a new list.
"""

from __future__ import annotations


def gemv_edges(stride: int, per_block: int, step: int) -> list[tuple[int, int]]:
    """(inputs, rows) pairs at a GEMV variant's edges: inputs short of, on and past one loop `stride`, and
    past two (each a multiple of `step`, the format's input multiple), with rows one into a second block;
    then rows short of, on and past `per_block` and past two blocks, with inputs one step past a stride."""
    pairs = [(n, per_block + 1) for n in (stride - step, stride, stride + step, 2 * stride + step) if n >= step]
    return pairs + [(stride + step, r) for r in (per_block - 1, per_block, 2 * per_block + 1) if r >= 1]


def gemv_tail(stride: int, per_block: int, step: int) -> tuple[int, int]:
    """The one shape where both edges are passed at once (the loop wraps, the last block holds one row):
    what a tool that is slow per launch (a sanitizer) runs for every variant."""
    return stride + step, per_block + 1


def lm_head_edges(per_block: int, per_warp: int, stride: int, step: int = 8) -> list[tuple[int, int]]:
    """(vocab, hidden) pairs at the lm_head kernel's edges: vocab sizes short of, on and past a warp's
    rows and a block's, and past two blocks by a partial warp, with the hidden size one step past a
    stride; then hidden sizes short of, on and past one stride of the warp's loop and past two, with the
    vocab one row into a second block."""
    vocab = sorted({per_warp - 1, per_warp + 1, per_block - 1, per_block, per_block + 1,
                    lm_head_tail(per_block, per_warp, stride, step)[0]})
    pairs = [(v, stride + step) for v in vocab if v >= 1]
    return pairs + [(per_block + 1, h) for h in (stride - step, stride, 2 * stride + step) if h >= step]


def lm_head_tail(per_block: int, per_warp: int, stride: int, step: int = 8) -> tuple[int, int]:
    """The lm_head shape past both edges at once (two blocks and a partial warp of vocab rows, a warp's
    loop wrapped once): what a sanitizer runs."""
    return 2 * per_block + per_warp + 1, stride + step
