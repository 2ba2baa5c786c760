"""The sections of RESULTS.md, one module each (``benchmarks/results.py`` renders them)."""
