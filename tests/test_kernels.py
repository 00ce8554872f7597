"""The local attention kernels (megatron_2d.kernels): each CPU kernel's forward and backward against fp64 math,
kernel selection on CPU and (faked) CUDA devices, the flash kernels' boxes (every small box and band, through the
C++'s window normalisation) and the torch_flash kernel's launches."""

import contextlib
import itertools
import logging
import warnings

import pytest
import torch

from megatron_2d.kernels import KERNELS, select_kernel, torch_cudnn
from megatron_2d.kernels.flash_windows import flash_head_dim_problem, flash_mask
from megatron_2d.layout.band import Band, flash_boxes, flash_expressible
from megatron_2d.testing.reference import (
    FLASH_CONVENTION_CASES,
    TOLERANCES,
    attention_with_lse,
    flash_reference,
    norm_err,
    rel_err,
)
from megatron_2d_dev.flash_attn_cpu import kernel_window
from megatron_2d_dev.torch_cudnn_cpu import torch_cudnn_on_cpu
from megatron_2d_dev.torch_flash_cpu import torch_flash_on_cpu

PACKAGE_KERNELS = ("flash_attn2", "te_fused")  # tests/test_flash_attn_releases.py, tests/test_te_releases.py
CPU_KERNELS = [name for name in KERNELS if name not in PACKAGE_KERNELS]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLASH_ONLY = {name: ("bf16", "fp16") for name in ("torch_flash", "torch_cudnn")}  # CUDA ops, run on CPU by stand-ins
KERNEL_CASES = [
    (n, dt, c, h)
    for n, dt, c, h in itertools.product(CPU_KERNELS, DTYPES, [True, False], [4, 2, 1])
    if dt in FLASH_ONLY.get(n, DTYPES)
]


def on_cpu(name):
    """The context a kernel needs to run on CPU here (CPU kernels for PyTorch's CUDA flash or cuDNN ops)."""
    return {"torch_flash": torch_flash_on_cpu, "torch_cudnn": torch_cudnn_on_cpu}.get(name, contextlib.nullcontext)()


def block_case(dtype, causal, hkv, scale=0.3, seed=2):
    """Inputs of one block in ``dtype`` and the fp64 reference built from exactly those (rounded) inputs:
    (q, k, v, dout, {out, lse, dq, dk, dv} references)."""
    g = torch.Generator().manual_seed(seed)
    b, sq, hq, d = 2, 16, 4, 32
    sk = sq if causal else 24
    q, k, v = (
        torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv))
    )
    dout = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64).to(dtype)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref, ref_lse = attention_with_lse(*leaves, causal, scale)
    ref.backward(dout.double())
    return q, k, v, dout, dict(out=ref, lse=ref_lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)


@pytest.mark.parametrize(
    "name, dtype, causal, hkv",
    KERNEL_CASES,
    ids=[f"{n}-{dt}-{'causal' if c else 'full'}-hkv{h}" for n, dt, c, h in KERNEL_CASES],
)
def test_kernel_forward_backward(name, dtype, causal, hkv):
    """Each CPU kernel, forward (out, lse) and backward (dq, dk, dv), against fp64 math on its own rounded inputs."""
    dtype = DTYPES[dtype]
    q, k, v, dout, want = block_case(dtype, causal, hkv)
    band = Band(None, 0) if causal else None
    with on_cpu(name):
        kernel = select_kernel(torch.device("cpu"), dtype, name)
        out, lse = kernel.forward(q, k, v, band, 0.3)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, band, 0.3)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.dtype == dtype and lse.dtype == lse_dtype and lse.shape == (2, 4, 16)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    for key in ("dq", "dk", "dv"):
        assert got[key].dtype == dtype, key
    bad = {
        key: norm_err(got[key], want[key])
        for key in got
        if not norm_err(got[key], want[key]) < TOLERANCES[dtype].of(key)
    }
    assert not bad, f"above the {dtype} per-output tolerances: {bad}"
    assert all(got[key].shape == want[key].shape for key in got)


def test_kernel_selection():
    assert select_kernel(torch.device("cpu"), torch.float32).name == "cpu_flash"
    assert select_kernel(torch.device("cpu"), torch.float32, "torch_math").name == "torch_math"
    with pytest.raises(ValueError, match=r"unknown attention kernel 'nope'; choose one of"):
        select_kernel(torch.device("cpu"), torch.float32, "nope")
    with pytest.raises(ValueError, match=r"'flash_attn2' (is not available here|does not run on device cpu)"):
        select_kernel(torch.device("cpu"), torch.bfloat16, "flash_attn2")
    with pytest.raises(ValueError, match=r"'torch_flash' does not run on device cpu"):
        select_kernel(torch.device("cpu"), torch.bfloat16, "torch_flash")


class FakePackageKernel:
    """Plays a kernel over an installed package (flash-attn, Transformer Engine) for selection tests: the real
    packages run in tests/test_flash_attn_releases.py and tests/test_te_releases.py, each in its own process."""

    installed = False
    problem = staticmethod(flash_head_dim_problem)

    @classmethod
    def available(cls):
        return cls.installed

    def supports(self, device, dtype):
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def head_dim_problem(self, head_dim):
        return self.problem(head_dim)


def fake_package_kernel(name, installed, problem=flash_head_dim_problem):
    """A :class:`FakePackageKernel` class in the place of kernel ``name`` (available when in ``installed``)."""
    import megatron_2d.kernels as kernels

    missing = kernels.base.KERNELS[name].missing_package
    attributes = {"name": name, "installed": name in installed, "problem": staticmethod(problem)}
    return type(f"Fake_{name}", (FakePackageKernel,), {**attributes, "missing_package": missing})


def fake_device(monkeypatch, capability, installed=()):
    """A CUDA device of ``capability`` (no CUDA tensor is made) with the package kernels in ``installed``."""
    import megatron_2d.kernels as kernels

    monkeypatch.setattr(kernels, "cuda_capability", lambda device: capability)
    monkeypatch.setattr(torch_cudnn, "device_capability", lambda: capability or (8, 0))
    cudnn_problem = lambda d: torch_cudnn.cudnn_head_dim_problem(d, capability or (8, 0))  # noqa: E731
    fakes = {
        "flash_attn2": fake_package_kernel("flash_attn2", installed),
        "te_fused": fake_package_kernel("te_fused", installed, cudnn_problem),
    }
    monkeypatch.setattr(kernels, "KERNELS", {**kernels.base.KERNELS, **fakes})
    return torch.device("cuda")


def test_kernel_selection_on_cuda_devices(monkeypatch):
    """The choice on a CUDA device, by compute capability: Hopper and later prefer TE's fused attention, then
    PyTorch's cuDNN ops, flash-attn 2, PyTorch's flash op; Ampere prefers flash-attn 2. Each kernel passed over is a
    one-line warning naming why; fp32/fp64 refused; a named kernel is refused, not replaced."""
    with torch_cudnn_on_cpu():  # the real TorchCudnnKernel (its schema check) builds here
        cuda = fake_device(monkeypatch, (9, 0), installed=("te_fused", "flash_attn2"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert select_kernel(cuda, torch.bfloat16, head_dim=128).name == "te_fused"
            assert select_kernel(cuda, torch.bfloat16, head_dim=192).name == "te_fused"  # MLA's 192 / 128
            assert select_kernel(cuda, torch.float16, "flash_attn2", head_dim=64).name == "flash_attn2"
            assert select_kernel(cuda, torch.float16, "torch_cudnn", head_dim=64).name == "torch_cudnn"
        cuda = fake_device(monkeypatch, (9, 0), installed=("flash_attn2",))  # no TE: cuDNN through PyTorch
        with pytest.warns(UserWarning, match=r"^attention_2d passes over kernel te_fused: Transformer Engine is not "
                          r"importable; using torch_cudnn$"):  # fmt: skip
            assert select_kernel(cuda, torch.bfloat16, head_dim=128).name == "torch_cudnn"
        cuda = fake_device(monkeypatch, (9, 0), installed=("te_fused", "flash_attn2"))
        with pytest.raises(ValueError, match=r"no attention kernel takes torch.bfloat16 with head dim 264 here: "
                           r"te_fused: head dim 264 is not supported by cuDNN's fused attention on sm90 .*; "
                           r"torch_cudnn: .*; flash_attn2: .*; torch_flash: head dim 264"):  # fmt: skip
            select_kernel(cuda, torch.bfloat16, head_dim=264)  # at most 256 everywhere: every candidate named
        cuda = fake_device(monkeypatch, (8, 0), installed=("te_fused", "flash_attn2"))  # Ampere: flash-attn 2 first
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert select_kernel(cuda, torch.bfloat16, head_dim=128).name == "flash_attn2"
        cuda = fake_device(monkeypatch, (8, 0), installed=())
        with pytest.warns(UserWarning, match=r"passes over kernel flash_attn2: flash-attn is not installed; using "
                          r"torch_flash"):  # fmt: skip
            assert select_kernel(cuda, torch.bfloat16, head_dim=128).name == "torch_flash"
        with pytest.raises(ValueError, match=r"'torch_cudnn': head dim 192 is not supported by cuDNN's fused "
                           r"attention on sm80 \(a multiple of 8, at most 128\)"):  # fmt: skip
            select_kernel(cuda, torch.bfloat16, "torch_cudnn", head_dim=192)
        for dtype in (torch.float32, torch.float64):
            with pytest.raises(ValueError, match=rf"fused kernels \(flash_attn2, torch_flash, torch_cudnn\), "
                               rf"which take fp16 or bf16, not {dtype}"):  # fmt: skip
                select_kernel(cuda, dtype)
        with pytest.raises(ValueError, match=r"'torch_math' does not run on device cuda"):
            select_kernel(cuda, torch.float32, "torch_math")
        with pytest.raises(
            ValueError, match=r"'te_fused' is not available here \(Transformer Engine is not importable"
        ):
            select_kernel(cuda, torch.bfloat16, "te_fused")
        cuda = fake_device(monkeypatch, (8, 0), installed=("flash_attn2",))
        for name in ("flash_attn2", "torch_flash"):
            with pytest.raises(ValueError, match=r"head dim 60 is not supported by the flash kernels \(a multiple of "
                               r"8, at most 256; pad to 64\)"):  # fmt: skip
                select_kernel(cuda, torch.bfloat16, name, head_dim=60)
        with pytest.raises(ValueError, match=r"'flash_attn2' does not run on device cuda with torch.float32"):
            select_kernel(cuda, torch.float32, "flash_attn2")
    with pytest.raises(ValueError, match=r"no attention kernel runs on device type 'mps'"):
        select_kernel(torch.device("mps"), torch.float32)


def test_a_head_dim_falls_to_the_next_kernel_with_a_notice(monkeypatch):
    """On Ampere without flash-attn: head dim 192 goes to PyTorch's flash op (the pass over flash-attn noticed);
    264 fits no kernel (cuDNN trains at most 128 there, the flash kernels 256) and the error names each."""
    with torch_cudnn_on_cpu():
        cuda = fake_device(monkeypatch, (8, 6), installed=())
        with pytest.warns(UserWarning, match=r"passes over kernel flash_attn2: flash-attn is not installed"):
            assert select_kernel(cuda, torch.bfloat16, head_dim=192).name == "torch_flash"
        with pytest.raises(ValueError, match=r"torch_flash: head dim 264 .*; torch_cudnn: head dim 264 is not "
                           r"supported by cuDNN's fused attention on sm86"):  # fmt: skip
            select_kernel(cuda, torch.bfloat16, head_dim=264)


def kernel_mask(causal, left, right, nq, nk):
    """[nq, nk] bool: what flash-attn's CUDA kernels show, given (causal, left, right) as :func:`kernel_window`
    returns them: causal and local masks aligned bottom-right, -1 = no bound (read from its mask.h)."""
    offset = torch.arange(nk).view(1, -1) - torch.arange(nq).view(-1, 1) - (nk - nq)  # j - aligned i
    if causal:
        return offset <= 0
    if (left, right) == (-1, -1):
        return torch.ones(nq, nk, dtype=torch.bool)
    return (offset >= -left) & (offset <= right)


@pytest.mark.slow
def test_flash_boxes_run_every_small_band_exactly():
    """Every band on every block up to 12 x 12: the boxes of flash_boxes, each run with its flash mask through
    the C++'s window normalisation (dense: against its own s_k; varlen: against any larger max_seqlen_k of its
    group), show exactly the band's visible pairs, each once; the block's own box stays one launch when its
    window is kept, and no call takes more than three."""
    cases = split = 0
    for sq, sk in itertools.product(range(1, 13), repeat=2):
        for lo, hi in itertools.product([None, *range(-13, 13)], repeat=2):
            band = None if (lo, hi) == (None, None) else Band(lo, hi)
            want = torch.tensor([[band is None or band.visible(i, j) for j in range(sk)] for i in range(sq)])
            boxes = flash_boxes(band, sq, sk)
            assert len(boxes) <= 3, (sq, sk, band, boxes)
            for max_k_extra in (0, 1, 7):  # dense, and varlen groups whose max_seqlen_k exceeds the box's keys
                got = torch.zeros(sq, sk, dtype=torch.int)
                for b in boxes:
                    nq, nk = b.q_end - b.q_start, b.k_end - b.k_start
                    assert 0 <= b.q_start < b.q_end <= sq and 0 <= b.k_start < b.k_end <= sk, (b, sq, sk)
                    causal, (left, right) = flash_mask(b.band, nq, nk)
                    seen = kernel_mask(*kernel_window(causal, left, right, nk + max_k_extra), nq, nk)
                    got[b.q_start : b.q_end, b.k_start : b.k_end] += seen.int()
                assert torch.equal(got, want.int()), (sq, sk, band, boxes, max_k_extra)
            rows = [r for b in boxes for r in range(b.q_start, b.q_end)]
            assert len(rows) == len(set(rows)), (sq, sk, band, boxes)  # rows in one box each: nothing to merge
            box = band.trim(sq, sk) if band is not None else None
            if box is not None and flash_expressible(box.band, box.q_end - box.q_start, box.k_end - box.k_start):
                assert boxes == [box]
            split += len(boxes) > 1
            cases += 1
    assert cases > 90000 and split > 1000


def test_flash_window_refuses_a_window_the_kernels_would_change():
    """The issue's block: 4 queries on 2 keys, key j visible from query i iff j <= i. Its window (-1, 2) would
    reach every key (2 >= s_k), so it is refused, and flash_boxes runs the first row on its own."""
    with pytest.raises(ValueError, match=r"flash-attn's kernels would run another mask on it; split it"):
        Band(None, 0).flash_window(4, 2)
    assert [(b.q_start, b.q_end, b.k_start, b.k_end, b.band) for b in flash_boxes(Band(None, 0), 4, 2)] == [
        (0, 1, 0, 1, None),
        (1, 4, 0, 2, None),
    ]
    assert Band(-4, 4).flash_window(8, 8) == (4, 4) and Band(None, 2).flash_window(2, 4) == (-1, 0)


def test_torch_flash_runs_a_narrow_window_in_one_launch():
    """A 16-key window on a 1024-token block: one forward and one backward launch of the windowed CUDA op
    (the kernel before cut it into ~3 launches per 16 rows), exact against fp64 math on its rounded inputs."""
    g = torch.Generator().manual_seed(5)
    s, band = 1024, Band(-15, 0)
    q, k, v, dout = (torch.randn(1, s, 2, 8, generator=g, dtype=torch.float64).bfloat16() for _ in range(4))
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref, ref_lse = attention_with_lse(*leaves, True, 0.3, window=(15, 0))
    ref.backward(dout.double())
    with torch_flash_on_cpu() as launches:
        kernel = select_kernel(torch.device("cpu"), torch.bfloat16, "torch_flash")
        out, lse = kernel.forward(q, k, v, band, 0.3)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, band, 0.3)
    assert dict(launches) == {"forward": 1, "backward": 1}
    tol = TOLERANCES[torch.bfloat16]
    for key, got, want in (("out", out, ref), ("lse", lse, ref_lse), ("dq", dq, leaves[0].grad)):
        assert norm_err(got, want) < tol.of(key), key
    for key, got, want in (("dk", dk, leaves[1].grad), ("dv", dv, leaves[2].grad)):
        assert norm_err(got, want) < tol.of(key), key
    assert rel_err(out, ref) < tol.end_to_end


TORCH_FLASH_CASES = [  # (s_q, s_k, causal, window as passed, window as the C++ runs it)
    *((sq, sk, c, w, w) for sq, sk, c, w, cap in FLASH_CONVENTION_CASES if not cap),
    (4, 2, False, (-1, 2), (-1, -1)),  # right >= s_k: unbounded, so the first row sees key 1 too
    (10, 4, False, (3, -1), (3, 4)),  # an unbounded right side next to a bounded left one: s_k
    (10, 4, False, (3, 9), (3, 4)),  # a right side >= s_k next to a bounded left one: s_k
]


@pytest.mark.parametrize("sq, sk, causal, window, runs_as", TORCH_FLASH_CASES)
def test_torch_flash_stand_in_runs_windows_as_the_cpp_does(sq, sk, causal, window, runs_as):
    """PyTorch's flash ops on CPU (testing.torch_flash_cpu) against fp64 in flash-attn's conventions (masks
    bottom-right, GQA, empty rows at lse +inf), with the window their C++ really runs (tests above: the kernel
    never passes one it would change)."""
    q, dout = (torch.randn(2, sq, 4, 16, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (1, 2))
    k, v = (torch.randn(2, sk, 2, 16, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (3, 4))
    with torch_flash_on_cpu():
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            False,
            scale=0.4,
            window_size_left=window[0],
            window_size_right=window[1],
        )
        grads = torch.ops.aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            rng,
            unused,
            scale=0.4,
            window_size_left=window[0],
            window_size_right=window[1],
        )
    want = flash_reference(q, k, v, dout, 0.4, causal, runs_as)
    empty = torch.isinf(want[1])
    assert lse.dtype == torch.float32 and torch.equal(torch.isinf(lse), empty)
    got = (out, lse.masked_fill(empty, 0), *grads)
    ref = (want[0], want[1].masked_fill(empty, 0), *want[2:])
    for key, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, ref):  # tiny blocks: a mask error is O(1)
        assert g.shape == w.shape and rel_err(g, w) < TOLERANCES[torch.bfloat16].end_to_end, key


def test_torch_flash_stand_in_varlen_window_against_max_k():
    """A varlen call (cum_seq given) runs one window normalised against max_k, each sequence on its own lengths."""
    cu_q, cu_k = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([0, 2, 8], dtype=torch.int32)
    q, k, v = (
        torch.randn(8, h, 16, generator=torch.Generator().manual_seed(s)).bfloat16()
        for s, h in ((5, 4), (6, 2), (7, 2))
    )
    with torch_flash_on_cpu():
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, 4, 6, 0.0, False, False, scale=0.4, window_size_left=None, window_size_right=2
        )
    assert lse.shape == (4, 8)
    for rq, rk in ((slice(0, 4), slice(0, 2)), (slice(4, 8), slice(2, 8))):
        want = flash_reference(q[rq][None], k[rk][None], v[rk][None], q[rq][None], 0.4, False, (-1, 2))
        assert rel_err(out[rq], want[0][0]) < TOLERANCES[torch.bfloat16].end_to_end
        assert rel_err(lse[:, rq], want[1][0]) < TOLERANCES[torch.bfloat16].end_to_end


def test_the_kernel_names_are_the_choices():
    """The one list of kernel names (megatron_2d.layout.choices.KERNELS, what --cp-2d-kernel and cp_2d_kernel
    take) is the registry's."""
    from megatron_2d.layout.choices import KERNELS as NAMES

    assert set(KERNELS) == set(NAMES) and len(NAMES) == len(set(NAMES))


def test_the_choice_is_printed_once(caplog):
    """The automatic choice is logged (rank 0, or no process group) once per distinct choice, not per call."""
    caplog.set_level(logging.INFO, logger="megatron_2d.kernels")
    for _ in range(3):
        assert select_kernel(torch.device("cpu"), torch.float32, head_dim=40).name == "cpu_flash"
    lines = [x for x in caplog.messages if "head dim 40" in x]
    assert lines == ["megatron_2d: attention kernel cpu_flash (float32, head dim 40 on cpu)"]
