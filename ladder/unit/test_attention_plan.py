"""Unit rung, any machine: the CUDA backend's plan of an attention launch (kernels/cuda/catalog.py
`attention_plan`, read by file path without CuPy), held to the kernels' edges.

The backend launches exactly what the plan says (CudaBackend._attention), so what is checked here is
what a GPU would be asked to run: every page of the table in some split, no more splits than the combine
kernel merges, the cluster kernel only with its CLUSTER_SPLITS splits over a table its warps hold, and,
where a variant's own kernel cannot serve, exactly the plain tensor-core kernel's plan. The GPU-side cases (test_cuda_variants.py) then run those launches.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ladder.changes.sources import cuda_module

CATALOG = cuda_module("catalog")
VARIANTS = CATALOG.ATTENTION_VARIANTS
CLUSTER, CLUSTER_PAGES = CATALOG.CLUSTER_SPLITS, CATALOG.CLUSTER_MAX_PAGES
COMBINE_MAX = CATALOG.COMBINE_MAX_SPLITS
# head layouts (nq, nkv, d): the 7B's, the tiny coder's, 8 heads of 64 a KV head, and three the tensor-core
# and warp kernels do not hold (9 heads a KV head, head_dim 96 and 256)
LAYOUTS = [(28, 4, 128), (4, 2, 64), (16, 2, 64), (18, 2, 64), (4, 2, 96), (2, 1, 256)]
SOURCES = pytest.mark.reads_source("kernels/cuda/paged_attention.cu", "kernels/cuda/catalog.py")


def _plan(variant, T, layout, max_pages, split, pages_per_split, att_blocks):
    nq, nkv, d = layout
    return CATALOG.attention_plan(variant, T, nq, nkv, d, max_pages, split, pages_per_split, att_blocks)


@SOURCES
@given(variant=st.sampled_from(VARIANTS), T=st.integers(1, 4), layout=st.sampled_from(LAYOUTS),
       max_pages=st.integers(1, 600), split=st.booleans(),
       pages_per_split=st.none() | st.integers(1, 80), att_blocks=st.integers(1, 1056))
def test_every_plan_covers_its_pages_within_its_kernels_edges(variant, T, layout, max_pages, split, pages_per_split,
                                                               att_blocks):
    nq, nkv, d = layout
    args = (T, layout, max_pages, split, pages_per_split, att_blocks)
    try:
        plan = _plan(variant, *args)
    except ValueError as e:  # only a split count past the combine's, or a layout paged_attention_f16 cannot hold
        assert "exceed the combine kernel's" in str(e) or "accumulators" in str(e) or "shared memory" in str(e), e
        return
    own = CATALOG.attention_kernel(variant, nq, nkv, d)
    plain = own.replace("_cluster", "")
    assert plan.kernel in (own, plain), (variant, args, plan)
    assert 1 <= plan.splits <= COMBINE_MAX, (variant, args, plan)
    if not split:
        assert plan.splits == 1 and not plan.merges, (variant, args, plan)
    if plan.pages_per_split:  # a fixed span: every page of the table in some split
        assert plan.splits * plan.pages_per_split >= max_pages, (variant, args, plan)
    assert plan.merges == (plan.kernel != plain), (variant, args, plan)
    if plan.kernel in CATALOG.CLUSTER_KERNELS:
        assert plan.splits == CLUSTER, (variant, args, plan)
        assert max_pages <= CLUSTER_PAGES if not plan.pages_per_split else True, (variant, args, plan)
    if not plan.merges and own != plain:  # the cluster's variant where its kernel cannot serve
        assert plan == _plan("tc", *args), (variant, args, plan)


@SOURCES
@pytest.mark.parametrize("max_pages, want", [
    # the bench's cache at a 512-token prompt (512 + 128 new + 16 tokens: 41 pages): "tc" spreads them over
    # 11 splits (no more than one page a warp), the cluster takes its 8 and merges them itself
    (41, {"tc": ("paged_attention_tc_d128", 11, False),
          "tc_cluster": ("paged_attention_tc_cluster_d128", CLUSTER, True)}),
    # at 8192 (8336 tokens: 521 pages): 66 splits (2 blocks an SM of 132, over 4 KV heads), past the
    # cluster's 128 pages, so the cluster's variant runs "tc" and the combine
    (521, {"tc": ("paged_attention_tc_d128", 66, False), "tc_cluster": ("paged_attention_tc_d128", 66, False)}),
])
def test_the_7b_decode_on_an_h200_at_512_and_8192_keys(max_pages, want):
    """The decode step the bench times (28 query heads, 4 KV heads of 128; att_blocks 2 x 132 SMs; its cache
    sized prompt + 128 new + 16 tokens, bench/decode_bench.py): which kernel each tensor-core variant runs,
    over how many splits, and whether it merges them itself."""
    for variant, (kernel, splits, merges) in want.items():
        plan = _plan(variant, 1, (28, 4, 128), max_pages, True, None, 264)
        assert (plan.kernel, plan.splits, plan.merges) == (kernel, splits, merges), (variant, plan)


@SOURCES
def test_the_cluster_at_its_edges():
    """The cluster's dynamic spread: a table of one page and of CLUSTER_MAX_PAGES pages runs it, one page
    more runs "tc" and the combine; with a fixed span, as many splits as cover the table (up to
    CLUSTER_SPLITS); a prefill (no split) never runs it."""
    assert _plan("tc_cluster", 1, (28, 4, 128), 1, True, None, 264).merges
    assert _plan("tc_cluster", 1, (28, 4, 128), CLUSTER_PAGES, True, None, 264).merges
    longer = _plan("tc_cluster", 1, (28, 4, 128), CLUSTER_PAGES + 1, True, None, 264)
    assert longer == _plan("tc", 1, (28, 4, 128), CLUSTER_PAGES + 1, True, None, 264) and not longer.merges
    assert not _plan("tc_cluster", 5, (28, 4, 128), 8, False, None, 264).merges
    spans = {pps: _plan("tc_cluster", 1, (28, 4, 128), 40, True, pps, 264).merges for pps in (4, 5, 6)}
    assert spans == {4: False, 5: True, 6: True}  # 40 pages: 10 spans of 4, 8 of 5, 7 of 6


@SOURCES
def test_a_split_count_past_the_combines_is_refused_in_words():
    """One page a split over COMBINE_MAX_SPLITS + 1 pages: no kernel merges that many (the cluster's variant
    falls back to "tc" and so to the combine), and the launcher says so instead of launching."""
    for variant in ("tc", "tc_cluster", "block"):
        with pytest.raises(ValueError, match=f"{COMBINE_MAX + 1} splits exceed the combine kernel's {COMBINE_MAX}"):
            _plan(variant, 1, (28, 4, 128), COMBINE_MAX + 1, True, 1, 264)
