"""CPU versions of Transformer Engine's ``tex.thd_*`` helpers: what its THD (packed) context parallelism calls.

Each function computes what TE's CUDA kernel of the same name computes (transformer_engine/common/fused_attn/
context_parallel.cu, read, not copied), with the same positional arguments as the pybind function, and the same
reading of memory: the kernels take a data pointer and a shape, so a tensor is read as if contiguous
(:func:`read_as`). Notation: ``cu`` the cumulative (padded) token offsets of the B sequences on this rank, each of
even length; a sequence's first half is its tokens [cu[s], (cu[s] + cu[s+1]) / 2), its second half the rest.

    thd_read_half_tensor(x, cu, half)                 x [t, h, d] or [2, t, h, d] -> the first / second half of
                                                      every sequence, packed: [t/2, h, d] (rows past cu[-1]/2: 0)
    thd_read_second_half_lse(lse, cu, packed, n)      the second halves' rows of the stats -> [h, n] / [b, h, n]
    thd_second_half_lse_correction(lse, lse_, cu, p)  lse's second halves <- log(exp(lse) + exp(lse_)), in place
    thd_out_correction(out, out_, lse, lse_, cu, second_half, packed)
                                                      out (its second halves) += out_ * exp(lse_ - lse), in place
                                                      2.20: (out, out_, old_lse, lse, lse_, ...) rescales online:
                                                      out = out * exp(old_lse - lse) + out_ * exp(lse_ - lse)
    thd_grad_correction(g, g_, cu, first, second)     per half: "copy", "add", "none" (2.20: "zero"), in place
    thd_get_partitioned_indices(cu, t, cp, rank)      the tokens of CP rank ``rank`` (chunks rank, 2cp-1-rank of
                                                      every sequence), int32 (megatron-core's THD split calls it)
  2.19 on (the 2.20 ABI here):
    thd_sequence_order_to_cp_rank_order(x, cu, cp, t) / thd_cp_rank_order_to_sequence_order(...): the reorders
    thd_copy_valid_tokens_from_per_split_to_rank_local(out, x, cu_padded, cu): the real tokens of x into out

Arithmetic as the kernels do it: log-sum-exp corrections in fp32; an output correction multiplies in fp32, rounds
the term to the output's dtype, then adds in that dtype (a zero partial adds exactly zero); gradient "add" adds in
the gradient's dtype. The 2.20 online correction (its source is not public in this form) is taken to compute
``out * exp(old - new) + out_ * exp(lse_ - new)`` in fp32 and round once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def read_as(x: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """``x`` read from its data pointer with ``strides`` (what a kernel taking a pointer and a shape reads): itself
    when its strides are those; an error when that reads past the end of its memory."""
    strides = tuple(strides)
    if x.stride() == strides or x.numel() == 0:
        return x
    last = x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, strides))
    if last >= x.untyped_storage().nbytes() // x.element_size():
        raise RuntimeError(
            f"a tensor of shape {tuple(x.shape)} and strides {x.stride()} is read with strides {strides}, past the "
            f"end of its memory"
        )
    return x.as_strided(x.shape, strides, x.storage_offset())


def _dense(x: torch.Tensor) -> torch.Tensor:
    return read_as(x, torch.empty(x.shape, device="meta").stride())


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"CPU transformer_engine_torch: {message}")


def _cu(cu_seqlens: torch.Tensor, divisor: int = 1) -> list[int]:
    _check(cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1, "cu_seqlens must be a 1-D int32 tensor")
    _check(cu_seqlens.numel() >= 2, "cu_seqlens needs at least 2 entries")
    return [int(c) // divisor for c in cu_seqlens.tolist()]


def _runs(cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each token of [0, cu[-1]), the token's offset in its sequence), over ``cu``'s sequences."""
    lengths = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])])
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.tensor(cu[:-1], dtype=torch.long)
    return seq, torch.arange(cu[-1]) - starts[seq]


def _check_16_bytes(x: torch.Tensor, what: str) -> None:
    h, d = x.shape[-2:]
    _check(h * d * x.element_size() % 16 == 0, f"{what}: h * d * element size must be a multiple of 16 bytes")


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b rounded once to a's dtype (a half-precision add on the GPU)."""
    return (a.float() + b.float()).to(a.dtype)


# ---- halves of tensors and of softmax statistics ---------------------------------------------------------------


def thd_read_half_tensor(tensor: torch.Tensor, cu_seqlens: torch.Tensor, half_idx: int) -> torch.Tensor:
    _check(tensor.dim() in (3, 4), "thd_read_half_tensor takes [t, h, d] or [2, t, h, d]")
    _check_16_bytes(tensor, "thd_read_half_tensor")
    x = _dense(tensor)
    seq_dim = tensor.dim() - 3
    cu = _cu(cu_seqlens, 2)
    shape = list(x.shape)
    shape[seq_dim] //= 2
    half = x.new_zeros(shape)
    seq, _ = _runs(cu)
    source = torch.arange(cu[-1]) + torch.tensor(cu, dtype=torch.long)[seq + half_idx]
    half.narrow(seq_dim, 0, cu[-1]).copy_(x.index_select(seq_dim, source))
    return half


def _lse_pairs(lse: torch.Tensor, cu: list[int], packed: bool, half_len: int, shift: int):
    """(index into lse's last dim, into the per-step stats' last dim, rows) for the tokens of each sequence's
    second half (``shift`` 1) or whole (``shift`` 0) as the kernels index them: packed [h, L] by token; unpacked
    [b, h, L] by sequence row and column."""
    seq, offset = _runs(cu)
    ends = torch.tensor(cu[1:], dtype=torch.long)
    lengths = ends - torch.tensor(cu[:-1], dtype=torch.long)
    if packed:
        return torch.arange(cu[-1]) + ends[seq] * shift, torch.arange(cu[-1]), None
    return offset + lengths[seq] * shift, offset, seq


def _gather_lse(x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x[:, index] if rows is None else x[rows, :, index].t()  # [h, tokens]


def _scatter_lse(x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None, value: torch.Tensor) -> None:
    if rows is None:
        x[:, index] = value
    else:
        x[rows, :, index] = value.t()


def _check_lse(lse: torch.Tensor, other_len: int, cu: torch.Tensor, packed: bool, exact_half: bool) -> None:
    _check(lse.dtype == torch.float32, "softmax stats must be fp32")
    _check(lse.dim() == (2 if packed else 3), f"{'packed' if packed else 'unpacked'} stats of {lse.dim()} dims")
    length = lse.shape[-1]
    if packed:
        _check(other_len >= length // 2, f"half stats of {other_len} rows for stats of {length}")
    else:
        _check(cu.numel() == lse.shape[0] + 1, "cu_seqlens must have b + 1 entries")
        _check(not exact_half or other_len == length // 2, f"half stats of {other_len} rows for stats of {length}")


def thd_second_half_lse_correction(
    lse: torch.Tensor, lse_per_step: torch.Tensor, cu_seqlens: torch.Tensor, lse_packed: bool
) -> None:
    _check(lse_per_step.dtype == torch.float32, "softmax stats must be fp32")
    _check_lse(lse, lse_per_step.shape[-1], cu_seqlens, lse_packed, exact_half=True)
    target, step = _dense(lse), _dense(lse_per_step)
    index, step_index, rows = _lse_pairs(target, _cu(cu_seqlens, 2), lse_packed, step.shape[-1], shift=1)
    a, b = _gather_lse(target, index, rows), _gather_lse(step, step_index, rows)
    high, low = torch.maximum(a, b), torch.minimum(a, b)
    _scatter_lse(target, index, rows, high + torch.log1p(torch.exp(low - high)))


def thd_read_second_half_lse(
    lse: torch.Tensor, cu_seqlens: torch.Tensor, lse_packed: bool, second_half_lse_seqlen: int
) -> torch.Tensor:
    _check_lse(lse, second_half_lse_seqlen, cu_seqlens, lse_packed, exact_half=True)
    source = _dense(lse)
    shape = (lse.shape[0], second_half_lse_seqlen) if lse_packed else (*lse.shape[:2], second_half_lse_seqlen)
    half = torch.zeros(shape, dtype=torch.float32)
    index, half_index, rows = _lse_pairs(source, _cu(cu_seqlens, 2), lse_packed, second_half_lse_seqlen, shift=1)
    _scatter_lse(half, half_index, rows, _gather_lse(source, index, rows))
    return half


# ---- corrections of outputs and gradients ------------------------------------------------------------------------


def _out_correction(out, out_per_step, old_lse, lse, lse_per_step, cu_seqlens, only_second_half, lse_packed) -> None:
    """Both forms of thd_out_correction: ``old_lse`` None adds out_ * exp(lse_ - lse) to out (2.5 to 2.19); else out
    is rescaled by exp(old_lse - lse) too (2.20's online merge)."""
    _check(out.dtype == out_per_step.dtype, "out and out_per_step must have one dtype")
    _check(out.dim() == 3 and out_per_step.dim() == 3, "out and out_per_step are [t, h, d]")
    parts = 2 if only_second_half else 1
    _check(out_per_step.shape[0] == out.shape[0] // parts and out_per_step.shape[1:] == out.shape[1:],
           f"out_per_step {tuple(out_per_step.shape)} for out {tuple(out.shape)}")  # fmt: skip
    _check(
        out.shape[-1] * out.element_size() % 16 == 0, "thd_out_correction: d * element size must be a multiple of 16"
    )
    for name, x in (("lse", lse), ("lse_per_step", lse_per_step), ("old_lse", old_lse)):
        _check(x is None or x.dtype == torch.float32, f"{name} must be fp32")
    target, step = _dense(out), _dense(out_per_step)
    cu = _cu(cu_seqlens, parts)
    shift = 1 if only_second_half else 0
    index, step_index, rows = _lse_pairs(_dense(lse), cu, lse_packed, lse_per_step.shape[-1], shift)
    new = _gather_lse(_dense(lse), index, rows)  # [h, tokens]
    term_scale = torch.exp(_gather_lse(_dense(lse_per_step), step_index, rows) - new).t()[..., None]
    seq, _ = _runs(cu)
    tokens = torch.arange(cu[-1]) + torch.tensor(cu[1:], dtype=torch.long)[seq] * shift
    partial = step[: cu[-1]]
    term = torch.where(partial == 0, 0.0, partial.float() * term_scale)
    if old_lse is None:
        target[tokens] = _add(target[tokens], term.to(out.dtype))
    else:
        old_scale = torch.exp(_gather_lse(_dense(old_lse), index, rows) - new).t()[..., None]
        target[tokens] = (target[tokens].float() * old_scale + term).to(out.dtype)


def thd_out_correction(out, out_per_step, lse, lse_per_step, cu_seqlens, only_second_half, lse_packed) -> None:
    _out_correction(out, out_per_step, None, lse, lse_per_step, cu_seqlens, only_second_half, lse_packed)


def thd_out_correction_online(
    out, out_per_step, old_lse, lse, lse_per_step, cu_seqlens, only_second_half, lse_packed
) -> None:
    _out_correction(out, out_per_step, old_lse, lse, lse_per_step, cu_seqlens, only_second_half, lse_packed)


_GRAD_MODES = {  # (first half, second half) -> which halves the per-step gradient covers
    ("add", "none"): "first",
    ("copy", "none"): "first",
    ("none", "add"): "second",
    ("none", "copy"): "second",
    ("add", "copy"): "both",
    ("copy", "add"): "both",
}
_GRAD_MODES_2_20 = {**_GRAD_MODES, ("copy", "zero"): "first", ("zero", "copy"): "second"}


def _grad_correction(modes: dict, grad, grad_per_step, cu_seqlens, first_half: str, second_half: str) -> None:
    covers = modes.get((first_half, second_half))
    _check(covers is not None, f"unsupported functors of first and second half: {first_half!r}, {second_half!r}")
    _check(grad.dim() in (3, 4) and grad_per_step.dim() == grad.dim(), "gradients are [t, h, d] or [2, t, h, d]")
    _check_16_bytes(grad, "thd_grad_correction")
    seq_dim = grad.dim() - 3
    total = grad.shape[seq_dim]
    _check(grad_per_step.shape[seq_dim] == (total if covers == "both" else total // 2)
           and grad_per_step.shape[seq_dim + 1 :] == grad.shape[seq_dim + 1 :],
           f"grad_per_step {tuple(grad_per_step.shape)} for grad {tuple(grad.shape)}")  # fmt: skip
    target, step = _dense(grad), _dense(grad_per_step)
    if covers == "both":
        cu = _cu(cu_seqlens)
        seq, offset = _runs(cu)
        lengths = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])])
        first = offset < lengths[seq] // 2
        halves = ((first_half, torch.arange(cu[-1])[first], torch.arange(cu[-1])[first]),
                  (second_half, torch.arange(cu[-1])[~first], torch.arange(cu[-1])[~first]))  # fmt: skip
    else:
        cu = _cu(cu_seqlens, 2)
        seq, _ = _runs(cu)
        starts = torch.tensor(cu, dtype=torch.long)
        own = torch.arange(cu[-1])
        halves = ((first_half, own + starts[seq], own), (second_half, own + starts[seq + 1], own))
    for functor, rows, step_rows in halves:
        if functor == "none":
            continue
        if functor == "zero":
            target.index_fill_(seq_dim, rows, 0)
            continue
        value = step.index_select(seq_dim, step_rows)
        if functor == "add":
            value = _add(target.index_select(seq_dim, rows), value)
        target.index_copy_(seq_dim, rows, value)


# ---- 2.20: partitioning and reordering THD batches by CP rank ----------------------------------------------------


def _partition_sources(cu: list[int], world_size: int, rank: int) -> torch.Tensor:
    """The source token of each of rank ``rank``'s tokens (chunks rank and 2 * world - 1 - rank of every sequence);
    ``cu`` already divided by the world size."""
    seq, index = _runs(cu)
    starts = torch.tensor(cu[:-1], dtype=torch.long)[seq]
    half = (torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], dtype=torch.long) // 2)[seq]
    offset = torch.where(index < half, rank, (world_size - 1) * 2 - rank)
    return index + starts * world_size + half * offset


def thd_get_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int):
    _check(0 <= rank < world_size and world_size > 0, f"rank {rank} of a world of {world_size}")
    _check(total_tokens > 0 and total_tokens % (2 * world_size) == 0,
           f"total_tokens {total_tokens} must be a positive multiple of 2 * world size")  # fmt: skip
    full = _cu(cu_seqlens)
    _check(all(c % (2 * world_size) == 0 for c in full), f"cu_seqlens {full}: not multiples of 2 * world size")
    out = torch.empty(total_tokens // world_size, dtype=torch.int32)
    sources = _partition_sources([c // world_size for c in full], world_size, rank)
    out[: len(sources)] = sources.to(torch.int32)
    return out


def _reorder(inp: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, to_sequence: bool, total_tokens: int):
    _check(cp_size > 0 and total_tokens > 0 and total_tokens % (2 * cp_size) == 0,
           f"total_tokens {total_tokens} must be a positive multiple of 2 * cp ({cp_size})")  # fmt: skip
    _check(inp.dim() >= 1 and inp.shape[0] == total_tokens, f"inp of {inp.shape[0]} tokens, expected {total_tokens}")
    x = inp.contiguous()
    cu = [c // cp_size for c in _cu(cu_seqlens)]
    per_rank = total_tokens // cp_size
    positions, sources = [], []
    for rank in range(cp_size):
        src = _partition_sources(cu, cp_size, rank)
        positions.append(torch.arange(len(src)) + rank * per_rank)
        sources.append(src)
    position, source = torch.cat(positions), torch.cat(sources)
    out = torch.empty_like(x)
    if to_sequence:
        out[source] = x[position]
    else:
        out[position] = x[source]
    return out


def thd_sequence_order_to_cp_rank_order(inp, cu_seqlens, cp_size, total_tokens):
    return _reorder(inp, cu_seqlens, cp_size, False, total_tokens)


def thd_cp_rank_order_to_sequence_order(inp, cu_seqlens, cp_size, total_tokens):
    return _reorder(inp, cu_seqlens, cp_size, True, total_tokens)


def thd_copy_valid_tokens_from_per_split_to_rank_local(out, inp, cu_seqlens_padded, cu_seqlens) -> None:
    _check(out.shape == inp.shape and out.dtype == inp.dtype, "out and inp must match in shape and dtype")
    _check(out.is_contiguous(), "thd_copy_valid_tokens_from_per_split_to_rank_local output must be contiguous.")
    padded, valid = _cu(cu_seqlens_padded), _cu(cu_seqlens)
    _check(len(padded) == len(valid), "cu_seqlens_padded and cu_seqlens must have as many entries")
    x = inp.contiguous()
    for start, end, a, b in zip(padded[:-1], padded[1:], valid[:-1], valid[1:]):
        rows = slice(start, min(end, start + (b - a), x.shape[0]))
        out[rows] = x[rows]


# ---- by ABI ------------------------------------------------------------------------------------------------------


def functions(abi: str) -> dict[str, Callable]:
    """The tex.thd_* functions of one extension ABI ("2.5", "2.8", "2.12", "2.20")."""
    table: dict[str, Callable] = {
        "thd_read_half_tensor": thd_read_half_tensor,
        "thd_second_half_lse_correction": thd_second_half_lse_correction,
        "thd_read_second_half_lse": thd_read_second_half_lse,
        "thd_out_correction": thd_out_correction,
        "thd_grad_correction": lambda *args: _grad_correction(_GRAD_MODES, *args),
        "thd_get_partitioned_indices": thd_get_partitioned_indices,
    }
    if abi == "2.20":
        table.update(
            thd_out_correction=thd_out_correction_online,
            thd_grad_correction=lambda *args: _grad_correction(_GRAD_MODES_2_20, *args),
            thd_sequence_order_to_cp_rank_order=thd_sequence_order_to_cp_rank_order,
            thd_cp_rank_order_to_sequence_order=thd_cp_rank_order_to_sequence_order,
            thd_copy_valid_tokens_from_per_split_to_rank_local=thd_copy_valid_tokens_from_per_split_to_rank_local,
        )
    return table
