"""Benchmarks: scripts run as `python bench/NAME.py` (each says what it measures and how),
and `bench_*.py`, collected by pytest. A package so that pytest imports those as
`bench.bench_*` without putting this folder on sys.path, where a script's name could hide
an installed package (bench/sandbox_fusion.py and the `sandbox-fusion` client)."""
