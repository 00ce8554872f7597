"""gpu-check's new items can fail: each is run here on a correct path (it passes) and on a broken one (it fails).

tall bands     a kernel that reads a right window side >= its keys as unbounded, as flash-attn's C++ does
MLA dims, varlen  a kernel blind to bands (every call unmasked)
timing         not run without CUDA (never a pass)
megatron GPT   a 2d core attention with a 5% wrong softmax scale; a TE row without Transformer Engine
checkpoint++   a keeper that lets the recompute run attention again
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_2d.kernels.cpu_flash import CpuFlashKernel
from megatron_2d.layout.band import Band
from megatron_2d_dev import gpu_check

CPU = torch.device("cpu")


class RightSideClamped(CpuFlashKernel):
    """The CPU kernel, but a band's right side that reaches the block's last key column or beyond, counted from
    the bottom-right corner as flash-attn does (hi + sq - sk >= sk), is dropped: those rows see later keys."""

    @staticmethod
    def _clamped(band, sq, sk):
        if band is not None and band.hi is not None and band.hi + sq - sk >= sk:
            return None if band.lo is None else Band(band.lo, None)
        return band

    def forward(self, q, k, v, band, scale):
        return super().forward(q, k, v, self._clamped(band, q.shape[1], k.shape[1]), scale)

    def backward(self, dout, q, k, v, out, lse, band, scale):
        return super().backward(dout, q, k, v, out, lse, self._clamped(band, q.shape[1], k.shape[1]), scale)


def test_tall_bands_pass_on_a_correct_kernel_and_fail_where_the_right_side_is_read_as_unbounded(monkeypatch):
    assert gpu_check.check_tall_bands("cpu_flash", CPU, 64, 64) < 1
    monkeypatch.setattr(gpu_check, "select_kernel", lambda *args, **kwargs: RightSideClamped())
    assert gpu_check.check_tall_bands("cpu_flash", CPU, 64, 64) > 10
    calls = gpu_check.tall_calls(64)  # the batched pair alone fails too
    assert gpu_check.calls_error(RightSideClamped(), calls, 64, 64, CPU) > 10
    assert gpu_check.calls_error(CpuFlashKernel(), calls, 64, 64, CPU) < 1


def _megatron_rows(rank, world):
    from megatron_2d.megatron import checkpoint_plus, core_attention
    from megatron_2d_dev import gpu_check_megatron as gm
    from megatron_2d_dev.gpu_check_runner import NotRun

    found = {
        "gpt": gm.check_layers("GPT", False, "cpu_flash", CPU),
        "mla": gm.check_layers("MLA latent, qk_layernorm", False, "cpu_flash", CPU),
        "ckpt": gm.check_checkpoint_plus("cpu_flash", CPU)[0],
    }
    try:
        gm.check_layers("GPT", True, "cpu_flash", CPU)
    except NotRun as why:
        found["te"] = str(why)
    original = core_attention.CoreAttention2D._call

    def wrong_scale(self, *args, **kwargs):
        call = original(self, *args, **kwargs)
        scale = 1.05 * (call.options.softmax_scale or args[0].shape[-1] ** -0.5)
        return call._replace(options=dataclasses.replace(call.options, softmax_scale=scale))

    core_attention.CoreAttention2D._call = wrong_scale
    try:
        found["gpt_wrong_scale"] = gm.check_layers("GPT", False, "cpu_flash", CPU)
    finally:
        core_attention.CoreAttention2D._call = original
    keep = checkpoint_plus.AttentionKeeper.__call__
    checkpoint_plus.AttentionKeeper.__call__ = lambda self, attention, *tensors, **_: attention(*tensors)
    try:
        gm.check_checkpoint_plus("cpu_flash", CPU)
    except AssertionError as err:
        found["ckpt_recomputed"] = str(err)
    finally:
        checkpoint_plus.AttentionKeeper.__call__ = keep
    difference = checkpoint_plus._relative_difference
    checkpoint_plus._relative_difference = lambda x, first: torch.ones((), device=x.device)  # every check fails
    try:
        gm.check_checkpoint_plus("cpu_flash", CPU)
    except RuntimeError as err:
        found["ckpt_check_failed"] = str(err)
    finally:
        checkpoint_plus._relative_difference = difference
    return found


@pytest.mark.megatron
@pytest.mark.distributed
def test_megatron_rows_pass_and_fail_where_they_should():
    from megatron_2d.testing.distributed import run_on_ranks

    (found,) = run_on_ranks(1, _megatron_rows)
    assert found["gpt"] < 1 and found["mla"] < 1 and found["ckpt"] < 1, found
    assert found["gpt_wrong_scale"] > 1, found  # a 5% wrong softmax scale fails the row
    assert found["te"] == "transformer_engine not importable"
    assert "Selective Checkpoint++: the recomputed q differs" in found.get("ckpt_check_failed", ""), found
    recomputed = found.get("ckpt_recomputed", "")  # the keeper bypassed: the recompute runs the kernels again
    assert recomputed.startswith("the block kernels ran") and "(attention recomputed?)" in recomputed, found


class BandBlind(CpuFlashKernel):
    """The CPU kernel, but every call runs unmasked: causal calls and windows see every key."""

    def forward(self, q, k, v, band, scale):
        return super().forward(q, k, v, None, scale)

    def backward(self, dout, q, k, v, out, lse, band, scale):
        return super().backward(dout, q, k, v, out, lse, None, scale)


def test_mla_dims_and_varlen_pass_on_a_correct_kernel_and_fail_on_one_blind_to_bands(monkeypatch):
    """The MLA-dims item (q/k 192, v 128: causal, a window) and the varlen item (a packed block's calls)."""
    assert gpu_check.check_mla_dims("cpu_flash", CPU, 64) < 1
    assert gpu_check.check_varlen("cpu_flash", CPU, 64, 64) < 1
    monkeypatch.setattr(gpu_check, "select_kernel", lambda *args, **kwargs: BandBlind())
    assert gpu_check.check_mla_dims("cpu_flash", CPU, 64) > 10
    assert gpu_check.check_varlen("cpu_flash", CPU, 64, 64) > 10


def test_timing_needs_cuda_and_is_not_a_pass_here():
    from megatron_2d_dev.gpu_check_runner import NOT_RUN, Item, run_item

    row = run_item(Item("timing te_fused", "32K", lambda: gpu_check.check_timing("te_fused", CPU), bound=3.0))
    assert row.result == NOT_RUN and row.detail == "timing needs CUDA"


class MaxBlindToBands(CpuFlashKernel):
    """The CPU kernel whose max logit comes from its calls with their bands dropped (every key of a causal call)."""

    def forward_calls_with_max(self, q, k, v, calls, first_key, scale):
        from megatron_2d.layout.block_calls import BlockCall

        unmasked = [BlockCall(c.q_start, c.q_end, c.k_start, c.k_end, None) for c in calls]
        return super().forward_calls_with_max(q, k, v, unmasked, first_key, scale)


def test_max_logit_item_passes_on_a_correct_kernel_and_fails_on_one_blind_to_bands(monkeypatch):
    assert gpu_check.check_max_logit("cpu_flash", CPU, 64, 64) < 1
    monkeypatch.setattr(gpu_check, "select_kernel", lambda *args, **kwargs: MaxBlindToBands())
    assert gpu_check.check_max_logit("cpu_flash", CPU, 64, 64) > 1
