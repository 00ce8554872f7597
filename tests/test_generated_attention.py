"""Generated exactness cases (megatron_2d_dev.generated_cases) on forked ranks: a fixed budget of seeded draws
in CI; ``make fuzz`` runs as many as asked. A failure names its replay command."""

from __future__ import annotations

from dataclasses import replace

import numpy.ma  # noqa: F401  np.unique imports it on first use
import pytest
import torch

# What every forked rank would import (and, without bytecode caching, compile) at its first draw: imported once here
import megatron_2d.attention  # noqa: F401
import megatron_2d.kernels  # noqa: F401
import megatron_2d.packed_sharding  # noqa: F401
import megatron_2d_dev.torch_cudnn_cpu  # noqa: F401
import megatron_2d_dev.torch_flash_cpu  # noqa: F401
from megatron_2d.layout.choices import PACKING_MODES
from megatron_2d.sequence_sharding import shard_sequence
from megatron_2d_dev.flash_attn_package import RELEASES
from megatron_2d_dev.generated_cases import (
    FLASH_KERNELS,
    PoisonedEmpty,
    draw_batch,
    draw_case,
    draw_sink_terms,
    expected_results,
    failures,
    run_batch,
)
from megatron_2d_dev.shared_worlds import run_each_on_ranks, selected_params

BATCHES = range(24)  # 24 forked batches x 8 draws: about a minute and a half on 2 cores
DRAWS_PER_BATCH = 8


def ci_draws():
    return [
        (draw_batch(seed), [draw_case(draw_batch(seed), i, PACKING_MODES) for i in range(DRAWS_PER_BATCH)])
        for seed in BATCHES
    ]


def shared_worlds(batches):
    """The batches grouped into forked worlds: one world size each, and at most one flash-attn release (a rank
    imports one release: :func:`megatron_2d_dev.flash_attn_package.load_release`), batches without flash_attn2 draws
    joining the first world of their size."""
    worlds: dict[tuple[int, str | None], list] = {}
    for batch, draws, expected in batches:
        release = batch.flash_attn if any(d.kernel == "flash_attn2" for d in draws) else None
        same_size = [key for key in worlds if key[0] == batch.world]
        key = next((k for k in same_size if release is None or k[1] in (None, release)), (batch.world, release))
        if key[1] is None and release is not None:  # the world takes its first release
            worlds[(batch.world, release)] = worlds.pop(key)
            key = (batch.world, release)
        worlds.setdefault(key, []).append((batch, draws, expected))
    return list(worlds.values())


@pytest.fixture(scope="module")
def batch_results(request):
    """The selected batches' results by seed: (batch, draws, expected, per rank), in shared forked worlds (a world
    costs more than most draws: megatron_2d_dev.shared_worlds)."""
    batches = []
    for seed in selected_params(request, "test_generated_draws_match_the_per_document_reference", "seed"):
        batch = draw_batch(seed)
        draws = [draw_case(batch, i, PACKING_MODES) for i in range(DRAWS_PER_BATCH)]
        batches.append((batch, draws, [expected_results(d) for d in draws]))
    results = {}
    for group in shared_worlds(batches):
        per_call = run_each_on_ranks(group[0][0].world, [(run_batch, b) for b in group], timeout_s=180)
        results.update({b[0].seed: (*b, per_rank) for b, per_rank in zip(group, per_call)})
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("seed", BATCHES, ids=lambda s: f"batch{s}")
def test_generated_draws_match_the_per_document_reference(batch_results, seed):
    batch, draws, expected, per_rank = batch_results[seed]
    problems = failures(batch, draws, per_rank, [e[-1] for e in expected], [e[-2] for e in expected])
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
    # the max logit (QK-clip) in every layout kind, mask and packing mode, with every kernel kind
    logits = [(b, d) for b, ds in batches for d in ds if d.max_logit]
    assert any(not d.max_logit for d in draws) and {d.mode for _, d in logits} == {None, *PACKING_MODES}
    assert any(b.hp > 1 and b.cp > 1 for b, _ in logits) and any(b.hp > 1 and 1 < b.w < b.cp for b, _ in logits)
    assert any(d.causal and d.window != (-1, -1) for _, d in logits) and any(not d.causal for _, d in logits)
    assert any(d.window != (-1, -1) and not d.causal for _, d in logits)
    assert (
        any(d.hkv < b.hp for b, d in logits) and any(d.sinks for _, d in logits) and any(d.dv < d.d for _, d in logits)
    )
    assert any(d.end_padding for _, d in logits) and any(d.batch == 2 for _, d in logits)
    assert {d.kernel for _, d in logits} == {"cpu_flash", "torch_math", *FLASH_KERNELS}


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


def _sink_failures(batch_seed: int, index: int, shares_of):
    """failures() of a draw whose ranks report only d sinks: ``shares_of(draw, terms)`` gives each rank's share
    (terms: the fp64 per-row terms, [T, b, hq]); every other output is reported exact."""
    batch = draw_batch(batch_seed)
    draw = draw_case(batch, index, PACKING_MODES)
    expected = expected_results(draw)
    results = [
        {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0, "finite": True, "padding_zero": True, "max_logit": expected[6]}
        | {"dsinks": share, "dsinks_expected": expected[4], "dsinks_scale": expected[5]}
        for share in shares_of(draw, draw_sink_terms(draw))
    ]
    return failures(batch, [draw], [[r] for r in results], [expected[-1]], [expected[6]])


def _rank_shares(world: int, missing: int | None = None):
    """Each CP rank's exact share of d sinks (its zigzag rows' terms summed); rank ``missing`` reports zero."""
    return lambda draw, terms: [
        torch.zeros(draw.hq, dtype=torch.float64) if r == missing else shard_sequence(terms, r, world).sum((0, 1))
        for r in range(world)
    ]


def test_dsinks_check_fails_a_missing_rank_and_a_five_percent_error():
    """Negative controls of d sinks' bound (sink_err against the per-row terms' scale, TOLERANCES[dtype].dsinks):
    the exact shares pass, and defects fail. 1123:2 (bf16, hp=1 cp=6, one head whose 168 terms cancel 449-fold)
    and 1104:5 (bf16, cp=8, two heads) are unpacked, so each rank's share is its zigzag rows' terms."""
    assert not _sink_failures(1123, 2, _rank_shares(6))
    assert not _sink_failures(1104, 5, _rank_shares(8))
    # one rank's rows missing: caught for every rank whose rows carry more than the bound of the terms' scale
    # (1123:2's rank 1 carries 6e-4 of it, below bf16's 5e-3, and 1104:5's rank 6 4e-3: docs/testing.md)
    for seed, index, world, ranks in ((1123, 2, 6, (0, 2, 3, 4, 5)), (1104, 5, 8, (0, 1, 2, 3, 4, 5, 7))):
        for r in ranks:
            found = _sink_failures(seed, index, _rank_shares(world, missing=r))
            assert len(found) == 1 and "dsinks error" in found[0], (seed, index, r)
    # the whole gradient 5% off, where the draw's terms cancel less than 0.05 / 5e-3 = 10-fold (1105:2: packed,
    # bf16, four heads cancelling 1.2- to 6.1-fold; 1104:5: 3.6- and 17-fold)
    for seed, index in ((1105, 2), (1104, 5)):
        found = _sink_failures(seed, index, lambda draw, terms: [1.05 * terms.sum((0, 1))])
        assert len(found) == 1 and "dsinks error" in found[0], (seed, index)
        assert not _sink_failures(seed, index, lambda draw, terms: [terms.sum((0, 1))])


def test_max_logit_check_fails_a_wrong_or_uneven_max():
    """Negative controls of the max logit's check: the exact max passes; a max 1% off (a missed block) fails, and so
    does one rank holding another value than the others (a reduction that missed a group)."""
    batch = draw_batch(0)
    draw = next(d for d in (draw_case(batch, i, PACKING_MODES) for i in range(40)) if d.max_logit)
    expected = expected_results(draw)
    exact = expected[6]

    def found(per_rank_max):
        results = [
            {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0, "finite": True, "padding_zero": True, "max_logit": m}
            | {"dsinks": None, "dsinks_expected": None, "dsinks_scale": None}
            for m in per_rank_max
        ]
        undrawn_sinks = replace(draw, sinks=False)
        return failures(batch, [undrawn_sinks], [[r] for r in results], [expected[-1]], [exact])

    assert not found([exact, exact.clone()])
    off = exact.clone()
    off[int(off.argmax())] *= 0.99
    assert "max_logit error" in found([off, off.clone()])[0]
    assert "max_logit differs between ranks" in found([exact, exact + 1e-9])[0]
