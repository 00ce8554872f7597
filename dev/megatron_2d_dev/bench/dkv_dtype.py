"""bf16 error of dK/dV when the ring's riders travel in fp32 ("accumulator") or in bf16 ("input", TE's bytes).

    python tools/dkv_dtype_error.py            # cp = 2, 4, 8 on forked CPU ranks, and a simulated cp = 64

Forked runs: hp = 1, w = 1 (every rider hop on the ring), causal, bf16 inputs; the reference is fp64 attention on
the same bf16-rounded inputs, so only the op's own rounding is measured. Simulated cp = 64: one rank's dK is the
sum of 64 partials (one per ring step, each computed exactly and rounded to bf16 as a kernel returns it); the
sum is kept in fp32 or rounded to bf16 after every hop, in ring order, and compared with the fp64 sum.
"""

from __future__ import annotations

import argparse
import datetime

import torch

import megatron_2d
from megatron_2d.layout.choices import DKV_COMM_DTYPES
from megatron_2d.testing.distributed import run_on_ranks
from megatron_2d.testing.reference import reference_attention, rel_err

from ..cli import add_arguments, render_table


def ring_errors(rank: int, world: int, seq_per_rank: int, heads: int, dim: int) -> dict[str, float]:
    """Max relative error of this rank's dK and dV shard for both rider dtypes."""
    groups = megatron_2d.build_2d_groups(1, 1, timeout=datetime.timedelta(seconds=120))
    S = seq_per_rank * world
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(S, 1, heads, dim, generator=g).to(torch.bfloat16).double() for _ in range(4))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    reference_attention(*leaves, True, dim**-0.5).backward(dout)
    out = {}
    for mode in DKV_COMM_DTYPES:
        ql, kl, vl = (
            megatron_2d.shard_sequence(x, rank, world).to(torch.bfloat16).requires_grad_(True) for x in (q, k, v)
        )
        megatron_2d.attention_2d(ql, kl, vl, groups, dkv_comm_dtype=mode).backward(
            megatron_2d.shard_sequence(dout, rank, world).to(torch.bfloat16)
        )
        out[mode] = max(
            rel_err(kl.grad, megatron_2d.shard_sequence(leaves[1].grad, rank, world)),
            rel_err(vl.grad, megatron_2d.shard_sequence(leaves[2].grad, rank, world)),
        )
    return out


def simulated_errors(cp: int, numel: int = 1 << 16, seed: int = 0) -> dict[str, float]:
    """Rounding of a cp-hop rider sum: partials ~ N(0, 1) rounded to bf16, summed in fp32 or bf16 per hop."""
    g = torch.Generator().manual_seed(seed)
    partials = torch.randn(cp, numel, generator=g, dtype=torch.float64).to(torch.bfloat16)
    exact = partials.double().sum(0)
    fp32, bf16 = torch.zeros(numel), torch.zeros(numel, dtype=torch.bfloat16)
    for p in partials:
        fp32 += p.float()
        bf16 = (bf16.float() + p.float()).to(torch.bfloat16)
    return {"accumulator": rel_err(fp32, exact), "input": rel_err(bf16, exact)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_arguments(parser, seq_per_rank=256, heads=4, dim=64).parse_args(argv)
    body = []
    for cp in (2, 4, 8):
        per_rank = run_on_ranks(cp, ring_errors, args.seq_per_rank, args.heads, args.dim, timeout_s=600)
        worst = {m: max(r[m] for r in per_rank) for m in DKV_COMM_DTYPES}
        body.append([str(cp), f"{worst['accumulator']:.2e}", f"{worst['input']:.2e}", "forked ranks"])
    for cp in (8, 64):
        sim = simulated_errors(cp)
        body.append([str(cp), f"{sim['accumulator']:.2e}", f"{sim['input']:.2e}", "simulated rider sum"])
    render_table(
        "bf16 dK/dV: max relative error against fp64 on the same rounded inputs",
        ["cp", "riders in fp32 (accumulator)", "riders in bf16 (input, TE's bytes)", "how"],
        body,
        width=120,
    )


if __name__ == "__main__":
    main()
