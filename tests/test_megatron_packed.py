"""Packed documents through a tiny GPTModel: the loss and every gradient at CP 4 and 8 equal the CP=1 run.

zigzag:    Megatron's own THD path: the batch padded per document (loss-masked pad tokens), split per document
           by ``get_thd_batch_on_this_cp_rank_2d`` (TE's partitioning), PackedSeqParams as pretrain_gpt.py
           builds them, Megatron's THD RoPE. The CP=1 run takes the same padded batch.
documents: our data path (``documents_batch_on_this_cp_rank``) and RoPE at document positions
           (``use_document_positions``); the CP=1 run takes the unpadded batch with Megatron's own THD path.
All runs share one fork of 8 ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_2d.megatron import TransformerConfig2D, destroy_2d_groups, get_gpt_layer_spec_2d
from megatron_2d.megatron.packed_data import (
    documents_batch_on_this_cp_rank,
    groups_of_model,
    use_document_positions,
)
from megatron_2d.packing.sharding import shard_documents
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d_dev import tiny_gpt as tg

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

LENGTHS = [5, 70, 13, 1, 150, 33, 40, 9, 100]
PAD_TO = 16  # a multiple of 2*CP for CP 1, 4 and 8
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, seq_length=512, seed=11)
LAYOUTS = {"cp4_2x2_w1": (4, (2, 1, "head_first")), "cp8_2x4_w2_context_first": (8, (2, 2, "context_first"))}
RTOL = 1e-5


def packed_stream(pad_to):
    """[1, T'] tokens, labels, loss_mask of the packed documents, each padded with loss-masked tokens to a
    multiple of ``pad_to`` (1: no padding); the real and padded cu_seqlens."""
    g = torch.Generator().manual_seed(5)
    tokens, labels, mask = [], [], []
    for n in LENGTHS:
        padded = -(-n // pad_to) * pad_to
        tokens.append(torch.randint(0, 128, (padded,), generator=g))
        labels.append(torch.randint(0, 128, (padded,), generator=g))
        mask.append((torch.arange(padded) < n).float())
    real = np.concatenate([[0], np.cumsum(LENGTHS)])
    padded = np.concatenate([[0], np.cumsum([-(-n // pad_to) * pad_to for n in LENGTHS])])
    batch = {"tokens": torch.cat(tokens)[None], "labels": torch.cat(labels)[None], "loss_mask": torch.cat(mask)[None]}
    return batch, torch.tensor(real, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)


def real_tokens(batch, cu_real, cu_padded):
    """The unpadded stream of a padded batch (same tokens and labels)."""
    keep = torch.cat(
        [torch.arange(int(a), int(a) + int(r1 - r0)) for a, r0, r1 in zip(cu_padded[:-1], cu_real[:-1], cu_real[1:])]
    )
    return {k: v.index_select(1, keep) for k, v in batch.items()}


CKPT_PLUS_PLUS = dict(
    recompute_granularity="full",
    recompute_method="uniform",
    recompute_num_layers=1,
    selective_checkpoint_plus_plus=True,
)


def config(cp_settings=None, packing="zigzag", **overrides):
    cfg = tg.TinyGPTConfig(**MODEL)
    if cp_settings is not None:
        hp, w, placement = cp_settings
        cfg.config_class, cfg.cp_comm_type = TransformerConfig2D, "2d"
        cfg.config_overrides = dict(
            cp_2d_head_parallel_size=hp,
            cp_2d_inner_ring_size=w,
            cp_2d_placement=placement,
            cp_2d_packing=packing,
            **overrides,
        )
    return cfg


def run_all(rank, world):
    spec = get_gpt_layer_spec_2d(use_transformer_engine=False)
    padded_batch, cu_real, cu_padded = packed_stream(PAD_TO)
    unpadded = real_tokens(padded_batch, cu_real, cu_padded)
    out = {}
    tg.init_parallel()
    out["ref_zigzag"] = tg.packed_forward_backward(
        tg.build_tiny_gpt(config(), spec), padded_batch, tg.megatron_thd_params(cu_real, cu_padded)
    )
    out["ref_documents"] = tg.packed_forward_backward(
        tg.build_tiny_gpt(config(), spec), unpadded, tg.megatron_thd_params(cu_real, cu_real)
    )
    for name, (cp, settings) in LAYOUTS.items():
        tg.init_parallel(context_parallel_size=cp)
        model = tg.build_tiny_gpt(config(settings), spec)
        local = tg.thd_batch_on_this_cp_rank(padded_batch, cu_real, cu_padded)
        out[(name, "zigzag")] = tg.packed_forward_backward(model, local, tg.megatron_thd_params(cu_real, cu_padded))
        model = use_document_positions(tg.build_tiny_gpt(config(settings, "documents"), spec))
        local, params = documents_batch_on_this_cp_rank(unpadded, groups_of_model(model), cu_real)
        out[(name, "documents")] = tg.packed_forward_backward(model, local, params)
        out[(name, "documents_stats")] = params.layout.stats()
        sharding = params.layout.sharding
        fair = sum(LENGTHS) / sharding.cp  # longer documents are always sharded (memory)
        out[(name, "documents_choice")] = (
            sharding.predicted_s,
            min(  # every k, placed for real
                shard_documents(cu_real.numpy(), sharding.cp, settings[0], long_threshold=t).predicted_s
                for t in [0] + sorted(LENGTHS)
                if t <= fair
            ),
        )
        # Selective Checkpoint++ (full-layer recompute that keeps attention) on packed batches
        model = use_document_positions(tg.build_tiny_gpt(config(settings, "documents", **CKPT_PLUS_PLUS), spec))
        local, params = documents_batch_on_this_cp_rank(unpadded, groups_of_model(model), cu_real)
        out[(name, "documents_ckpt++")] = tg.packed_forward_backward(model, local, params)
        # a batch of the other layout than the config says is refused, not run
        for packing, (batch_local, batch_params) in (
            ("zigzag", (local, params)),
            (
                "documents",
                (
                    tg.thd_batch_on_this_cp_rank(padded_batch, cu_real, cu_padded),
                    tg.megatron_thd_params(cu_real, cu_padded),
                ),
            ),
        ):
            try:
                tg.packed_forward_backward(
                    tg.build_tiny_gpt(config(settings, packing), spec), batch_local, batch_params
                )
            except ValueError as err:
                out[(name, "refused", packing)] = str(err)
    destroy_2d_groups()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(8, run_all, timeout_s=300)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["zigzag", "documents", "documents_ckpt++"])
def test_packed_gpt_matches_cp1(results, layout, mode):
    actual, expected = results[(layout, mode)], results[f"ref_{mode.split('_')[0]}"]
    assert actual["per_token_finite"]
    errors = tg.compare_results(actual, expected)
    assert len(expected["grads"]) >= 20
    bad = {k: e for k, e in errors.items() if not e < RTOL}
    assert not bad, f"relative errors above {RTOL}: {bad}"


def test_padding_changes_nothing_and_the_references_agree(results):
    """The two references see the same real tokens (one padded per document, loss-masked): equal losses."""
    errors = tg.compare_results(results["ref_zigzag"], results["ref_documents"])
    assert max(errors.values()) < RTOL, errors


def test_a_batch_in_the_other_layout_is_refused(results):
    for layout in LAYOUTS:
        assert (
            "expects packed batches in the 'zigzag' layout (cp_2d_packing 'zigzag') but the batch comes in the "
            "'documents' layout" in results[(layout, "refused", "zigzag")]
        )
        assert (
            "expects packed batches in the 'documents' layout (cp_2d_packing 'documents') but the batch comes in "
            "the 'zigzag' layout" in results[(layout, "refused", "documents")]
        )


def test_documents_layout_of_the_batch_is_the_cost_models_choice(results):
    for layout in LAYOUTS:
        chosen, best = results[(layout, "documents_choice")]
        assert chosen <= best + 1e-15, (layout, chosen, best)
