"""Test support: multi-rank tests, CPU shims and stand-ins, the reference and its tolerances, the demo and the GPU
check (the runtime never imports it)."""
