"""The CPU ``tex.thd_*`` helpers (megatron_2d_dev.te_thd_cpu) one by one, against the CUDA kernels' semantics
written as plain loops over sequences and tokens (context_parallel.cu: per sequence of the padded ``cu_seqlens``,
its first half and its second half), and their guards. End to end they run inside TE's THD context parallelism
(tests/test_te_context_parallel.py); here each is checked alone, the modes TE's CI cases do not reach included
(2.20's "zero" halves, the unpacked stats layout)."""

from __future__ import annotations

import pytest
import torch

from megatron_2d_dev import te_thd_cpu as thd

CU = [0, 6, 10, 22]  # three sequences of even lengths (the padded offsets of one CP rank)


def cu() -> torch.Tensor:
    return torch.tensor(CU, dtype=torch.int32)


def halves():
    """(first-half rows, second-half rows) of each sequence."""
    return [
        (list(range(a, (a + b) // 2)), list(range((a + b) // 2, b))) for a, b in zip(CU[:-1], CU[1:])
    ]  # fmt: skip


def rand(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("leading", [(), (2,)])
def test_read_half_tensor(leading):
    x = rand(*leading, CU[-1], 2, 8)
    for half in (0, 1):
        got = thd.thd_read_half_tensor(x, cu(), half)
        rows = [r for pair in halves() for r in pair[half]]
        expected = x.index_select(len(leading), torch.tensor(rows))
        assert torch.equal(got, expected)


def test_read_as_reads_memory_with_the_given_strides():
    x = torch.arange(12.0).view(3, 4).t()  # strides (1, 4): the memory holds 0..11 in order
    assert torch.equal(thd.read_as(x, (3, 1)), torch.arange(12.0).view(4, 3))
    with pytest.raises(RuntimeError, match="past the end of its memory"):
        thd.read_as(torch.zeros(4)[:2].view(1, 2).expand(3, 2), (2, 1))


def packed_and_padded_lse(h: int):
    """The same per-token stats, packed [h, t] and unpacked [b, h, max_len] (max_len the longest sequence)."""
    packed = rand(h, CU[-1], dtype=torch.float32, seed=3)
    longest = max(b - a for a, b in zip(CU[:-1], CU[1:]))
    unpacked = torch.full((len(CU) - 1, h, longest), 7.0)
    for s, (a, b) in enumerate(zip(CU[:-1], CU[1:])):
        unpacked[s, :, : b - a] = packed[:, a:b]
    return packed, unpacked


def test_second_half_lse_correction_and_read():
    h = 2
    packed, _ = packed_and_padded_lse(h)
    step = rand(h, CU[-1] // 2, dtype=torch.float32, seed=4)  # the per-step stats of the second halves, packed
    expected = packed.clone()
    j = 0
    for _, second in halves():
        for r in second:
            expected[:, r] = torch.logaddexp(packed[:, r], step[:, j])
            j += 1
    got = packed.clone()
    thd.thd_second_half_lse_correction(got, step, cu(), True)
    torch.testing.assert_close(got, expected)
    read = thd.thd_read_second_half_lse(packed, cu(), True, CU[-1] // 2)
    assert torch.equal(read, torch.stack([packed[:, r] for _, second in halves() for r in second], dim=1))


def test_unpacked_stats_are_read_by_sequence_row():
    h = 2
    packed, unpacked = packed_and_padded_lse(h)
    second = thd.thd_read_second_half_lse(unpacked, cu(), False, unpacked.shape[-1] // 2)
    for s, (_, rows) in enumerate(halves()):
        assert torch.equal(second[s, :, : len(rows)], packed[:, rows])


@pytest.mark.parametrize("second_half", [False, True])
@pytest.mark.parametrize("online", [False, True])
def test_out_correction(second_half, online):
    h, d = 2, 8
    out = rand(CU[-1], h, d, seed=5)
    rows = [r for first, second in halves() for r in (second if second_half else first + second)]
    out_step = rand(len(rows), h, d, seed=6)
    out_step[0] = 0  # a zero partial adds exactly zero
    lse = rand(h, CU[-1], dtype=torch.float32, seed=7)
    old = rand(h, CU[-1], dtype=torch.float32, seed=9)
    lse_step = rand(h, len(rows), dtype=torch.float32, seed=8)
    expected = out.clone()
    for j, r in enumerate(rows):
        term = out_step[j].float() * torch.exp(lse_step[:, j] - lse[:, r])[:, None]
        if online:
            expected[r] = (out[r].float() * torch.exp(old[:, r] - lse[:, r])[:, None] + term).to(out.dtype)
        else:
            expected[r] = (out[r].float() + term.to(out.dtype).float()).to(out.dtype)
    got = out.clone()
    if online:
        thd.thd_out_correction_online(got, out_step, old, lse, lse_step, cu(), second_half, True)
    else:
        thd.thd_out_correction(got, out_step, lse, lse_step, cu(), second_half, True)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "first, second",
    [("add", "none"), ("copy", "none"), ("none", "add"), ("none", "copy"), ("add", "copy"), ("copy", "add"),
     ("copy", "zero"), ("zero", "copy")],
)  # fmt: skip
def test_grad_correction(first, second):
    grad = rand(2, CU[-1], 2, 8, seed=10)  # dK/dV stacked: [2, t, h, d]
    both = "none" not in (first, second) and "zero" not in (first, second)
    rows = [halves_[0] + halves_[1] for halves_ in halves()] if both else None
    step = rand(2, CU[-1] if both else CU[-1] // 2, 2, 8, seed=11)
    expected = grad.clone()
    j = 0
    for first_rows, second_rows in halves():
        if both:
            pairs = [(r, r, first) for r in first_rows] + [(r, r, second) for r in second_rows]
        else:
            pairs = [(r, j + i, first) for i, r in enumerate(first_rows)]
            pairs += [(r, j + i, second) for i, r in enumerate(second_rows)]
            j += len(first_rows)
        for row, source, functor in pairs:
            if functor == "copy":
                expected[:, row] = step[:, source]
            elif functor == "add":
                expected[:, row] = (grad[:, row].float() + step[:, source].float()).bfloat16()
            elif functor == "zero":
                expected[:, row] = 0
    assert rows is None or len(sum(rows, [])) == CU[-1]
    got = grad.clone()
    thd.functions("2.20")["thd_grad_correction"](got, step, cu(), first, second)
    assert torch.equal(got, expected)
    if "zero" in (first, second):  # before 2.20 the kernel has no "zero" functor
        with pytest.raises(RuntimeError, match="unsupported functors"):
            thd.functions("2.12")["thd_grad_correction"](grad.clone(), step, cu(), first, second)


def zigzag_tokens(cu_full: list[int], cp: int, rank: int) -> list[int]:
    """Each sequence cut into 2 cp chunks; rank r holds chunks r and 2 cp - 1 - r (Megatron's / TE's split)."""
    tokens = []
    for a, b in zip(cu_full[:-1], cu_full[1:]):
        c = (b - a) // (2 * cp)
        tokens += list(range(a + rank * c, a + (rank + 1) * c))
        tokens += list(range(a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c))
    return tokens


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_partitioned_indices_and_reorders(cp):
    cu_full = [0, 8 * cp, 12 * cp, 14 * cp]
    total = cu_full[-1]
    cu_t = torch.tensor(cu_full, dtype=torch.int32)
    parts = [thd.thd_get_partitioned_indices(cu_t, total, cp, r) for r in range(cp)]
    for r, p in enumerate(parts):
        assert p.dtype == torch.int32 and p.tolist() == zigzag_tokens(cu_full, cp, r)
    x = rand(total, 2, 8, seed=12)
    by_rank = thd.thd_sequence_order_to_cp_rank_order(x, cu_t, cp, total)
    assert torch.equal(by_rank, x[torch.cat(parts).long()])
    assert torch.equal(thd.thd_cp_rank_order_to_sequence_order(by_rank, cu_t, cp, total), x)


def test_copy_valid_tokens():
    inp, out = rand(12, 2, 8, seed=13), torch.zeros(12, 2, 8, dtype=torch.bfloat16)
    thd.thd_copy_valid_tokens_from_per_split_to_rank_local(out, inp, torch.tensor([0, 6, 12], dtype=torch.int32),
                                                           torch.tensor([0, 4, 9], dtype=torch.int32))  # fmt: skip
    assert torch.equal(out[:4], inp[:4]) and torch.equal(out[6:11], inp[6:11])
    assert not out[4:6].any() and not out[11:].any()


def test_guards():
    x = rand(CU[-1], 2, 8)
    with pytest.raises(RuntimeError, match="1-D int32"):
        thd.thd_read_half_tensor(x, cu().long(), 0)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        thd.thd_read_half_tensor(rand(CU[-1], 1, 4), cu(), 0)
    with pytest.raises(RuntimeError, match="fp32"):
        thd.thd_second_half_lse_correction(torch.zeros(2, 22).half(), torch.zeros(2, 11), cu(), True)
    with pytest.raises(RuntimeError, match="out_per_step"):
        thd.thd_out_correction(x, x, torch.zeros(2, 22), torch.zeros(2, 22), cu(), True, True)
    with pytest.raises(RuntimeError, match="not multiples of 2 \\* world size"):
        thd.thd_get_partitioned_indices(torch.tensor([0, 6], dtype=torch.int32), 8, 2, 0)
    with pytest.raises(RuntimeError, match="rank 2 of a world of 2"):
        thd.thd_get_partitioned_indices(torch.tensor([0, 8], dtype=torch.int32), 8, 2, 2)
