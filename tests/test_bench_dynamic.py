"""tools/bench_dynamic.py's stock rows on CPU ranks, without timing: stock dynamic CP (megatron-core's hybrid CP over
its own TEDotProductAttention and Transformer Engine's p2p, with Megatron-LM #6821's two fixes) and static stock CP
(TE's p2p over THD) run TE's context parallelism and train the step static 2D trains (bf16 training bound); the
fixes are undone after the step; the refusals (fp32 with a stock row, TE's final norm under the stock spec).

One forked world of 4 ranks, TE 2.20.2 entered by the parent as the benchmark enters it (the CUDA claim only around
TE's attention), a long-tail mix whose sequences run on groups of 1 (TE's CP off) and 4.
"""

from __future__ import annotations

import pytest
import torch

from megatron_2d.layout.dynamic import megatron_cp_size
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import TOLERANCES
from megatron_2d_dev.bench import dynamic as bench

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

JOB = bench.Job(
    "long-tail", 384, 16, 1, 64, 8, 2, None, 1, 0, dtype="bf16"
)  # head dim 8: TE's fused attention takes it
ROWS = ("static 2D", "stock dynamic CP", "static stock CP")


def _rank(rank, world):
    from megatron.core.transformer import attention, transformer_block

    from megatron_2d_dev.stock_cp_spec import gpt_layer_spec_stock_cp
    from megatron_2d_dev.te_context_parallel import active

    te = active()
    extension = te.megatron_extension

    def patched():  # what hybrid_cp_fixes changes (the stream: None until a model with a static CP > 1 is built)
        return attention.Attention.forward, attention.apply_rotary_pos_emb, extension.TEDotProductAttention.cp_stream

    out = {}
    for row in ROWS:  # static stock CP last: its model allocates TE's CP stream
        step = bench.build_row(row, JOB, world)
        before = patched()
        te.extension.calls.clear()
        loss = bench._loss(step())
        out[row] = {
            "loss": float(loss[0] / loss[1]),
            "calls": dict(te.extension.calls),
            "restored": patched() == before,
        }
    config = bench.tiny_config(JOB)
    norm = transformer_block.LayerNormImpl
    transformer_block.LayerNormImpl = type("TENorm", (), {"__module__": extension.__name__})
    try:
        gpt_layer_spec_stock_cp(config)
        out["te norm"] = None
    except RuntimeError as err:
        out["te norm"] = str(err)
    finally:
        transformer_block.LayerNormImpl = norm
    return out


def test_stock_rows_run_te_context_parallelism_and_train_alike():
    sizes = {megatron_cp_size(n, JOB.max_seqlen_per_rank) for n in bench.sequences(JOB)}
    assert sizes == {1, 4} and bench.static_cp(JOB, 4) == 4, sizes  # CP off and on within one step
    with bench.stock_context(bench.TE_RELEASE):
        results = run_on_ranks(4, _rank, timeout_s=180)
    bound = TOLERANCES[torch.bfloat16].training.loss
    for rank, got in enumerate(results):
        reference = got["static 2D"]["loss"]
        for row in ROWS[1:]:
            assert abs(got[row]["loss"] - reference) <= bound * reference, (rank, row, got[row]["loss"], reference)
            calls = got[row]["calls"]  # TE's fused attention, and its THD context parallelism at CP 4
            assert calls.get("fused_attn_fwd", 0) > 0 and calls.get("fused_attn_bwd", 0) > 0, (rank, row, calls)
            assert calls.get("thd_out_correction", 0) > 0 and calls.get("thd_grad_correction", 0) > 0, (row, calls)
        assert got["static 2D"]["calls"] == {}, got["static 2D"]["calls"]  # ours: no TE
        assert all(got[row]["restored"] for row in ROWS), got
        assert "first imported inside Transformer Engine's CPU context" in (got["te norm"] or ""), got["te norm"]


def test_stock_rows_refuse_fp32():
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rows", "static 2D", "static stock CP", "--dtype", "fp32"])
    assert exit_info.value.code == 2
