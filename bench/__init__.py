"""Benchmarks and GPU check scripts: `nanoqwen bench` (decode_bench.py), the CUDA self-check and the
sanitizer run. Results and the reasoning behind each version live in NOTES.md."""
