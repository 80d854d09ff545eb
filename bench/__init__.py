"""Benchmarks and GPU check scripts: `nanoqwen bench` (decode_bench.py) and the
sanitizer run (the unit rung's checks under compute-sanitizer). Results and the reasoning behind each version live in NOTES.md."""
