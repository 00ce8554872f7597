"""Benchmark harnesses the thin scripts in tools/ run (importable, so nothing manipulates sys.path)."""
