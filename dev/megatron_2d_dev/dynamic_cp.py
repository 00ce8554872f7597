"""Megatron's hybrid (dynamic) context parallelism on forked CPU ranks, against the same training at CP = 1.

Test support (never imported by the library). Inside ``run_on_ranks`` every rank:

    samples = packed_samples(lengths, seed)                 # SFTDataset-like packed samples of this global batch
    ref = reference_step(cfg, samples)                      # CP = 1: every sequence, Megatron's own local attention
    got = hybrid_step(cfg, samples, dp=2, cp=2, max_seqlen_per_rank=8, layouts="4=2x2")
    compare_results(got, ref)                               # loss, grad norm, every gradient

:func:`hybrid_step` runs Megatron's own machinery: ``initialize_model_parallel(hybrid_context_parallel=True)``,
``HybridCPDataLoaderWrapper`` (it gathers the sequence lengths over DP, schedules them with
``BalancedCPScheduler`` and reroutes the sequences with ``all_to_all_single``), ``get_forward_backward_func()``
(which runs ``hybrid_context_parallel_forward_backward``: ranks run different numbers of sequences, one group of
CP groups at a time), pretrain_gpt.py's batch path (:func:`megatron_2d.megatron.dynamic_data.hybrid_sample_batch`,
``flatten_batch_for_packed_sequences``, ``get_batch_on_this_cp_rank(is_hybrid_cp=True)``, its PackedSeqParams) and
pretrain_gpt.py's loss (sum over tokens, count). Gradients are summed over the DP x CP group and divided by the
global token count, as Megatron's DDP does with ``--calculate-per-token-loss``. It also returns which CP group
size each sequence ran on (from the sub-samples this rank received), so a test can check that the lengths land in
the sizes it means.

:func:`reference_step` is the CP = 1 training of the same sequences on one rank, each one its own sbhd batch through
megatron-core's local GPT spec (its DotProductAttention): the same loss (sum over every loss token / their count)
and gradients, computed without anything this project wrote.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_2d.megatron.config import TransformerConfig2D
from megatron_2d.megatron.dynamic_data import dynamic_forward_step, keeps_max_logit, sequence_parallel_size
from megatron_2d_dev.megatron_cpu import cuda_to_cpu
from megatron_2d_dev.tiny_gpt import (
    TinyGPTConfig,
    all_reduce_sequence_parallel_grads,
    build_tiny_gpt,
    full_gradients,
    init_parallel,
    make_transformer_config,
    megatron_grad_norm,
)

Sample = dict[str, torch.Tensor]


def packed_samples(lengths: list[list[int]], vocab: int, seed: int = 0, masked_prompt: int = 2) -> list[Sample]:
    """One packed sample per entry of ``lengths`` (its sequences' lengths), as SFTDataset gives them: tokens,
    labels, loss_mask (each sequence's first ``masked_prompt`` tokens masked, as a prompt), position_ids
    restarting at each sequence, ``cu_seqlens`` padded to the sample's length + 1 with its last entry (so that
    samples collate), ``max_seqlen``. Deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for doc_lengths in lengths:
        total = sum(doc_lengths)
        stream = torch.randint(0, vocab, (total + 1,), generator=gen)
        mask = torch.ones(total)
        positions = torch.cat([torch.arange(n) for n in doc_lengths])
        cu = np.concatenate([[0], np.cumsum(doc_lengths)])
        for start, n in zip(cu[:-1], doc_lengths):
            mask[start : start + min(masked_prompt, n - 1)] = 0.0
        cu_padded = torch.full((total + 1,), total, dtype=torch.int32)
        cu_padded[: len(cu)] = torch.from_numpy(cu).to(torch.int32)
        samples.append(
            {
                "tokens": stream[:-1].clone(),
                "labels": stream[1:].clone(),
                "loss_mask": mask,
                "position_ids": positions,
                "cu_seqlens": cu_padded,
                "max_seqlen": torch.tensor(max(doc_lengths), dtype=torch.int32),
            }
        )
    return samples


def sequence_samples(
    lengths: list[int], packs: list[list[int]], padded: list[list[int]], vocab: int, seed: int = 0
) -> list[Sample]:
    """Packed samples of the sequences ``lengths[i]``, sample k holding the sequences ``packs[k]`` each in
    ``padded[k][j]`` slots (its real tokens, then padding: token 0, loss mask 0, positions continued). Sequence i's
    tokens are drawn from (seed, i) alone and its first 2 tokens masked as a prompt, so two packings of the same
    sequences train the same data."""
    samples = []
    for pack, slots in zip(packs, padded):
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("tokens", "labels", "loss_mask", "position_ids")}
        for i, n_slots in zip(pack, slots):
            n = lengths[i]
            stream = torch.randint(0, vocab, (n + 1,), generator=torch.Generator().manual_seed(seed * 1_000_003 + i))
            pad = n_slots - n
            mask = torch.ones(n)
            mask[: min(2, n - 1)] = 0.0
            parts["tokens"].append(torch.cat([stream[:-1], torch.zeros(pad, dtype=stream.dtype)]))
            parts["labels"].append(torch.cat([stream[1:], torch.zeros(pad, dtype=stream.dtype)]))
            parts["loss_mask"].append(torch.cat([mask, torch.zeros(pad)]))
            parts["position_ids"].append(torch.arange(n_slots))
        total = sum(slots)
        cu = torch.full((total + 1,), total, dtype=torch.int32)
        cu[: len(slots) + 1] = torch.tensor(np.concatenate([[0], np.cumsum(slots)]), dtype=torch.int32)
        samples.append(
            {
                **{k: torch.cat(v) for k, v in parts.items()},
                "cu_seqlens": cu,
                "max_seqlen": torch.tensor(max(slots), dtype=torch.int32),
            }
        )
    return samples


def _sequences(samples: list[Sample]) -> list[Sample]:
    """Every sequence of ``samples``, each as its own 1-D sub-sample (what Megatron's unpack_batch cuts)."""
    out = []
    for sample in samples:
        cu = sample["cu_seqlens"].tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            if end > start:
                out.append({k: sample[k][start:end] for k in ("tokens", "labels", "loss_mask", "position_ids")})
    return out


def reference_step(cfg: TinyGPTConfig, samples: list[Sample]) -> dict[str, Any]:
    """The CP = 1 training step of every sequence of ``samples`` on this rank alone (module docstring): ``loss``,
    ``grad_norm``, ``grads`` (by canonical name). Each sequence is its own micro-batch, as under hybrid CP, so
    per-micro-batch statistics (MoE auxiliary losses) are those of one sequence; its summed loss is backpropagated
    and the gradients divided by the token count at the end, as Megatron's ``finalize_model_grads`` does with
    per-token loss (``calculate_per_token_loss``, which hybrid CP needs: a MoE router then weighs its losses by
    the micro-batch's tokens, and the schedule adds them unscaled)."""
    init_parallel(context_parallel_size=1, seed=cfg.seed)
    cfg = replace(cfg, config_overrides=dict(cfg.config_overrides, calculate_per_token_loss=True))  # as hybrid CP's
    config = make_transformer_config(cfg)
    model = build_tiny_gpt(cfg, reference_spec(config), config)
    if config.num_moe_experts:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # what the schedule sets with per-token loss
    sequences = _sequences(samples)
    total = sum(float(s["loss_mask"].sum()) for s in sequences)
    loss = torch.zeros(())
    for s in sequences:
        per_token = model(
            input_ids=s["tokens"].unsqueeze(0),
            position_ids=s["position_ids"].unsqueeze(0),
            attention_mask=None,
            labels=s["labels"].unsqueeze(0),
        )
        part = (per_token.float() * s["loss_mask"].unsqueeze(0)).sum()
        part.backward()
        loss = loss + part.detach()
    for param in model.parameters():
        if param.grad is not None:
            param.grad /= total
    return {"loss": loss / total, "grads": full_gradients(model), "grad_norm": megatron_grad_norm(model)}


def reference_spec(config):
    """The CP = 1 reference's layer spec: Megatron's local GPT spec (its MoE decoder block spec for a MoE config)."""
    from megatron_2d.megatron.spec import megatron_gpt_spec

    return megatron_gpt_spec(config, use_transformer_engine=False) if config.num_moe_experts else None


def dynamic_config(cfg: TinyGPTConfig, max_seqlen_per_rank: int, layouts: str | None) -> TinyGPTConfig:
    """``cfg`` for the 2d backend under hybrid CP: TransformerConfig2D with hybrid_context_parallel,
    max_seqlen_per_dp_cp_rank, per-token loss, no RoPE fusion, and ``layouts`` (cp_2d_dynamic_layouts)."""
    overrides = dict(
        cfg.config_overrides,
        hybrid_context_parallel=True,
        max_seqlen_per_dp_cp_rank=max_seqlen_per_rank,
        calculate_per_token_loss=True,
        apply_rope_fusion=False,
        cp_2d_dynamic_layouts=layouts,
    )
    return replace(cfg, cp_comm_type="2d", config_class=TransformerConfig2D, config_overrides=overrides)


def _loss_func(loss_mask, per_token):
    """pretrain_gpt.py's loss: (sum over this rank's tokens, their count, report)."""
    loss = (per_token.view(-1).float() * loss_mask.view(-1).float()).sum()
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().clone().view(1), tokens.view(1).float()])}


def hybrid_forward_step(data_iterator, model, seen: list | None = None, loss=None):
    """pretrain_gpt.py's forward_step on a hybrid sub-sample, wrapped by the bridge as the patched pretrain_gpt.py
    wraps it (:func:`megatron_2d.megatron.dynamic_data.dynamic_forward_step`: TP rank 0, which holds the data, pads
    it for the CP and TP splits; a MoE model is called with the padding mask of that padding, a model keeping the
    max attention logit with PackedSeqParams that say where it starts); records the
    sub-sample's (length, CP size) in ``seen`` (TP rank 0). ``loss(loss_mask, output)``: pretrain_gpt.py's (sum,
    count, report) by default."""
    from megatron.core.utils import get_model_config

    if data_iterator is not None and seen is not None:
        raw = next(data_iterator)
        seen.append((int(raw["tokens"].shape[0]), int(raw["local_cp_size"])))
        data_iterator = iter([raw])
    config = get_model_config(model)
    step = dynamic_forward_step(
        partial(_pretrain_forward_step, loss=loss),
        sequence_parallel_size(config),
        moe=bool(config.num_moe_experts),
        max_logit=keeps_max_logit(config),
    )
    return step(data_iterator, model)


def _pretrain_forward_step(data_iterator, model, loss=None):
    """pretrain_gpt.py's forward_step under hybrid CP on a bridged batch: Megatron's broadcast over TP, flatten and
    hybrid CP split, its PackedSeqParams, the model, the loss."""
    from megatron.core.utils import (
        flatten_batch_for_packed_sequences,
        get_batch_on_this_cp_rank,
        get_batch_on_this_tp_rank,
    )

    batch = {}
    if data_iterator is not None:  # TP rank 0: the hybrid schedule gives the others None
        batch = next(data_iterator)
        batch.setdefault("cu_seqlens_padded", None)  # pretrain_gpt.py's get_batch gives every key it reads
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=True,
        is_hybrid_cp=True,
        create_attention_mask_in_dataloader=False,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=parallel_state.get_context_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        micro_batch_size=1,
        seq_length=0,  # hybrid CP broadcasts each sub-sample's length
        mtp_on_this_rank=False,
    )
    batch = flatten_batch_for_packed_sequences(batch)
    batch = get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=True,
        cp_group=parallel_state.get_context_parallel_group(),
        hybrid_cp_group_func=parallel_state.get_hybrid_data_context_parallel_groups,
    )
    cu = batch["cu_seqlens"].squeeze(0)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=int(batch["max_seqlen"].item()),
        max_seqlen_kv=int(batch["max_seqlen"].item()),
        local_cp_size=int(batch["local_cp_size"].item()),
        cp_group=batch.get("hybrid_cp_group"),
    )
    out = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        packed_seq_params=params,
    )
    return out, partial(_loss_func if loss is None else loss, batch["loss_mask"])


def _dp_share(samples: list[Sample], dp: int) -> list[Sample]:
    """This rank's data-parallel share of the global batch (samples dealt round-robin over the DP ranks)."""
    return samples[parallel_state.get_data_parallel_rank() :: dp]


def hybrid_model(
    cfg: TinyGPTConfig,
    context_parallel_size: int,
    max_seqlen_per_rank: int,
    layouts: str | None = None,
    tensor_model_parallel_size: int = 1,
) -> tuple[torch.nn.Module, Any]:
    """(model, its TransformerConfig2D) on this world under hybrid CP (parallel state initialized here, with
    ``hybrid_context_parallel=True``; DP = world / (TP x CP)), built with the 2d GPT spec (sequence parallelism:
    ``sequence_parallel`` in ``cfg.config_overrides``, built inside a norm route of megatron_2d_dev.sp_norms)."""
    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d

    init_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        context_parallel_size=context_parallel_size,
        seed=cfg.seed,
        hybrid_context_parallel=True,
    )
    dyn = dynamic_config(cfg, max_seqlen_per_rank, layouts)
    config = make_transformer_config(dyn)
    return build_tiny_gpt(dyn, get_gpt_layer_spec_2d(config, use_transformer_engine=False), config), config


def hybrid_train_step(model, config, samples: list[Sample], seen: list | None = None) -> list[dict]:
    """Forward and backward of this rank's DP share of ``samples`` through Megatron's hybrid CP (data wrapper,
    scheduler, schedule; under TP only the first TP rank reads it, as in Megatron), then the gradients summed over
    the DP x CP group (DDP's reduction, unscaled) and, under sequence parallelism, the norms' over TP
    (finalize_model_grads'); the loss reports. ``seen`` collects each sub-sample's (length, CP size)."""
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mine = _dp_share(samples, parallel_state.get_data_parallel_world_size())
    model.zero_grad(set_to_none=True)
    with cuda_to_cpu():
        wrapper = HybridCPDataLoaderWrapper(iter([mine]), config)
        reports = get_forward_backward_func()(
            forward_step_func=partial(hybrid_forward_step, seen=seen),
            data_iterator=iter(wrapper),
            model=[model],
            num_microbatches=len(mine),
            seq_length=int(max(int(s["cu_seqlens"][-1]) for s in samples)),
            micro_batch_size=1,
            forward_only=False,
        )
    reduce_gradients(model)
    all_reduce_sequence_parallel_grads(model)
    return reports


def reduce_gradients(model) -> None:
    """Every gradient summed over the DP x CP group in one flat all-reduce (as Megatron's DDP buckets do)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def hybrid_step(
    cfg: TinyGPTConfig,
    samples: list[Sample],
    context_parallel_size: int,
    max_seqlen_per_rank: int,
    layouts: str | None = None,
    tensor_model_parallel_size: int = 1,
) -> dict[str, Any]:
    """One training step of ``samples`` under Megatron's hybrid CP with the 2d backend on this world (DP = world /
    (TP x CP)): ``loss``, ``grad_norm``, ``grads`` like :func:`reference_step`, plus ``sizes``: every (sequence
    length, CP group size) the DP x CP ranks ran, gathered (from the first TP rank, which reads the data), and
    ``sequence_parallel``: whether it ran sequence parallelism (at TP > 1)."""
    model, config = hybrid_model(cfg, context_parallel_size, max_seqlen_per_rank, layouts, tensor_model_parallel_size)
    seen: list[tuple[int, int]] = []
    reports = hybrid_train_step(model, config, samples, seen)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    total = torch.tensor(float(sum(float(s["loss_mask"].sum()) for s in samples)))
    for param in model.parameters():
        if param.grad is not None:
            param.grad /= total
    local = torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else torch.zeros(2)
    dist.all_reduce(local, group=group)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    sizes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, seen, group=group)
    return {
        "loss": local[0] / total,
        "grads": full_gradients(model),
        "grad_norm": megatron_grad_norm(model),
        "sizes": sorted(x for part in sizes for x in part),
        "sequence_parallel": bool(config.sequence_parallel) and tp > 1,
    }


# -- the static run: one CP size for every sequence, packed samples ---------------------------------------------------


def static_model(
    cfg: TinyGPTConfig, context_parallel_size: int, head_parallel_size: int, inner_ring_size=None, placement=None
) -> torch.nn.Module:
    """The model on this world at a static CP size with one 2D layout (DP = world / CP), the 2d GPT spec."""
    from megatron_2d.megatron.spec import get_gpt_layer_spec_2d

    init_parallel(context_parallel_size=context_parallel_size, seed=cfg.seed)
    fields = dict(cp_2d_head_parallel_size=head_parallel_size, cp_2d_inner_ring_size=inner_ring_size)
    if placement is not None:
        fields["cp_2d_placement"] = placement
    static = replace(
        cfg,
        cp_comm_type="2d",
        config_class=TransformerConfig2D,
        config_overrides=dict(cfg.config_overrides, calculate_per_token_loss=True, **fields),
    )
    config = make_transformer_config(static)
    return build_tiny_gpt(static, get_gpt_layer_spec_2d(config, use_transformer_engine=False), config)


def _static_forward_step(data_iterator, model):
    """pretrain_gpt.py's --sft forward step at a static CP size: Megatron's per-document zigzag split (TE's, done by
    megatron_2d.megatron.packed_data without TE) and THD PackedSeqParams."""
    from megatron_2d.megatron.packed_data import get_thd_batch_on_this_cp_rank_2d

    sample = next(data_iterator)
    batch = {k: sample[k].unsqueeze(0) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    cu = sample["cu_seqlens"]
    cu = torch.unique_consecutive(cu)  # drop the collate padding (trailing copies of the last entry)
    batch = get_thd_batch_on_this_cp_rank_2d(dict(batch, cu_seqlens=cu), parallel_state.get_context_parallel_group())
    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    out = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        packed_seq_params=params,
    )
    return out, partial(_loss_func, batch["loss_mask"])


def static_train_step(model, samples: list[Sample]) -> list[dict]:
    """Forward and backward of this rank's DP share of ``samples`` (packed, one micro-batch each) through Megatron's
    no-pipelining schedule, then the gradients summed over the DP x CP group; the loss reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mine = _dp_share(samples, parallel_state.get_data_parallel_world_size())
    model.zero_grad(set_to_none=True)
    with cuda_to_cpu():
        reports = get_forward_backward_func()(
            forward_step_func=_static_forward_step,
            data_iterator=iter(mine),
            model=[model],
            num_microbatches=len(mine),
            seq_length=int(mine[0]["tokens"].shape[0]) if mine else 1,
            micro_batch_size=1,
            forward_only=False,
        )
    reduce_gradients(model)
    return reports


def static_step(
    cfg: TinyGPTConfig, samples: list[Sample], context_parallel_size: int, head_parallel_size: int, **layout
):
    """One training step of packed ``samples`` at a static CP size: ``loss``, ``grad_norm``, ``grads`` like
    :func:`reference_step` (every sequence of a sample must be a multiple of 2 x CP, as SFTDataset pads them)."""
    model = static_model(cfg, context_parallel_size, head_parallel_size, **layout)
    reports = static_train_step(model, samples)
    total = torch.tensor(float(sum(float(s["loss_mask"].sum()) for s in samples)))
    for param in model.parameters():
        if param.grad is not None:
            param.grad /= total
    local = torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else torch.zeros(2)
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return {"loss": local[0] / total, "grads": full_gradients(model), "grad_norm": megatron_grad_norm(model)}


def packed_microbatch_step(model, sample: Sample, group_size: int) -> dict[str, Any]:
    """One hybrid-CP micro-batch holding several sequences (``sample``: one packed sample, cu_seqlens of its
    documents), run by every slice of ``group_size`` ranks of the DP x CP group at once, split per sequence over
    the slice as ``get_batch_on_this_cp_rank`` splits hybrid batches (how Megatron's dev branch packs hybrid
    micro-batches; 0.19.2 sends one sequence each): ``loss`` (sum / tokens) and ``grads``, summed over the slices
    and divided by their count (each slice ran the whole sample)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    cu = torch.unique_consecutive(sample["cu_seqlens"])
    batch = {k: sample[k].unsqueeze(0) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    batch.update(cu_seqlens=cu.unsqueeze(0), local_cp_size=torch.tensor([group_size], dtype=torch.int32))
    batch = get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=True,
        cp_group=parallel_state.get_context_parallel_group(),
        hybrid_cp_group_func=parallel_state.get_hybrid_data_context_parallel_groups,
    )
    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        local_cp_size=group_size,
        cp_group=batch.get("hybrid_cp_group"),
    )
    model.zero_grad(set_to_none=True)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
    tokens = float(sample["loss_mask"].sum())
    local = (out.float() * batch["loss_mask"]).sum()
    (local / tokens).backward()
    slices = parallel_state.get_data_parallel_world_size(with_context_parallel=True) // group_size
    reduce_gradients(model)
    for param in model.parameters():
        if param.grad is not None:
            param.grad /= slices
    total = local.detach().clone()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return {"loss": total / slices / tokens, "grads": full_gradients(model), "grad_norm": megatron_grad_norm(model)}
