#!/usr/bin/env python
"""Megatron-LM's pretrain_gpt.py with the "2d" context-parallel flags, without patching it.

A thin entry: batches, loss, datasets and embedding ranks are stock pretrain_gpt.py's own functions; only the argument
parser (``add_2d_arguments``) and the model config (``gpt_config_from_args_2d``: TransformerConfig2D, the 2d layer
spec, the library's launch checks) come from megatron_2d. pretrain_gpt.py (Megatron-LM at core_v0.19.0) must be
importable: run from a Megatron-LM checkout, or point MEGATRON_LM_DIR at one.

    MEGATRON_LM_DIR=/path/to/Megatron-LM torchrun --nproc-per-node 8 examples/pretrain_gpt_2d.py \\
        <usual pretrain_gpt flags> --context-parallel-size 8 --cp-comm-type 2d --cp-2d-head-parallel-size 2 \\
        --cp-2d-inner-ring-size 2 --cp-2d-placement head_first --attention-dropout 0.0

Without ``--cp-comm-type 2d`` it trains exactly like pretrain_gpt.py with stock context parallelism.

Packed documents (THD): ``--sft`` batches run as pretrain_gpt.py builds them (Megatron's per-document zigzag,
``--cp-2d-packing zigzag``, the default; at CP > 1 with --calculate-per-token-loss, which the launch checks ask
for), and so do ``--dataloader-inter-document-masking`` batches (Megatron's per-sequence split: the "sequence"
layout, chosen by itself). ``--cp-2d-packing documents`` with ``--dataloader-inter-document-masking`` (or
``--sft``) switches to the documents layout: short documents stay whole on one context rank and only long ones
travel the ring. Its batches come from :func:`documents_forward_step` here (the data path of
megatron_2d.megatron.packed_data, RoPE at each token's position in its document, the loss weighing every token
equally whatever each CP rank holds; needs --no-rope-fusion and pipeline-parallel size 1). A stock pretrain_gpt.py
user turns it on by running this entry instead, with the same flags plus ``--cp-2d-packing documents``.

Dynamic (hybrid) CP: ``--hybrid-context-parallel --max-seqlen-per-dp-cp-rank M --sft --calculate-per-token-loss
--rerun-mode disabled --no-rope-fusion`` with ``--cp-comm-type 2d`` runs each sequence on its own CP group with that
size's 2D layout (``--cp-2d-dynamic-layouts``, else the planner's rule); the forward step reads Megatron's hybrid
sub-samples through megatron_2d.megatron.dynamic_data (docs/megatron.md, "Dynamic (hybrid) context parallelism").
"""

from __future__ import annotations

import importlib
import os
import sys


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
        raise SystemExit(
            f"examples/pretrain_gpt_2d.py runs Megatron-LM's pretrain_gpt.py, which is not importable "
            f"({err}); set MEGATRON_LM_DIR to a Megatron-LM checkout at core_v0.19.0 "
            f"(MEGATRON_LM_DIR={folder!r} now)"
        ) from None


def documents_forward_step(stock):
    """pretrain_gpt.py's forward_step for ``--cp-2d-packing documents``: the batch is broadcast over TP and
    flattened as stock does, then split by the documents layout instead of Megatron's per-document zigzag."""
    from functools import partial

    from megatron.core import parallel_state as mpu
    from megatron.core.utils import flatten_batch_for_packed_sequences, get_batch_on_this_tp_rank, unwrap_model
    from megatron.training import get_args

    from megatron_2d.megatron.packed_data import (
        documents_batch_on_this_cp_rank,
        groups_of_model,
        token_weighted_loss,
        use_document_positions,
    )

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        args = get_args()
        if return_schedule_plan or args.pipeline_model_parallel_size != 1:
            raise ValueError("--cp-2d-packing documents supports pipeline-parallel size 1 without schedule plans")
        batch = {}
        if mpu.get_tensor_model_parallel_rank() == 0:
            raw = next(data_iterator)
            batch = {
                key: raw[key].cuda(non_blocking=True) if raw.get(key) is not None else None for key in stock.BATCH_KEYS
            }
        batch = get_batch_on_this_tp_rank(
            batch,
            has_cu_seqlens=True,
            is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(),
            cp_size=args.context_parallel_size,
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            mtp_on_this_rank=False,
            pipeline_model_parallel_size=1,
            is_pipeline_first_stage=True,
            is_pipeline_last_stage=True,
        )
        batch = flatten_batch_for_packed_sequences(batch)
        if batch.get("cu_seqlens") is None:
            raise ValueError(
                "--cp-2d-packing documents needs batches with document boundaries: add "
                "--dataloader-inter-document-masking (or use --sft)"
            )
        gpt = use_document_positions(unwrap_model(model))
        local, params = documents_batch_on_this_cp_rank(batch, groups_of_model(gpt), batch["cu_seqlens"].reshape(-1))
        moe = (
            {"padding_mask": local["padding"]} if args.num_experts else {}
        )  # the routers leave the layout's padding out
        output = model(
            local["tokens"],
            local["position_ids"],
            None,
            labels=local["labels"],
            loss_mask=local["loss_mask"],
            packed_seq_params=params,
            **moe,
        )
        loss = token_weighted_loss(
            partial(stock.loss_func, local["loss_mask"], model=model),
            mpu.get_context_parallel_group(),
            args.calculate_per_token_loss,
        )
        return output, loss

    return forward_step


def main(argv: list[str] | None = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    stock = import_pretrain_gpt()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_2d.megatron.arguments import (
        add_2d_arguments,
        gpt_config_from_args_2d,
        parse_and_validate_args_2d,
        use_clip_qk_2d,
    )
    from megatron_2d.megatron.dynamic_data import forward_step_2d

    stock.train_valid_test_datasets_provider.is_distributed = True  # as pretrain_gpt.py's __main__
    args = parse_and_validate_args_2d(
        extra_args_provider=add_2d_arguments, args_defaults={"tokenizer_type": "GPT2BPETokenizer"}
    )
    use_clip_qk_2d(args)
    documents = args.cp_2d_packing == "documents"  # add_2d_arguments' flag
    # --hybrid-context-parallel: Megatron's hybrid sub-samples in pretrain_gpt's batch schema (dynamic_data)
    forward_step = documents_forward_step(stock) if documents else forward_step_2d(stock.forward_step, args)
    pretrain(
        pretrain_cfg_container_from_args(args, gpt_config_from_args_2d(args)),
        stock.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        get_embedding_ranks=stock.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
