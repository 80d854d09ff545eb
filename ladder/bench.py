"""`nanoqwen bench`: the subcommand's wiring; the benchmark itself lives in bench/decode_bench.py."""

from __future__ import annotations


def _run(args) -> int:
    from bench import decode_bench

    return decode_bench.main(args)


def register(subparsers) -> None:
    """Add the `bench` subcommand to the `nanoqwen` parser's subparsers."""
    from bench.decode_bench import add_arguments

    b = subparsers.add_parser("bench", help="GPU: TTFT and decode ms/token at a model shape, against the bandwidth floor")
    add_arguments(b)
    b.set_defaults(func=_run)
