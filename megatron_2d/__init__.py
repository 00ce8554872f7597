"""megatron_2d: LoongTrain's 2D-Attention (head x context parallelism with Double-Ring) for Megatron-LM.

    import megatron_2d
    groups = megatron_2d.build_2d_groups(head_parallel_size=2, inner_ring_size=2, placement="head_first")
    out = megatron_2d.attention_2d(q, k, v, groups, causal=True)     # q [s_local, b, hq, d] (sbhd)
    groups.comm_bytes.as_dict()                                      # bytes sent by kind

The public names are imported on first use (PEP 562), so ``import megatron_2d.plan`` (the planner, pure Python)
works without torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "attention_2d": "attention",
    "kv_replication": "layout.heads",
    "latent_attention_2d": "latent_attention",
    "Groups2D": "groups",
    "build_2d_groups": "groups",
    "shard_sequence": "sequence_sharding",
    "unshard_sequence": "sequence_sharding",
    "zigzag_chunks": "layout.topology",
    "PLACEMENTS": "layout.topology",
    "Layout2D": "layout.topology",
    "LayoutError": "layout.topology",
    "SlidingWindow": "layout.band",
    "PackedSharding": "packed_sharding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_2d' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
