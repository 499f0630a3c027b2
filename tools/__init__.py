"""The benchmarks and checks, run as modules from the repo root (``python -m tools.bench_x``);
what they share is tools/benchlib."""
