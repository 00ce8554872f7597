#!/usr/bin/env python
"""One-device check of the block kernels and of attention_2d, for a session lent a GPU (also runs on CPU).

    python tools/gpu_smoke.py --device cuda      # every kernel that runs there, fwd+bwd vs an fp64 reference
    python tools/gpu_smoke.py --device cpu

For each kernel that supports the device and dtype: forward out/lse and backward dq/dk/dv of one block (causal
and full, MHA and GQA) against fp64 math, then attention_2d on a world of one rank (gloo on CPU, NCCL on CUDA)
with that kernel. The reference is fp64 math on the same (rounded) inputs, so each output is held to its own bound
from the project's one tolerance table (megatron_2d.testing.reference.TOLERANCES: norm_err per output, rel_err end
to end). Prints one line per case and exits non-zero if any error exceeds its bound.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import megatron_2d
from megatron_2d.band import Band
from megatron_2d.kernels import KERNELS, select_kernel
from megatron_2d.testing.reference import (TOLERANCES, attention_with_lse, norm_err, packed_reference_attention,
                                            reference_attention, rel_err)


def worst(pairs, dtype):
    """The largest error of (output name, actual, expected) pairs as a fraction of its bound (> 1 fails)."""
    tol = TOLERANCES[dtype]
    return max(max(norm_err(a, e) / tol.of(key), rel_err(a, e) / tol.end_to_end) for key, a, e in pairs)


def check_kernel(name, device, dtype, causal, hkv, seq=256):
    kernel = select_kernel(device, dtype, name)
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(2, seq, 8, 64, generator=g).to(device, dtype)
    k, v = (torch.randn(2, seq, hkv, 64, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn(2, seq, 8, 64, generator=g).to(device, dtype)
    scale = 64 ** -0.5
    leaves = [x.detach().double().clone().requires_grad_(True) for x in (q, k, v)]
    ref, ref_lse = attention_with_lse(*leaves, causal, scale)
    ref.backward(dout.double())
    band = Band(None, 0) if causal else None                        # the kernels take a band, not a flag
    out, lse = kernel.forward(q, k, v, band, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, band, scale)
    return worst([("out", out, ref), ("lse", lse, ref_lse), ("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad),
                  ("dv", dv, leaves[2].grad)], dtype)


def seeded_randn(*shape, device, dtype, seed=0):
    """The same inputs on every run and device (drawn on the CPU), so a case's error is reproducible."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def check_attention_2d(name, device, dtype):
    q, k, v, dout = (seeded_randn(512, 2, h, 64, device=device, dtype=dtype, seed=i)
                     for i, h in enumerate((8, 2, 2, 8)))
    leaves = [x.detach().double().clone().requires_grad_(True) for x in (q, k, v)]
    ref = reference_attention(*leaves, True, 64 ** -0.5)
    ref.backward(dout.double())
    groups = megatron_2d.build_2d_groups(1, 1)
    ql, kl, vl = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups, kernel=name)
    out.backward(dout)
    return worst([("out", out, ref), ("dq", ql.grad, leaves[0].grad), ("dk", kl.grad, leaves[1].grad),
                  ("dv", vl.grad, leaves[2].grad)], dtype)


def check_packed(name, device, dtype, mode):
    """Packed documents through attention_2d (on GPU: flash-attn's varlen launches) against a per-document fp64
    reference."""
    lengths = [3, 200, 1, 57, 128, 33, 90]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
    q, k, v, dout = (seeded_randn(int(cu[-1]), h, 64, device=device, dtype=dtype, seed=i)
                     for i, h in enumerate((8, 2, 2, 8)))
    leaves = [x.detach().double().clone().requires_grad_(True) for x in (q, k, v)]
    ref = packed_reference_attention(*leaves, cu, True, 64 ** -0.5)
    ref.backward(dout.double())
    groups = megatron_2d.build_2d_groups(1, 1)
    layout = megatron_2d.PackedLayout(cu, groups, mode=mode)
    ql, kl, vl = (layout.shard(x.detach()).requires_grad_(True) for x in (q, k, v))
    out = megatron_2d.attention_2d(ql, kl, vl, groups, kernel=name, packing=layout)
    out.backward(layout.shard(dout))
    return worst([("out", out, ref), ("dq", ql.grad, leaves[0].grad), ("dk", kl.grad, leaves[1].grad),
                  ("dv", vl.grad, leaves[2].grad)], dtype)


def check_no_sync(name, device, dtype):
    """On CUDA: a second attention_2d fwd+bwd (plain and packed) under torch's sync debug mode set to "error", so
    any host-device synchronisation on the op's hot path raises. Returns 0.0 (no bound to compare against)."""
    q, k, v, dout = (seeded_randn(512, 2, h, 64, device=device, dtype=dtype, seed=i)
                     for i, h in enumerate((8, 2, 2, 8)))
    groups = megatron_2d.build_2d_groups(1, 1)
    cu = torch.tensor([0, 3, 200, 201, 400, 512])
    layout = megatron_2d.PackedLayout(cu, groups, mode="documents")
    packed = [layout.shard(x.flatten(0, 1)[:512]) for x in (q, k, v, dout)]

    def step():
        for args, kwargs in (((q, k, v, dout), {}), (packed, {"packing": layout})):
            leaves = [x.detach().clone().requires_grad_(True) for x in args[:3]]
            megatron_2d.attention_2d(*leaves, groups, kernel=name, **kwargs).backward(args[3])

    step()                                                       # builds and caches the setup
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    failures = 0
    for name in KERNELS:
        for dtype in TOLERANCES:
            try:
                select_kernel(device, dtype, name)
            except ValueError as err:
                print(f"{name:12s} {str(dtype):15s} not run here: {err}")
                continue
            cases = [(f"block causal={c} hkv={h}", lambda c=c, h=h: check_kernel(name, device, dtype, c, h))
                     for c in (True, False) for h in (8, 2)]
            cases.append(("attention_2d world=1", lambda: check_attention_2d(name, device, dtype)))
            cases += [(f"packed {m} world=1", lambda m=m: check_packed(name, device, dtype, m))
                      for m in ("zigzag", "documents")]
            if device.type == "cuda":
                cases.append(("no host sync (2nd call)", lambda: check_no_sync(name, device, dtype)))
            for label, run in cases:
                try:
                    err = run()
                except Exception as exc:                          # one broken case must not hide the others
                    failures += 1
                    print(f"{name:12s} {str(dtype):15s} {label:26s} FAIL {type(exc).__name__}: {exc}")
                    continue
                ok = err < 1.0
                failures += not ok
                print(f"{name:12s} {str(dtype):15s} {label:26s} worst error / bound {err:.2f} {'ok' if ok else 'FAIL'}")
    dist.destroy_process_group()
    print("all passed" if not failures else f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
