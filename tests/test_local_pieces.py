"""Single-process pieces: the (out, lse) merge, the block plan, the local kernels."""

import contextlib
import itertools
import warnings

import pytest
import torch

from megatron_2d.band import Band
from megatron_2d.block_plan import BlockCall, plan_block
from megatron_2d.kernels import KERNELS, select_kernel
from megatron_2d.kernels.torch_flash import ANTICAUSAL, CAUSAL, FULL, band_pieces
from megatron_2d.merge import merge_attention_
from megatron_2d.sequence_layout import shard_sequence, unshard_sequence

from megatron_2d.testing.reference import TOLERANCES, attention_with_lse, norm_err, rel_err
from megatron_2d.testing.torch_flash_cpu import torch_flash_on_cpu


def test_merge_equals_full_softmax():
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    k, v = torch.randn(2, 12, 3, 8, dtype=torch.float64), torch.randn(2, 12, 3, 8, dtype=torch.float64)
    full, full_lse = attention_with_lse(q, k, v)
    out = torch.zeros(2, 5, 3, 8, dtype=torch.float64)
    lse = torch.full((2, 3, 5), float("-inf"), dtype=torch.float64)
    for part in (slice(0, 4), slice(4, 5), slice(5, 12)):  # uneven blocks, any order
        o, l = attention_with_lse(q, k[:, part], v[:, part])
        merge_attention_(out, lse, o, l)
    assert rel_err(out, full) < 1e-12 and rel_err(lse, full_lse) < 1e-12


def test_merge_row_subsets_in_place():
    """Merging into row views of larger buffers (as the ring does) updates only those rows."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 6, 2, 4, dtype=torch.float64) for _ in range(3))
    out = torch.zeros(1, 6, 2, 4, dtype=torch.float64)
    lse = torch.full((1, 2, 6), float("-inf"), dtype=torch.float64)
    o, l = attention_with_lse(q[:, 2:4], k, v)
    merge_attention_(out[:, 2:4], lse[:, :, 2:4], o, l)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2])) and torch.isinf(lse[:, :, 4:]).all()
    assert rel_err(out[:, 2:4], o) < 1e-12


LARGE_LOGITS = [(torch.float32, 100.0), (torch.float32, -110.0), (torch.float64, 100.0), (torch.float64, -110.0),
                (torch.float64, 750.0)]


@pytest.mark.parametrize("dtype, logit", LARGE_LOGITS,
                         ids=[f"{str(dt)[6:]}-logit{lg:+.0f}" for dt, lg in LARGE_LOGITS])
def test_merge_large_logits(dtype, logit):
    """Blocks whose scores sit near +-100: merging in the accumulators' dtype must stay exact. exp(100) overflows
    fp32 and exp(-110) underflows it; exp(750) overflows fp64 (fp32's lse cannot even hold 750 to 1e-6)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 2, 4, generator=g, dtype=torch.float64) for n in (3, 9, 9))
    # scores = logit + small spread: q . k * scale with q, k aligned
    scale = 1.0
    k = k * 0.1 + q.mean(1, keepdim=True)
    q = q * 0 + q[:, :1]
    base = torch.einsum("bqhd,bkhd->bhqk", q, k).mean()
    k_shift = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    k_shift[..., 0] = (logit - base) / q[0, 0, :, 0].unsqueeze(0)
    k = k + k_shift
    full, full_lse = attention_with_lse(q, k, v, scale=scale)
    assert (full_lse - logit).abs().max() < 20          # the logits really are near the target
    out = torch.zeros(1, 3, 2, 4, dtype=dtype)
    lse = torch.full((1, 2, 3), float("-inf"), dtype=dtype)
    for part in (slice(0, 2), slice(2, 7), slice(7, 9)):
        o, l = attention_with_lse(q, k[:, part], v[:, part], scale=scale)
        merge_attention_(out, lse, o.to(dtype), l.to(dtype))
    tol = {torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
    assert torch.isfinite(lse).all() and torch.isfinite(out).all()
    assert rel_err(out, full) < tol and rel_err(lse, full_lse) < tol


def test_merge_keeps_accumulator_through_an_empty_start():
    """The accumulator starts at lse = -inf, out = 0: the first merge takes the block exactly."""
    g = torch.Generator().manual_seed(5)
    o, l = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 2, 4, generator=g) * 50
    out, lse = torch.zeros(1, 4, 2, 8), torch.full((1, 2, 4), float("-inf"))
    merge_attention_(out, lse, o, l)
    assert torch.equal(out, o) and torch.equal(lse, l)


def test_plan_zigzag_half_blocks():
    # CP=4, hp=1: context rank 1 holds chunks (1, 6).
    assert plan_block([1, 6], [1, 6], 4, causal=True) == [BlockCall(0, 8, 0, 8, Band(None, 0))]
    assert plan_block([1, 6], [0, 7], 4, causal=True) == [BlockCall(0, 8, 0, 4, None)]   # all Q, first half K
    assert plan_block([1, 6], [3, 4], 4, causal=True) == [BlockCall(4, 8, 0, 8, None)]   # second half Q, all K
    assert plan_block([1, 6], [3, 4], 4, causal=False) == [BlockCall(0, 8, 0, 8, None)]


def test_plan_matches_token_mask():
    """Every plan, for arbitrary disjoint chunk sets, reproduces the token-level causal mask exactly."""
    c = 2
    for q_chunks, kv_chunks in [([0, 3, 4, 7], [1, 2, 5, 6]), ([1, 2, 5, 6], [0, 3, 4, 7]), ([2, 9], [0, 1, 10, 11])]:
        mask = torch.zeros(len(q_chunks) * c, len(kv_chunks) * c, dtype=torch.bool)
        for call in plan_block(q_chunks, kv_chunks, c, causal=True):
            assert call.band is None
            mask[call.q_start:call.q_end, call.k_start:call.k_end] = True
        qpos = torch.tensor([x * c + t for x in q_chunks for t in range(c)])
        kpos = torch.tensor([y * c + t for y in kv_chunks for t in range(c)])
        assert torch.equal(mask, kpos[None, :] < qpos[:, None])


def test_shard_round_trip_matches_megatron():
    x = torch.arange(2 * 48).view(2, 48)
    for cp in (1, 2, 3, 4):
        shards = [shard_sequence(x, r, cp, seq_dim=1) for r in range(cp)]
        assert torch.equal(unshard_sequence(shards, seq_dim=1), x)
        # the index formula of Megatron's get_batch_on_this_cp_rank
        for r in range(cp):
            v = x.view(2, 2 * cp, 48 // (2 * cp))
            idx = torch.tensor([r, 2 * cp - r - 1])
            assert torch.equal(shards[r], v.index_select(1, idx).reshape(2, -1))


def test_shard_rejects_indivisible_sequence():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2\*CP = 4.*multiple of 4 \(e.g. 8 or 12\)"):
        shard_sequence(torch.zeros(10), 0, 2)


CPU_KERNELS = [name for name in KERNELS if name != "flash_attn2"]   # flash_attn2: tests/test_flash_attn_releases.py
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLASH_ONLY = {"torch_flash": ("bf16", "fp16")}   # PyTorch's CUDA flash kernel, run on CPU by torch_flash_on_cpu
KERNEL_CASES = [(n, dt, c, h) for n, dt, c, h in itertools.product(CPU_KERNELS, DTYPES, [True, False], [4, 2, 1])
                if dt in FLASH_ONLY.get(n, DTYPES)]


def on_cpu(name):
    """The context a kernel needs to run on CPU here (torch_flash: CPU kernels for PyTorch's CUDA flash ops)."""
    return torch_flash_on_cpu() if name == "torch_flash" else contextlib.nullcontext()


def block_case(dtype, causal, hkv, scale=0.3, seed=2):
    """Inputs of one block in ``dtype`` and the fp64 reference built from exactly those (rounded) inputs:
    (q, k, v, dout, {out, lse, dq, dk, dv} references)."""
    g = torch.Generator().manual_seed(seed)
    b, sq, hq, d = 2, 16, 4, 32
    sk = sq if causal else 24
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    dout = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64).to(dtype)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref, ref_lse = attention_with_lse(*leaves, causal, scale)
    ref.backward(dout.double())
    return q, k, v, dout, dict(out=ref, lse=ref_lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)


@pytest.mark.parametrize("name, dtype, causal, hkv", KERNEL_CASES,
                         ids=[f"{n}-{dt}-{'causal' if c else 'full'}-hkv{h}" for n, dt, c, h in KERNEL_CASES])
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
    bad = {key: norm_err(got[key], want[key]) for key in got
           if not norm_err(got[key], want[key]) < TOLERANCES[dtype].of(key)}
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


class FakeFlashAttn2:
    """Plays the flash_attn2 kernel class for selection tests: an installed flash-attn (the real packages run in
    tests/test_flash_attn_releases.py, each in its own process)."""

    name = "flash_attn2"

    def supports(self, device, dtype):
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def head_dim_problem(self, head_dim):
        from megatron_2d.kernels.flash_attn2 import flash_head_dim_problem
        return flash_head_dim_problem(head_dim)


def test_kernel_selection_on_cuda_devices(monkeypatch):
    """The choice on a CUDA device (no CUDA tensor is made): flash-attn 2 for fp16/bf16 when it imports, else
    PyTorch's own flash kernel with a warning; fp32/fp64 refused (no kernel that materialises scores on CUDA);
    head dims the flash kernels cannot take refused at selection, automatic or named."""
    import megatron_2d.kernels as kernels

    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "flash_attn_available", lambda: False)       # flash-attn not installed
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.warns(UserWarning, match="flash-attn is not installed: attention_2d uses PyTorch's own flash"):
            assert select_kernel(cuda, dtype, head_dim=128).name == "torch_flash"
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match=rf"flash kernels, which take fp16 or bf16, not {dtype}"):
            select_kernel(cuda, dtype)
    with pytest.raises(ValueError, match=r"'torch_math' does not run on device cuda"):
        select_kernel(cuda, torch.float32, "torch_math")
    monkeypatch.setattr(kernels, "flash_attn_available", lambda: True)
    monkeypatch.setitem(kernels.KERNELS, "flash_attn2", FakeFlashAttn2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for d in (64, 128, 192, 256, 8):
            assert select_kernel(cuda, torch.bfloat16, head_dim=d).name == "flash_attn2"
        assert select_kernel(cuda, torch.float16, "torch_flash", head_dim=64).name == "torch_flash"
    for name in ("flash_attn2", "torch_flash", None):
        with pytest.raises(ValueError, match=r"head dim 60 is not supported by the flash kernels \(a multiple of "
                                             r"8, at most 256; pad to 64\)"):
            select_kernel(cuda, torch.bfloat16, name, head_dim=60)
        with pytest.raises(ValueError, match=r"head dim 264 is not supported by the flash kernels \(a multiple of 8, "
                                             r"at most 256\)$"):
            select_kernel(cuda, torch.bfloat16, name, head_dim=264)
    with pytest.raises(ValueError, match=r"'flash_attn2' does not run on device cuda with torch.float32"):
        select_kernel(cuda, torch.float32, "flash_attn2")
    with pytest.raises(ValueError, match=r"no attention kernel runs on device type 'mps'"):
        select_kernel(torch.device("mps"), torch.float32)


def test_torch_flash_pieces_cover_every_band_exactly_once():
    """The torch_flash kernel's pieces (full rectangles, causal and anti-causal squares) of every trimmed band on
    blocks up to 12 x 12 add up to the band's mask, each visible pair once, all inside the block."""
    cases = 0
    for sq, sk in itertools.product(range(1, 13), repeat=2):
        for lo, hi in itertools.product([None, *range(-13, 13)], repeat=2):
            box = Band(lo, hi).trim(sq, sk) if (lo, hi) != (None, None) else None
            if box is None:
                continue
            nq, nk, band = box.q_end - box.q_start, box.k_end - box.k_start, box.band
            want = torch.tensor([[band is None or band.visible(i, j) for j in range(nk)] for i in range(nq)])
            got = torch.zeros(nq, nk, dtype=torch.int)
            for p in band_pieces(band, nq, nk):
                assert 0 <= p.q_start < p.q_end <= nq and 0 <= p.k_start < p.k_end <= nk, (p, nq, nk, band)
                ones = torch.ones(p.q_end - p.q_start, p.k_end - p.k_start, dtype=torch.int)
                assert p.kind == FULL or ones.shape[0] == ones.shape[1], p
                got[p.q_start:p.q_end, p.k_start:p.k_end] += {FULL: ones, CAUSAL: ones.tril(),
                                                              ANTICAUSAL: ones.triu()}[p.kind]
            assert torch.equal(got, want.int()), (sq, sk, lo, hi)
            cases += 1
    assert cases > 40000
    assert [p.kind for p in band_pieces(Band(None, 0), 8, 8)] == [CAUSAL]    # native cases stay one call
    assert [p.kind for p in band_pieces(None, 8, 12)] == [FULL]


def test_comm_counter_counts_by_kind_and_refuses_unknown_kinds():
    from megatron_2d.comm import COMM_KINDS, CommCounter, RingExchange

    counter = CommCounter()
    counter.add("inner_ring", 10)
    counter.add("inner_ring", 5)
    counter.add("all_to_all", 7)
    assert counter.as_dict() == {**{kind: 0 for kind in COMM_KINDS}, "inner_ring": 15, "all_to_all": 7}
    with pytest.raises(ValueError, match=r"unknown communication kind 'ring'"):
        counter.add("ring", 1)
    counter.reset()
    assert set(counter.as_dict().values()) == {0}
    with pytest.raises(ValueError, match=r"a ring exchange needs at least 2 ranks, got \[3\]"):
        RingExchange(None, [3], 0, counter, "inner_ring")
    ring = RingExchange(None, [4, 9, 2], 0, counter, "outer_ring")      # ring order, not rank order
    assert (ring.next_rank, ring.prev_rank) == (9, 2)


@pytest.mark.parametrize("ranges, first_key", [
    ([(0, 8)], 0),                   # one partial covering every key: a copy
    ([(2, 5)], 0),                   # one partial inside: zeros on both sides
    ([(0, 3), (5, 8)], 0),           # disjoint, a gap between them
    ([(5, 8), (0, 3)], 0),           # the same, out of order
    ([(0, 5), (3, 8)], 0),           # overlapping: summed
    ([(10, 13), (14, 18)], 10),      # keys counted from first_key
    ([], 0),                         # nothing visible: all zeros
])
def test_gather_partials_writes_every_key(ranges, first_key):
    from megatron_2d.transport import add_partials, gather_partials

    gen = torch.Generator().manual_seed(0)
    # dK (width 3) and dV (width 2) side by side in the block format [b, keys, g, dk + dv]
    partials = [(lo, hi, (torch.randn(1, hi - lo, 2, 3, generator=gen, dtype=torch.bfloat16),
                          torch.randn(1, hi - lo, 2, 2, generator=gen, dtype=torch.bfloat16))) for lo, hi in ranges]
    buffer = torch.full((1, 8, 2, 5), float("nan"))         # uninitialised memory may hold anything
    expected = torch.zeros(1, 8, 2, 5)
    for lo, hi, (dk, dv) in partials:
        expected[:, lo - first_key:hi - first_key, :, :3] += dk.float()
        expected[:, lo - first_key:hi - first_key, :, 3:] += dv.float()
    assert gather_partials(buffer, partials, first_key) is buffer
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)
    add_partials(buffer, partials, first_key)
    torch.testing.assert_close(buffer, 2 * expected, rtol=0, atol=0)


@pytest.mark.parametrize("receive_early", [True, False], ids=["gloo-early", "with-the-send"])
def test_direct_exchange_receives_into_the_expected_buffer(receive_early):
    from megatron_2d.testing.distributed import run_on_ranks

    def body(rank, world, receive_early):
        import torch.distributed as dist

        from megatron_2d.comm import CommCounter, DirectExchange

        counter = CommCounter()
        peer = (rank + 1) % world
        exchange = DirectExchange(dist.group.WORLD, peer, (rank - 1) % world, counter, "outer_ring")
        exchange._receive_early = receive_early                # NCCL's path: the receive is posted with the send
        made = []
        exchange.expect(lambda: made.append(torch.full((3,), -1.0)) or made[-1])
        assert len(made) == (1 if receive_early else 0)         # the buffer is taken only when it is posted
        pending = exchange.start(torch.full((3,), float(rank)))
        received = pending.wait()
        assert received is made[0]
        # a second exchange without expect() receives into a buffer of its own
        plain = exchange.start(torch.full((2,), float(rank) + 10)).wait()
        return received.tolist(), plain.tolist(), counter.as_dict()["outer_ring"]

    for rank, (received, plain, sent) in enumerate(run_on_ranks(3, body, receive_early)):
        assert received == [float((rank - 1) % 3)] * 3
        assert plain == [float((rank - 1) % 3) + 10] * 2
        assert sent == 5 * 4                                    # both sends counted, the early receive not


def test_backend_detection_accepts_multi_backend_strings(monkeypatch):
    """A group made with backend="cpu:gloo,cuda:nccl" reports that whole string: its CUDA traffic is NCCL's, so
    collectives need CUDA tensors, the subset-P2P groups get their warm-up, and receives are not posted early.
    (The device is faked: no CUDA here, and torch's CPU build has no NCCL to make such a group.)"""
    import torch.distributed as dist

    import megatron_2d.groups as groups_module
    from megatron_2d.comm import CommCounter, DirectExchange, traffic_backend

    backend = {"name": "cpu:gloo,cuda:nccl"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    group = object()
    assert traffic_backend(group) == "nccl"
    assert groups_module.collective_device(group) == torch.device("cuda", 0)
    asked, reduced = [], []

    def zeros_on_meta(*shape, device=None):                     # records the device the warm-up asks for
        asked.append(torch.device(device))
        return torch.empty(shape, device="meta")

    monkeypatch.setattr(torch, "zeros", zeros_on_meta)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: reduced.append(group))
    groups_module.warm_up_p2p(group)
    assert asked == [torch.device("cuda", 0)] and reduced == [group]      # the warm-up ran, with a CUDA tensor
    assert not DirectExchange(group, 1, 0, CommCounter(), "inner_ring")._receive_early
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)          # a CPU job on the same group: gloo
    assert traffic_backend(group) == "gloo"
    for name, expected in (("nccl", "nccl"), ("gloo", "gloo"), ("cuda:nccl", "nccl"), ("cpu:gloo", "gloo")):
        backend["name"] = name
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert traffic_backend(group) == expected, name
