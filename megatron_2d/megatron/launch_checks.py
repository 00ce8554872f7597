"""Checks of a Megatron-LM launch (pretrain_gpt.py flags) against what the 2d backend supports.

Every route into the library reaches them, on every rank, before any model is trained:

  * the patched pretrain_gpt.py and ``examples/pretrain_gpt_2d.py`` build the model config with
    :func:`megatron_2d.megatron.arguments.gpt_config_from_args_2d`, which calls :func:`check_launch_args`;
  * the unpatched ``--spec megatron_2d.megatron.spec gpt_layer_spec_2d`` route calls the layer-spec function, which
    calls :func:`check_current_launch` (megatron.training's parsed arguments, when a launch has set them).

Model-level settings (hp, window, placement, heads, dropout) are validated by ``settings_from_config``; this module
covers what only the command line knows: how the data is packed.
"""

from __future__ import annotations

import sys
from typing import Optional, Tuple

from .settings import layer_comm_types, uses_2d

PACKED_SEQUENCE_FLAGS: Tuple[Tuple[str, str], ...] = (
    ("--reset-attention-mask", "reset_attention_mask"),
    ("--dataloader-inter-document-masking", "dataloader_inter_document_masking"),
)
"""Document-masking flags whose batches the 2d backend would get wrong, with their argparse destinations:
--reset-attention-mask builds a dense [s, s] mask (not THD), and --dataloader-inter-document-masking without
--sft splits each sample whole-sequence zigzag while passing per-document cu_seqlens. Packed documents reach the
2d backend as THD (--sft: Megatron's per-document zigzag split; or the documents layout of
megatron_2d.megatron.packed_data)."""


def check_launch_args(args) -> None:
    """Refuse, with ValueError, flags the 2d backend would otherwise get silently wrong (``args``: the Namespace of
    megatron.training's parse_and_validate_args). Nothing is checked when no layer uses ``--cp-comm-type 2d``."""
    if not uses_2d(getattr(args, "cp_comm_type", None)):
        return
    given = [flag for flag, dest in PACKED_SEQUENCE_FLAGS if getattr(args, dest, False)]
    if "--dataloader-inter-document-masking" in given and (
            getattr(args, "sft", False) or getattr(args, "cp_2d_packing", "zigzag") == "documents"
            or getattr(args, "context_parallel_size", 1) == 1):
        # --sft: Megatron's per-document THD split; documents: our data path splits the batch itself; CP=1: no
        # split at all
        given.remove("--dataloader-inter-document-masking")
    if given:
        raise ValueError(f"{', '.join(given)} gives document masks the 2d backend (cp_comm_type "
                         f"{layer_comm_types(args.cp_comm_type)}) would not see as packed THD batches; drop "
                         f"{', '.join(given)} and pack documents as THD (--sft, or the documents layout of "
                         f"megatron_2d.megatron.packed_data, see examples/pretrain_gpt_2d.py)")


def current_launch_args() -> Optional[object]:
    """megatron.training's parsed arguments when a launch (pretrain_gpt.py) has set them, else None. megatron.training
    is not imported here: a library user who builds models directly has no launch to check."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None
    try:
        return global_vars.get_args()
    except AssertionError:  # megatron's "args is not initialized"
        return None


def check_current_launch() -> None:
    """:func:`check_launch_args` on the current launch's arguments, if any."""
    args = current_launch_args()
    if args is not None:
        check_launch_args(args)
