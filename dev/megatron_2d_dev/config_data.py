"""The batches of a generated Megatron configuration (:mod:`megatron_2d_dev.generated_configs`) as its data path
gives them to Megatron's schedule: sbhd samples, or packed THD sequences in the draw's packing mode (Megatron's
per-document zigzag with each document padded to 2 * CP and padding at the end, its per-sequence split with a filler
document, or the documents layout of :mod:`megatron_2d.megatron.packed_data`); the CP = 1 reference takes the real
documents unpadded. Under sequence parallelism every packed sequence is padded at its end by Megatron's rule (its
length a multiple of TP x 2 x CP; the reference's of 2 x TP, with a filler document out of the loss). Every rank
makes the same full batch; each takes its DP share and its CP split."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import ddp_harness as mcpu
from . import tiny_gpt as tg
from .config_models import VOCAB
from .generated_configs import Draw, Scenario


# ---- the data --------------------------------------------------------------------------------------------------------
def sbhd_batch(s: Scenario, iteration: int, samples: int) -> dict[str, torch.Tensor]:
    """[samples, s] tokens, labels, loss_mask (about one token in ten out of the loss), position_ids."""
    g = torch.Generator().manual_seed(s.seed * 7919 + iteration)
    stream = torch.randint(0, VOCAB, (samples, s.seq_length + 1), generator=g)
    loss_mask = (torch.rand(samples, s.seq_length, generator=g) > 0.1).float()
    return {
        "tokens": stream[:, :-1].contiguous(),
        "labels": stream[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(s.seq_length).unsqueeze(0).expand(samples, -1).contiguous(),
    }


def documents(s: Scenario, iteration: int, sequence: int) -> list[dict[str, torch.Tensor]]:
    """The documents of packed sequence ``sequence``: tokens, labels, loss_mask (some tokens out of the loss)."""
    g = torch.Generator().manual_seed((s.seed * 7919 + iteration) * 31 + sequence)
    out = []
    for n in s.lengths[sequence]:
        out.append(
            {
                "tokens": torch.randint(0, VOCAB, (n,), generator=g),
                "labels": torch.randint(0, VOCAB, (n,), generator=g),
                "loss_mask": (torch.rand(n, generator=g) > 0.2).float(),
            }
        )
    return out


def _pad(doc: dict[str, torch.Tensor], to: int) -> dict[str, torch.Tensor]:
    n = doc["tokens"].shape[0]
    return {k: torch.nn.functional.pad(v, (0, to - n)) for k, v in doc.items()}  # pad: token 0, label 0, mask 0


@dataclass
class PackedSequence:
    """One packed sequence as the draw's data path gives it to Megatron: [1, T] tensors and cu_seqlens; ``real`` is
    1 at the documents' tokens and 0 at the padding the data path adds (:func:`router_padding_mask`)."""

    batch: dict[str, torch.Tensor]
    cu_seqlens: torch.Tensor  # real documents (sequence mode: the filler document included)
    cu_seqlens_padded: torch.Tensor | None = None  # zigzag: each document padded to 2 * CP (the last to the end)

    @property
    def tokens(self) -> int:
        return self.batch["tokens"].shape[1]


def packed_sequence(draw: Draw, iteration: int, sequence: int, total: int | None) -> PackedSequence:
    """Packed sequence ``sequence`` of an iteration in the draw's packing mode, ``total`` slots long (the common
    length of the micro-batches under PP; None: as long as it needs)."""
    s, CP = draw.scenario, draw.context_parallel_size
    docs = [dict(d, real=torch.ones(d["tokens"].shape[0])) for d in documents(s, iteration, sequence)]
    lengths = [d["tokens"].shape[0] for d in docs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    granule = sequence_granule(draw)
    if (draw.reference and not draw.sequence_parallel) or s.data == "documents":
        cat = {k: torch.cat([d[k] for d in docs]) for k in docs[0]}
        return PackedSequence(_positions(cat, cu), cu)
    if s.data == "zigzag" and not draw.reference:
        padded = [-(-n // (2 * CP)) * 2 * CP for n in lengths]
        padded[-1] += s.end_padding * 2 * CP + (-sum(padded) - s.end_padding * 2 * CP) % granule
        if total is not None:
            padded[-1] += total - sum(padded)
        cat = {k: torch.cat([_pad(d, p)[k] for d, p in zip(docs, padded)]) for k in docs[0]}
        cu_padded = torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32)
        return PackedSequence(_positions(cat, cu_padded), cu, cu_padded)
    # sequence (and a sequence-parallel reference): a filler document (out of the loss) makes the stream a multiple
    # of the granule long
    real = sum(lengths)
    target = total if total is not None else -(-real // granule) * granule
    if target > real:
        docs.append(_pad({k: v[:0] for k, v in docs[0].items()}, target - real))
        lengths.append(target - real)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    cat = {k: torch.cat([d[k] for d in docs]) for k in docs[0]}
    return PackedSequence(_positions(cat, cu), cu)


def sequence_granule(draw: Draw) -> int:
    """What a packed sequence's length must be a multiple of: 2 x CP, and TP x 2 x CP under sequence parallelism
    (Megatron's rule: every CP rank's tokens split over TP)."""
    return 2 * draw.context_parallel_size * (draw.tp if draw.sequence_parallel else 1)


def _positions(cat: dict[str, torch.Tensor], cu: torch.Tensor) -> dict[str, torch.Tensor]:
    """[1, T] tensors with position_ids counting within each document of ``cu``."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    out = {k: v.unsqueeze(0) for k, v in cat.items()}
    out["position_ids"] = positions.unsqueeze(0)
    return out


def _common_length(draw: Draw, iteration: int, sequences: range) -> int | None:
    """The slots every micro-batch of this rank gets under PP (the schedule's p2p shapes are fixed), else None."""
    if draw.pp == 1 or draw.reference or draw.scenario.data == "documents":
        return None
    need = [packed_sequence(draw, iteration, i, None).tokens for i in sequences]
    return max(need)


def microbatches(draw: Draw, iteration: int) -> tuple[list[Any], int]:
    """This DP rank's micro-batches of one iteration and the sequence length the schedule is told."""
    from megatron.core import parallel_state

    s = draw.scenario
    dp_rank = parallel_state.get_data_parallel_rank()
    share = draw.scenario_batches
    if s.data == "sbhd":
        full = sbhd_batch(s, iteration, draw.scenario_batches * draw.dp)
        mine = {k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in full.items()}
        mbs = draw.micro_batch_size
        return [{k: v[i * mbs : (i + 1) * mbs] for k, v in mine.items()} for i in range(share // mbs)], s.seq_length
    sequences = range(dp_rank * share, (dp_rank + 1) * share)
    # every DP rank must tell the schedule the same length: the longest over the whole global batch
    total = _common_length(draw, iteration, range(share * draw.dp))
    packed = [packed_sequence(draw, iteration, i, total) for i in sequences]
    return packed, max(p.tokens for p in packed) if total is None else total


def masks_router_padding(draw: Draw) -> bool:
    """Whether the draw's model is called with the padding mask of its data path's padding: for the documents
    layout's MoE models (as examples/pretrain_gpt_2d.py calls them: the layout's padding is the 2d backend's), and
    for the MoE z-loss scenarios, whose z-loss would count the padding to 2 x CP (x TP) that a CP = 1 reference does
    not have (pretrain_gpt.py passes none: Megatron's z-loss at CP > 1 then differs from CP = 1's whatever the
    attention backend, docs/testing.md), so that it is compared with CP = 1's on the same real tokens. Not with the
    expert bias: megatron-core 0.19.2's router fails on a padding mask there (refused with the documents layout)."""
    s = draw.scenario
    documents = s.data == "documents" and draw.context_parallel_size > 1
    return s.moe and s.moe_router != "expert_bias" and (documents or s.moe_router == "z_loss")


def router_padding_mask(local: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[b, t] bool, True at this rank's padding tokens (the documents layout's ``padding``, else ``real`` 0), or
    None when it holds none."""
    padding = local.get("padding")
    if padding is None and local.get("real") is not None:
        padding = local["real"] == 0
    return padding if padding is not None and bool(padding.any()) else None


def forward_step(draw: Draw, data_iterator, model):
    """Megatron's forward_step for the draw's data path: this CP rank's share of the micro-batch, the model, and
    the per-token loss (sum, tokens, report); with :func:`masks_router_padding`, the padding mask of the data
    path's padding."""
    item = next(data_iterator)
    if isinstance(item, dict):  # sbhd
        local, params = tg.shard_batch_for_cp(item), None
    elif draw.scenario.data == "documents" and draw.context_parallel_size > 1:
        from megatron_2d.megatron.packed_data import (
            documents_batch_on_this_cp_rank,
            groups_of_model,
            use_document_positions,
        )

        gpt = use_document_positions(mcpu.unwrapped(model))
        local, params = documents_batch_on_this_cp_rank(item.batch, groups_of_model(gpt), item.cu_seqlens)
    else:
        padded = item.cu_seqlens_padded
        if draw.scenario.data == "sequence" and not draw.reference:  # Megatron's per-sequence split
            local = tg.shard_batch_for_cp(item.batch)
        else:
            local = tg.thd_batch_on_this_cp_rank(item.batch, item.cu_seqlens, padded)
            # ``real`` split like the tokens
            local["real"] = tg.thd_batch_on_this_cp_rank({"tokens": item.batch["real"]}, item.cu_seqlens, padded)[
                "tokens"
            ]
        cu = padded if padded is not None else item.cu_seqlens  # as pretrain_gpt.py / pretrain_hybrid.py build it
        params = tg.megatron_thd_params(cu, padded, total_tokens=int(cu[-1]))
    padding = router_padding_mask(local) if masks_router_padding(draw) else None
    output = model(
        input_ids=local["tokens"],
        position_ids=local["position_ids"],
        attention_mask=None,
        labels=local["labels"],
        packed_seq_params=params,
        **({} if padding is None else {"padding_mask": padding}),
    )
    return output, functools.partial(mcpu.per_token_loss, local["loss_mask"])


# ---- hybrid (dynamic) CP: Megatron's data wrapper unpacks the packed sequences ---------------------------------------
def dynamic_samples(draw: Draw, iteration: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's packed sequences of one iteration as SFTDataset gives them to Megatron's hybrid data wrapper
    (1-D tensors, cu_seqlens of the real documents, max_seqlen); the CP = 1 reference packs the same documents."""
    from megatron.core import parallel_state

    s, share = draw.scenario, draw.scenario_batches
    dp_rank = parallel_state.get_data_parallel_rank()
    out = []
    for sequence in range(dp_rank * share, (dp_rank + 1) * share):
        docs = documents(s, iteration, sequence)
        lengths = [d["tokens"].shape[0] for d in docs]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        cat = {k: torch.cat([d[k] for d in docs]) for k in docs[0]}
        cat["position_ids"] = _positions(cat, cu)["position_ids"][0]
        out.append({**cat, "cu_seqlens": cu, "max_seqlen": torch.tensor(max(lengths), dtype=torch.int32)})
    return out


def dynamic_forward_step(draw: Draw, data_iterator, model):
    """pretrain_gpt.py's forward step on one of Megatron's hybrid sub-samples (megatron_2d_dev.dynamic_cp), with
    the runs' per-token loss."""
    from .dynamic_cp import hybrid_forward_step

    return hybrid_forward_step(data_iterator, model, loss=mcpu.per_token_loss)
