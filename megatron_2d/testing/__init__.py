"""Support for multi-rank tests, demos and benchmarks on CPU (never used on the GPU runtime path)."""
