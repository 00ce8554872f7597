#!/usr/bin/env python
"""Megatron-LM's pretrain_gpt.py with the "2d" context-parallel flags, without patching it.

A thin entry: batches, loss, datasets and embedding ranks are stock pretrain_gpt.py's own functions; only the argument
parser (``add_2d_arguments``) and the model config (``gpt_config_from_args_2d``: TransformerConfig2D, the 2d layer
spec, the library's launch checks) come from megatron_2d. pretrain_gpt.py (Megatron-LM at core_v0.19.0) must be
importable: run from a Megatron-LM checkout, or point MEGATRON_LM_DIR at one.

    MEGATRON_LM_DIR=/path/to/Megatron-LM torchrun --nproc-per-node 8 examples/pretrain_gpt_2d.py \\
        <usual pretrain_gpt flags> --context-parallel-size 8 --cp-comm-type 2d --cp-2d-head-parallel-size 2 \\
        --cp-2d-window-size 2 --cp-2d-placement head_first --attention-dropout 0.0

Without ``--cp-comm-type 2d`` it trains exactly like pretrain_gpt.py with stock context parallelism.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import List, Optional


def import_pretrain_gpt():
    """Megatron-LM's pretrain_gpt module (from MEGATRON_LM_DIR when set, else from sys.path)."""
    folder = os.environ.get("MEGATRON_LM_DIR")
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        return importlib.import_module("pretrain_gpt")
    except ModuleNotFoundError as err:
        if err.name not in ("pretrain_gpt", "gpt_builders", "model_provider"):
            raise
        raise SystemExit(f"examples/pretrain_gpt_2d.py runs Megatron-LM's pretrain_gpt.py, which is not importable "
                         f"({err}); set MEGATRON_LM_DIR to a Megatron-LM checkout at core_v0.19.0 "
                         f"(MEGATRON_LM_DIR={folder!r} now)") from None


def main(argv: Optional[List[str]] = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    stock = import_pretrain_gpt()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_2d.megatron.arguments import add_2d_arguments, gpt_config_from_args_2d

    setattr(stock.train_valid_test_datasets_provider, "is_distributed", True)  # as pretrain_gpt.py's __main__
    args = parse_and_validate_args(extra_args_provider=add_2d_arguments,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args_2d(args)),
             stock.train_valid_test_datasets_provider, ModelType.encoder_or_decoder, stock.forward_step,
             get_embedding_ranks=stock.get_embedding_ranks)


if __name__ == "__main__":
    main()
