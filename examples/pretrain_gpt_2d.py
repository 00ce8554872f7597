#!/usr/bin/env python
"""GPT pretraining with Megatron-LM's training loop and the "2d" context-parallel backend available.

The same flags as Megatron-LM's pretrain_gpt.py (megatron-core 0.19.x), plus the 2D ones:

    torchrun --nproc-per-node 8 examples/pretrain_gpt_2d.py <usual pretrain_gpt flags> \
        --context-parallel-size 8 --cp-comm-type 2d --cp-2d-head-parallel-size 2 \
        --cp-2d-window-size 2 --cp-2d-placement head_first --attention-dropout 0.0

Without ``--cp-comm-type 2d`` it trains exactly like pretrain_gpt.py with stock context parallelism (p2p, a2a,
a2a+p2p through Transformer Engine), so one entry serves side-by-side comparisons. Packed sequences (SFT, THD)
are not supported by the 2d backend and are refused.
"""

from __future__ import annotations

import os
import sys
import warnings
from functools import partial
from typing import List, Optional

if int(os.environ.get("RANK", 0)) != 0:
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import get_args, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage  # noqa: E402

from megatron_2d.megatron.arguments import add_2d_arguments, gpt_config_from_args_2d  # noqa: E402
from megatron_2d.megatron.data import get_batch_on_this_cp_rank_2d  # noqa: E402

BATCH_KEYS = ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """This rank's micro-batch: read on TP rank 0, broadcast over TP, then split over CP (zigzag)."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return [None] * len(BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {k: raw[k].cuda(non_blocking=True) if raw.get(k) is not None else None for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = get_batch_on_this_cp_rank_2d(batch, mpu.get_context_parallel_group())
    return [batch.get(k) for k in BATCH_KEYS]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the masked per-token losses of this rank and its token count (Megatron divides globally)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch forward; returns the per-token losses and the loss function."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    attention_mask, labels, loss_mask, position_ids, tokens = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def dataset_config_from_args(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        context_parallel_size=args.context_parallel_size, data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPTDataset (or MockGPTDataset with --mock-data) through Megatron's blended builder."""
    args = get_args()
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset, train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage), dataset_config_from_args(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


def get_embedding_ranks(pp_ranks: List[int]):
    """First stage, plus the last when embeddings and output weights are tied."""
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))


def check_supported(args) -> None:
    """Refuse what the 2d backend would otherwise silently get wrong."""
    from megatron_2d.megatron.settings import uses_2d

    if not uses_2d(args.cp_comm_type):
        return
    for flag, value in (("--sft", getattr(args, "sft", False)), ("--reset-attention-mask", args.reset_attention_mask),
                        ("--dataloader-inter-document-masking",
                         getattr(args, "dataloader_inter_document_masking", False))):
        if value:
            raise SystemExit(f"{flag} needs packed-sequence (THD) attention, which --cp-comm-type 2d does not "
                             f"support yet; drop {flag} or use a stock --cp-comm-type")


def main(argv: Optional[List[str]] = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    setattr(train_valid_test_datasets_provider, "is_distributed", True)
    args = parse_and_validate_args(extra_args_provider=add_2d_arguments,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    check_supported(args)
    model_config = gpt_config_from_args_2d(args)
    pretrain(pretrain_cfg_container_from_args(args, model_config), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, get_embedding_ranks=get_embedding_ranks)


if __name__ == "__main__":
    main()
