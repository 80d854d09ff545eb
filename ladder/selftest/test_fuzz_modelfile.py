"""Self-test: malformed model files never escape as tracebacks, hangs or memory blow-ups.

fixtures/fuzz/ mutates a small valid .nanoqwen file (bytes, lengths, header JSON fields, config
values, the embedded tokenizer.json) with a seeded, structure-aware mutator and runs, on every
mutant, ModelFile() with checksums on and off, engine.load(..., backend="numpy") where the reader
accepts the file, and engine.tokenizer.embedded_tokenizer(). A stage may succeed or raise a
NanoqwenError whose message is one line; anything else fails the test with the seed, the case
number and the mutation, replayable with `python -m fixtures.fuzz --seed S --case I`.

The budget follows the active Hypothesis profile (ladder/plugin/__init__.py): `ci` runs CASES["ci"] cases in a
few seconds, `nightly` runs CASES["nightly"] (100,000), split into CHUNKS parametrized chunks with
disjoint seeds so pytest-xdist spreads them over the cores: `python -m pytest -m selftest -k fuzz
--hypothesis-profile nightly -n auto` (a self-test, so `nanoqwen ladder`'s nightly run does not run it).
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from fixtures import fuzz

CHUNKS = 16
CASES = {"ci": 640, "nightly": 100_000}
MEMORY_EVERY = {"ci": 8, "nightly": 50}  # every N-th case runs again under tracemalloc for its peak
# A hang detector, not a speed target: a case costs milliseconds of CPU (the largest mutants, 3 MB
# headers, about 0.1 s). CPU time of the process, which a loop or a blow-up burns and other processes
# on a shared machine do not inflate; a case blocked without burning CPU is stopped after
# fuzz.HANG_S seconds of wall time and reported as untyped.
CASE_CPU_S = 2.0
# Peak Python memory (tracemalloc) of a case may exceed the file's size by this much plus the parsed
# header's JSON objects: at most 5 bytes per header byte measured on the mutants (3 MB headers of
# tensor entries), up to 26 for a header of nothing but empty objects. The header is at most 8 MiB
# (engine.modelfile.MAX_HEADER), so the bound is the file's size plus a constant.
MEMORY_ALLOWANCE = 16 << 20
PER_HEADER_BYTE = 8


def _profile() -> str:
    get = getattr(settings, "get_current_profile_name", None)
    name = get() if get else getattr(settings, "_current_profile", "ci")
    return name if name in CASES else "ci"


def _show(results, limit: int = 5) -> str:
    return "\n".join(f"{r.replay}  [{r.mutation}]\n" + "\n".join(f"  {st}: {tb.strip()}" for st, tb in r.untyped.items())
                     for r in results[:limit])


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_malformed_files_raise_only_one_line_typed_errors_quickly_in_bounded_memory(chunk):
    profile = _profile()
    results = list(fuzz.run(seed=chunk, cases=CASES[profile] // CHUNKS, memory_every=MEMORY_EVERY[profile]))

    untyped = [r for r in results if r.untyped]
    assert not untyped, f"{len(untyped)} case(s) escaped as untyped errors:\n{_show(untyped)}"
    slow = [r for r in results if r.cpu_seconds > CASE_CPU_S]
    assert not slow, "cases over the hang detector's bound:\n" + "\n".join(
        f"{r.replay}: {r.cpu_seconds:.2f} s CPU [{r.mutation}]" for r in slow)
    heavy = [r for r in results if r.peak is not None and r.peak > r.size + PER_HEADER_BYTE * r.header + MEMORY_ALLOWANCE]
    assert not heavy, "cases over the memory bound:\n" + "\n".join(
        f"{r.replay}: peak {r.peak} bytes, file {r.size}, header {r.header} [{r.mutation}]" for r in heavy)
    assert any(r.peak is not None for r in results)


def test_a_case_is_the_same_bytes_and_mutation_wherever_it_is_replayed():
    assert fuzz.mutant(3, 17) == fuzz.mutant(3, 17)
    assert fuzz.mutant(3, 17) != fuzz.mutant(3, 18) and fuzz.mutant(3, 17) != fuzz.mutant(4, 17)


def test_the_mutator_reaches_every_stage_with_both_outcomes():
    # A mutator that only made unreadable files would test the magic check and nothing else.
    results = list(fuzz.run(seed=1000, cases=160))
    outcomes = {(st, o == "ok") for r in results for st, o in r.outcomes.items()}
    assert outcomes == {(st, ok) for st in fuzz.STAGES for ok in (True, False)}, sorted(outcomes)
    assert not [r for r in results if r.untyped], _show([r for r in results if r.untyped])
