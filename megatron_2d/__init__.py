"""megatron_2d: LoongTrain's 2D-Attention (head x context parallelism with Double-Ring) for Megatron-LM.

    import megatron_2d
    groups = megatron_2d.build_2d_groups(head_parallel_size=2, window_size=2, placement="head_first")
    out = megatron_2d.attention_2d(q, k, v, groups, causal=True)     # q [s_local, b, hq, d] (sbhd)
    groups.comm_bytes.as_dict()                                      # bytes sent by kind
"""

from .attention import attention_2d, kv_replication
from .groups import Groups2D, build_2d_groups
from .sequence_layout import shard_sequence, unshard_sequence, zigzag_chunks
from .topology import PLACEMENTS, Layout2D, LayoutError

__version__ = "0.1.0"

__all__ = [
    "attention_2d", "build_2d_groups", "Groups2D", "kv_replication", "Layout2D", "LayoutError", "PLACEMENTS",
    "shard_sequence", "unshard_sequence", "zigzag_chunks",
]
