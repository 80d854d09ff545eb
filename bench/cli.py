"""`nanoqwen bench`: the subcommand's wiring; the benchmark itself lives in decode_bench.py.

The command line (engine/cli.py) finds `register` through its table of commands, by name, and imports
this module only when `bench` is chosen: nothing imports bench/.

On a machine without CuPy or a GPU it stops before any work: `nanoqwen: error: bench needs the cuda
backend: ...`, exit status 2."""

from __future__ import annotations


def _run(args) -> int:
    from kernels import BackendUnavailableError, cuda_available

    ok, why = cuda_available()
    if not ok:  # one line and exit 2 (engine/cli.py), not a traceback from deep inside the benchmark
        raise BackendUnavailableError(f"bench needs the cuda backend: {why}")
    from bench import decode_bench

    return decode_bench.main(args)


def register(subparsers) -> None:
    """Add the `bench` subcommand to the `nanoqwen` parser's subparsers."""
    from bench.decode_bench import add_arguments

    b = subparsers.add_parser("bench", help="GPU: TTFT and decode ms/token at a model shape, against the bandwidth floor")
    add_arguments(b)
    b.set_defaults(func=_run)
