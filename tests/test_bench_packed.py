"""The packed benchmark's pieces: the blockwise fp64 reference it uses (testing.reference's, over cu_seqlens)
equals the dense one, its rows pass their checks."""

from __future__ import annotations

import pytest
import torch

from megatron_2d.packing.sharding import zigzag_slots
from megatron_2d.plan.lengths import cu_seqlens_of
from megatron_2d.testing.reference import blockwise_reference, packed_reference_attention
from megatron_2d_dev.bench.packed import main, slot_pairs


@pytest.mark.parametrize(
    "causal, window, kv_heads", [(True, (-1, -1), 3), (True, (9, 0), 1), (False, (4, 6), 1), (False, (-1, -1), 3)]
)
def test_blockwise_reference_over_documents_equals_the_dense_reference_and_autograd(causal, window, kv_heads):
    g = torch.Generator().manual_seed(1)
    cu = cu_seqlens_of([1, 37, 5, 70])
    T = int(cu[-1])
    q, do = (torch.randn(T, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(T, kv_heads, 8, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    expected = packed_reference_attention(*leaves, cu, causal=causal, scale=0.3, window=window)
    expected.backward(do)
    for max_elements in (3 * 16 * 70, 2**24):  # blocks of 16 rows of the longest document; one block each
        got = blockwise_reference(q, k, v, do, cu, causal=causal, window=window, scale=0.3, max_elements=max_elements)
        for a, e in zip(got, [expected.detach()] + [x.grad for x in leaves]):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_slot_pairs_counts_causal_pairs_per_rank():
    cu = cu_seqlens_of([3, 4])
    slots = zigzag_slots(cu, 2)  # [[0, -1, 3, 6], [1, 2, 4, 5]]
    assert slot_pairs(slots, cu).tolist() == [1 + 1 + 4, 2 + 3 + 2 + 3]
    assert slot_pairs(slots, cu).sum() == 6 + 10


@pytest.mark.distributed
def test_every_row_is_checked_and_ours_pass(capsys, tmp_path):
    main(
        [
            "--ranks",
            "2",
            "--tokens",
            "512",
            "--repeats",
            "1",
            "--dists",
            "one-half",
            "--heads",
            "2",
            "--dim",
            "16",
            "--cache",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    for row in ("zigzag", "documents (", "sequence", "one sequence", "ring-flash-attn fp64"):
        line = next(l for l in out.splitlines() if l.startswith("│") and f" {row}" in l)
        assert "ok " in line and "not timed" not in line, line
    # ring-flash-attn 0.1.8's fp32 backward aliases a reused buffer: the check catches it
    assert "FAIL" in next(l for l in out.splitlines() if l.startswith("│") and "ring-flash-attn │" in l)
    assert "n/a" in next(l for l in out.splitlines() if l.startswith("│") and "TE 2.20.2" in l)  # fp32: no TE rows
    assert "documents mode's cost model (measured: pair" in out and " * │" in out  # its choice, explained


@pytest.mark.distributed
def test_te_thd_rows_beside_ours_in_bf16(capsys, tmp_path):
    """--dtype bf16: every row in bf16, and Transformer Engine's own THD context parallelism (2.20.2 on CPU ranks:
    p2p, a2a, all_gather at CP 2) on the same batch, each checked against fp64 and timed; in fp32 the TE rows say
    why they cannot run."""
    args = ["--ranks", "2", "--tokens", "512", "--repeats", "1", "--dists", "one-half", "--heads", "2", "--dim", "16"]
    main(args + ["--cache", str(tmp_path), "--dtype", "bf16", "--no-sequence", "--no-ring-flash"])
    out = capsys.readouterr().out
    for row in ("zigzag", "documents (", "TE p2p", "TE a2a", "TE all_gather"):
        line = next(l for l in out.splitlines() if l.startswith("│") and f" {row}" in l)
        assert "ok " in line and "not timed" not in line, line
    assert "Transformer Engine 2.20.2's own THD context parallelism" in out


def test_layout_build_table():
    from megatron_2d_dev.bench.packed import layout_build_times

    table = layout_build_times(40, [(4, 2)])
    assert table.row_count == 3 and [c.header for c in table.columns][:3] == ["CP", "hp x cp", "mode"]
