#!/usr/bin/env python
"""Memory report for a model and a 2D layout: activations per recompute mode, and model states per sharding choice.

    python tools/memory_report.py [--ranks 4 --hp 2 --inner-ring-size 1 --layers 4 --hidden 256 --heads 8 --kv-heads 2
                                   --seq 1024 --plot memory.png] [--tp 2 [--sequence-parallel]]

``--tp``: the ranks are TP x CP (CP = ranks / TP); ``--sequence-parallel``: Megatron's SP (its norms: megatron-core's
FusedLayerNorm over apex's function stood in, megatron_2d_dev.sp_norms). The planner's activation model
(megatron_2d.plan.memory) assumes SP unless ParallelSpec(sequence_parallel=False); tests/test_memory_report.py
compares both with it.

Activations: bytes kept for backward by the decoder layers of one micro-batch on one rank, measured on forked CPU
ranks as the unique storages (parameters excluded) of every tensor autograd saved during the forward (torch's
saved-tensor hooks) and of every tensor Selective Checkpoint++'s keepers hold at its end, for
    none                     no recompute
    selective                megatron's selective recompute of core attention (recompute_modules=["core_attn"])
    full                     megatron's full-layer recompute (uniform, 1 layer per checkpoint)
    ckpt++ outputs           full-layer recompute with Selective Checkpoint++ keeping the attention output and lse
    ckpt++ attention-inputs  ... keeping also the head-layout q and K/V (and the output in both layouts)
with the extra forward FLOPs each mode spends in backward (closed form, per rank), the extra all-to-all and ring
bytes it sends (measured), and for the Checkpoint++ rows the bytes their policy should keep (:func:`kept_formula`:
full's measured bytes plus the kept tensors' sizes). Model states: bytes per rank under each Hybrid ZeRO choice,
from megatron_2d.megatron.model_state_bytes_per_rank (megatron-core's layouts; checked against the real optimizer
in tests/test_hybrid_zero.py), for --model-params parameters (default: a 7B model) in bf16 with fp32 grads and Adam.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

import torch  # noqa: E402

from megatron_2d.layout.choices import CHECKPOINT_KEEPS  # noqa: E402
from megatron_2d.megatron.checkpoint_plus import fingerprint_elements  # noqa: E402
from megatron_2d.testing.distributed import run_on_ranks  # noqa: E402
from megatron_2d_dev import tiny_gpt as tg  # noqa: E402
from megatron_2d_dev.cli import add_arguments, render_table  # noqa: E402
from megatron_2d_dev.megatron_cpu import install_megatron_cpu_shims  # noqa: E402

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
MODES = {
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "full": FULL,
    **{
        f"ckpt++ {keep}": dict(FULL, selective_checkpoint_plus_plus=True, selective_checkpoint_plus_plus_keep=keep)
        for keep in CHECKPOINT_KEEPS
    },
}
FP32 = 4  # the report's models train in fp32 (so do their log-sum-exps)


class SavedTensorBytes:
    """Saved-tensor hooks that total the unique storages autograd keeps for backward (parameters excluded)."""

    def __init__(self, params) -> None:
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.param_ptrs:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def kept_formula(args, full_bytes: float) -> dict[str, float]:
    """Bytes per layer each Checkpoint++ policy should keep, from full recompute's measured ``full_bytes`` and the
    sizes of what the policy adds (per rank, fp32; s = seq / CP tokens, h = heads, g = K/V heads, d head dim,
    L = lcm(g, hp) K/V heads after replication):

        ckpt++ outputs           = full + out + lse + c                  out = b*s*h*d*4 (the ring's output,
                                                                         head layout), lse = b*s*h*4
        ckpt++ attention-inputs  = full + q + kv + out + lse + out' + c  q = b*s*h*d*4, kv = b*s*L*2d*4 (the
                                                                         head all-to-all's outputs), out' = out
                                                                         after the inverse exchange (none at
                                                                         hp 1 with b 1: a view of out)

    c: the elements the recompute check samples from q, k and v in the first pass (64 or 65 each, fp32)."""
    b, s, h, g, hp = (
        args.batch,
        args.seq // (args.ranks // args.tp),
        args.heads // args.tp,
        args.kv_heads // args.tp,
        args.hp,
    )
    d = args.hidden // h
    kv_heads = math.lcm(g, hp)
    out, lse = b * s * h * d * FP32, b * s * h * FP32
    q, kv = b * s * h * d * FP32, b * s * kv_heads * 2 * d * FP32
    check = FP32 * sum(fingerprint_elements(n) for n in (b * s * h * d, b * s * g * d, b * s * g * d))
    return {
        "ckpt++ outputs": full_bytes + out + lse + check,
        "ckpt++ attention-inputs": full_bytes + q + kv + out + lse + (out if hp > 1 or b > 1 else 0) + check,
    }


def layer_flops(args, cp: int) -> dict[str, float]:
    """Forward FLOPs of one decoder layer on one rank: dense GEMMs and attention (causal: half the scores); ``cp``:
    the ranks sharing the layer (TP x CP: TP splits the GEMMs and the heads).

    dense = 2 * tokens * (h*(h + 2*kv*d) [QKV] + h*h [proj] + 2*h*ffn [MLP]);  tokens = b*s/cp
    attention = 4 * b * s^2 * h / 2 (causal) / cp   (QK^T and PV, shared evenly by the zigzag layout)
    """
    h, d = args.hidden, args.hidden // args.heads
    tokens = args.batch * args.seq / cp
    dense = 2 * tokens * (h * (h + 2 * args.kv_heads * d) + h * h + 2 * h * 4 * h)
    attention = 4 * args.batch * args.seq**2 * h / 2 / cp
    return {"dense": dense, "attention": attention}


def measure(rank, world, args) -> dict[str, dict]:
    from megatron_2d.megatron import TransformerConfig2D, get_gpt_layer_spec_2d

    tg.init_parallel(tensor_model_parallel_size=args.tp, context_parallel_size=world // args.tp)
    spec = get_gpt_layer_spec_2d(use_transformer_engine=False)
    out = {}
    for mode, recompute in MODES.items():
        cfg = tg.TinyGPTConfig(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            num_query_groups=args.kv_heads,
            seq_length=args.seq,
            micro_batch_size=args.batch,
            config_class=TransformerConfig2D,
            cp_comm_type="2d",
        )
        cfg.config_overrides = dict(
            cp_2d_head_parallel_size=args.hp,
            cp_2d_inner_ring_size=args.inner_ring_size,
            sequence_parallel=args.sequence_parallel,
            **recompute,
        )
        model = tg.build_tiny_gpt(cfg, spec)
        hooks = SavedTensorBytes(model.parameters())
        decoder_forward = model.decoder.forward
        keepers = [layer.self_attention.core_attention.keeper for layer in model.decoder.layers]

        def hooked_forward(*a, **k):
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                out = decoder_forward(*a, **k)
            for keeper in keepers:  # what Checkpoint++ holds until the recompute
                for t in keeper.kept_tensors() if keeper is not None else ():
                    hooks.pack(t)
            return out

        model.decoder.forward = hooked_forward
        groups = model.decoder.layers[0].self_attention.core_attention.groups
        groups.comm_bytes.reset()
        tg.forward_backward(model, tg.synthetic_batch(cfg))
        out[mode] = {"activation_bytes_per_layer": hooks.total / args.layers, "comm_bytes": groups.comm_bytes.as_dict()}
    return out


def report(args) -> list[dict]:
    from megatron_2d_dev.sp_norms import apex_layer_norm

    with apex_layer_norm() if args.sequence_parallel else contextlib.nullcontext():
        per_rank = run_on_ranks(args.ranks, measure, args, timeout_s=600)
    flops = layer_flops(args, args.ranks)
    extra_flops = {
        "none": 0.0,
        "selective": flops["attention"],
        "full": flops["dense"] + flops["attention"],
        **{f"ckpt++ {keep}": flops["dense"] for keep in CHECKPOINT_KEEPS},
    }
    base = per_rank[0]["none"]["comm_bytes"]
    activations = {mode: max(r[mode]["activation_bytes_per_layer"] for r in per_rank) for mode in MODES}
    formula = kept_formula(args, activations["full"])
    rows = []
    for mode in MODES:
        act = activations[mode]
        comm = per_rank[0][mode]["comm_bytes"]
        rows.append(
            {
                "mode": mode,
                "activation_MiB_per_layer": act / 2**20,
                "formula_MiB_per_layer": formula[mode] / 2**20 if mode in formula else None,
                "extra_fwd_GFLOP_per_layer": extra_flops[mode] / 1e9,
                "extra_fwd_flops_vs_layer_fwd": extra_flops[mode] / (flops["dense"] + flops["attention"]),
                "extra_a2a_MiB": (comm["all_to_all"] - base["all_to_all"]) / 2**20 / args.layers,
                "extra_ring_MiB": sum(comm[k] - base[k] for k in ("inner_ring", "outer_ring")) / 2**20 / args.layers,
            }
        )
    return rows


def print_activation_table(rows, args) -> None:
    render_table(
        f"Activations kept for backward per decoder layer, one micro-batch, per rank: "
        f"{args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, seq "
        f"{args.seq}, b {args.batch}, fp32, TP={args.tp}{' with SP' if args.sequence_parallel else ''} x "
        f"CP={args.ranks // args.tp} (hp {args.hp} x cp {args.ranks // args.tp // args.hp}, w {args.inner_ring_size})",
        [
            "recompute mode",
            "activations MiB/layer",
            "formula MiB/layer",
            "extra fwd GFLOP/layer",
            "extra fwd / layer fwd",
            "extra a2a MiB/layer",
            "extra ring MiB/layer",
        ],
        [
            [
                r["mode"],
                f"{r['activation_MiB_per_layer']:.3f}",
                "-" if r["formula_MiB_per_layer"] is None else f"{r['formula_MiB_per_layer']:.3f}",
                f"{r['extra_fwd_GFLOP_per_layer']:.3f}",
                f"{100 * r['extra_fwd_flops_vs_layer_fwd']:.0f}%",
                f"{r['extra_a2a_MiB']:.2f}",
                f"{r['extra_ring_MiB']:.2f}",
            ]
            for r in rows
        ],
        width=180,
    )


def zero_choices(dp: int, cp: int):
    """(label, HybridZeRO) for LoongTrain's choices: what is sharded, over CP only or over all dp x cp ranks."""
    from megatron_2d.megatron import HybridZeRO

    choices = [("replicated (DDP)", HybridZeRO(sharded_states="none"))]
    for states in ("optimizer", "optimizer+grads", "optimizer+grads+params"):
        for size in sorted({cp, dp * cp}):
            choices.append((f"{states}, over {size} ranks", HybridZeRO(sharded_states=states, shard_size=size)))
    choices.append(
        (
            f"optimizer+grads+params over {cp}, optimizer over {dp * cp}",
            HybridZeRO(sharded_states="optimizer+grads+params", shard_size=cp, optimizer_shard_size=dp * cp),
        )
    )
    return choices


def model_state_rows(args) -> list[dict]:
    from megatron_2d.megatron import model_state_bytes_per_rank

    rows = []
    for label, choice in zero_choices(args.dp, args.ranks):
        b = model_state_bytes_per_rank(args.model_params, choice, args.dp, args.ranks)
        rows.append({"choice": label, **{k: v / 2**30 for k, v in b.items()}, "total": sum(b.values()) / 2**30})
    return rows


def print_model_state_table(rows, args) -> None:
    render_table(
        f"Model states per rank, {args.model_params / 1e9:.1f}B parameters, bf16 params, fp32 grads, "
        f"Adam, DP={args.dp} x CP={args.ranks}",
        ["sharded states", "params GiB", "grads GiB", "optimizer GiB", "total GiB"],
        [[r["choice"], *(f"{r[k]:.2f}" for k in ("params", "grads", "optimizer", "total"))] for r in rows],
        width=160,
    )


def plot(activation_rows, state_rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    modes = [r["mode"] for r in activation_rows]
    left.bar(modes, [r["activation_MiB_per_layer"] for r in activation_rows], color="tab:blue")
    left.set_ylabel("activations kept for backward per layer (MiB)")
    twin = left.twinx()
    twin.plot(modes, [100 * r["extra_fwd_flops_vs_layer_fwd"] for r in activation_rows], "o-", color="tab:red")
    twin.set_ylabel("extra forward FLOPs (% of a layer forward)", color="tab:red")
    left.set_title("Recompute modes (measured activations)")
    left.tick_params(axis="x", labelrotation=20)
    labels = [r["choice"] for r in state_rows]
    bottom = [0.0] * len(state_rows)
    for key, color in (("params", "tab:green"), ("grads", "tab:orange"), ("optimizer", "tab:purple")):
        values = [r[key] for r in state_rows]
        right.barh(labels, values, left=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xlabel("GiB per rank")
    right.invert_yaxis()
    right.legend()
    right.set_title("Hybrid ZeRO: model states per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description="Activation and model-state memory per recompute / sharding choice")
    add_arguments(p, ranks=4, hp=2, inner_ring_size=1, layers=4, hidden=256, heads=8, kv_heads=2, seq=1024, batch=1)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the ranks are TP x CP; default 1)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron's sequence parallelism (TP > 1)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel size for the model-state table")
    p.add_argument("--model-params", type=int, default=6_738_415_616, help="parameters (default: a 7B model)")
    p.add_argument("--plot", default="memory_report.png", help="PNG of both tables ('' for none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    install_megatron_cpu_shims()  # megatron-core on CPU ranks
    rows = report(args)
    print_activation_table(rows, args)
    states = model_state_rows(args)
    print_model_state_table(states, args)
    if args.plot:
        plot(rows, states, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
