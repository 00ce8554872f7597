"""Generated exactness cases (megatron_2d.testing.generated_cases) on forked ranks: a fixed budget of seeded draws
in CI; ``make fuzz`` runs as many as asked. A failure names its replay command."""

from __future__ import annotations

import pytest
import torch

from megatron_2d.layout.choices import PACKING_MODES
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.flash_attn_package import RELEASES
from megatron_2d.testing.generated_cases import (
    FLASH_KERNELS,
    PoisonedEmpty,
    draw_batch,
    draw_case,
    expected_results,
    failures,
    run_batch,
)

BATCHES = range(24)  # 24 forked batches x 8 draws: about a minute and a half on 2 cores
DRAWS_PER_BATCH = 8


def ci_draws():
    return [
        (draw_batch(seed), [draw_case(draw_batch(seed), i, PACKING_MODES) for i in range(DRAWS_PER_BATCH)])
        for seed in BATCHES
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("seed", BATCHES, ids=lambda s: f"batch{s}")
def test_generated_draws_match_the_per_document_reference(seed):
    batch = draw_batch(seed)
    draws = [draw_case(batch, i, PACKING_MODES) for i in range(DRAWS_PER_BATCH)]
    expected = [expected_results(d) for d in draws]
    per_rank = run_on_ranks(batch.world, run_batch, batch, draws, expected, timeout_s=180)
    problems = failures(batch, draws, per_rank, [e[-1] for e in expected])
    assert not problems, "\n".join(problems)


def test_the_ci_draws_cover_what_hand_picked_cases_miss():
    """The fixed budget reaches every corner the generator is for (a change to the generator that loses one
    fails here, not silently)."""
    batches = ci_draws()
    draws = [d for _, ds in batches for d in ds]
    worlds = {b.world for b, _ in batches}
    assert (
        worlds >= {3, 4, 6, 8}
        and len(worlds) >= 6
        and {b.placement for b, _ in batches} == {"head_first", "context_first"}
    )
    assert any(b.hp > 1 and b.cp > 1 and 1 < b.w < b.cp for b, _ in batches)  # 2D with a double ring
    assert any(b.hp > 1 and list(b.rank_order) != sorted(b.rank_order) for b, _ in batches)  # cp_rank_lists
    assert {d.mode for d in draws} == {None, *PACKING_MODES}
    packed = [d for d in draws if d.mode is not None]
    assert any(d.lengths.count(1) >= 20 for d in packed)  # one-token documents
    assert any(len(d.lengths) >= 100 for d in packed)  # hundreds of tiny ones
    assert any(max(d.lengths) > sum(d.lengths) - max(d.lengths) + 20 for d in packed)  # one giant document
    assert any(d.end_padding for d in packed)
    assert any(d.window != (-1, -1) and d.causal for d in draws)
    assert any(d.window != (-1, -1) and not d.causal for d in draws)
    assert any(d.sinks for d in draws) and any(not d.causal for d in draws)
    assert any(d.hkv < b.hp for b, ds in batches for d in ds)  # K/V replication
    assert any(d.batch == 2 for d in draws)
    assert {d.kernel for d in draws} == {"cpu_flash", "torch_math", *FLASH_KERNELS}
    assert set(FLASH_KERNELS) == {"flash_attn2", "torch_flash", "torch_cudnn"}
    assert all((d.dtype == "bfloat16") == (d.kernel in FLASH_KERNELS) for d in draws)
    for kernel in FLASH_KERNELS:  # the calls whose tall blocks flash-attn's C++ would give other windows
        windowed = [d for d in packed if d.kernel == kernel and not d.causal and d.window != (-1, -1)]
        assert len(windowed) >= 3 and {d.mode for d in windowed} >= {"zigzag", "sequence"}, kernel
    assert {b.flash_attn for b, ds in batches if any(d.kernel == "flash_attn2" for d in ds)} == set(RELEASES)
    assert {d.dkv_comm_dtype for d in draws} == {"accumulator", "input"}
    assert any(d.dv < d.d and d.mode is None for d in draws) and any(d.dv < d.d and d.mode for d in draws)


def test_draws_are_a_function_of_their_seed():
    batch = draw_batch(7)
    assert draw_batch(7) == batch and draw_case(batch, 3, PACKING_MODES) == draw_case(batch, 3, PACKING_MODES)
    assert draw_case(batch, 3, PACKING_MODES) != draw_case(batch, 4, PACKING_MODES)


def test_poisoned_allocations_read_as_nan():
    with PoisonedEmpty():
        fresh = [torch.empty(5), torch.empty_like(torch.zeros(3)), torch.zeros(2).new_empty(4)]
        ints = torch.empty(3, dtype=torch.int64)
    assert all(bool(torch.isnan(x).all()) for x in fresh)
    assert ints.dtype == torch.int64  # integer buffers are left alone (no NaN to put there)
