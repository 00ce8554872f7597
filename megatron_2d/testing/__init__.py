"""Test support a user may import: the single-process reference and the ONE tolerance table, the reference core
attention for Megatron's slot, forked CPU ranks, the loopback ring and the no-sync guards (the runtime never imports
it; it patches nothing). The CPU stand-ins, harnesses, demo, gpu-check and benchmarks are in the development
distribution, dev/megatron_2d_dev, which is never shipped."""
