"""tools/bench_attention.py (megatron_2d_dev.bench.attention): every layout gets a row, with both efficiencies and the
bytes it sent. No timing is asserted (the machines are noisy): only that the times are positive and finite and
that the byte counts are the layouts' exact ones."""

from __future__ import annotations

import json
import math

import pytest

from megatron_2d_dev.bench import attention as bench_attention

pytestmark = pytest.mark.distributed


def test_every_layout_has_a_row_with_exact_bytes(tmp_path):
    out = tmp_path / "rows.json"
    # 2 ranks, 64 tokens (32 per rank), 2 query heads, 2 K/V heads, d 8, fp32: one tensor is 32*2*8*4 = 2 KiB
    bench_attention.main(
        [
            "--ranks",
            "2",
            "--seq",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "2",
            "--dim",
            "8",
            "--repeats",
            "2",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    rows = {row["label"]: row for row in saved["rows"]}
    assert set(rows) == {"hp1 x cp2  w2  head_first", "hp2 x cp1  w1  head_first"}  # w1 = w2 at cp 2: listed once
    for row in rows.values():
        assert math.isfinite(row["seconds"]) and row["seconds"] > 0
        assert 0 < row["efficiency"] < math.inf and 0 < row["efficiency_alone"] < math.inf
    assert set(saved["single_s"]) == {"alone", "busy"} and saved["cores_shared"] >= 1
    tensor = 32 * 2 * 8 * 4
    # hp 2: q, k, v, out forward and dout, dq, dk, dv backward, half of each to the other head rank
    assert rows["hp2 x cp1  w1  head_first"]["bytes_sent"] == {
        "all_to_all": 8 * tensor // 2,
        "inner_ring": 0,
        "outer_ring": 0,
        "neighbour": 0,
    }
    # cp 2: K/V once forward and once backward, the fp32 dK/dV rider once (the neighbour's block, back to it)
    ring = 2 * (2 * tensor) + 2 * tensor
    assert rows["hp1 x cp2  w2  head_first"]["bytes_sent"]["inner_ring"] == ring


def test_the_max_logit_benchmark_gives_every_kernel_and_mask_a_row(tmp_path):
    """tools/bench_max_logit.py (megatron_2d_dev.bench.max_logit): a row per CPU kernel and mask, times positive and
    finite both ways (no timing asserted)."""
    from megatron_2d_dev.bench import max_logit as bench_max_logit

    out = tmp_path / "rows.json"
    flags = "--ranks 2 --hp 2 --seq 64 --heads 2 --kv-heads 1 --dim 8 --window 5 --repeats 1 --quiet"
    bench_max_logit.main([*flags.split(), "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["kernel"], r["mask"]) for r in rows} == {
        (k, m) for k in bench_max_logit.KERNELS for m in ("causal", "full", "causal window 5")
    }
    for r in rows:
        values = [r[f"{what}{part}"] for what in ("step", "forward") for part in ("_s", "_max_logit_s", "_ratio")]
        assert all(math.isfinite(x) and x > 0 for x in values), r
