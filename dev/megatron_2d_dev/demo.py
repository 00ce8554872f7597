"""CPU demo: a tiny megatron-core model trained with 2D context parallelism next to the same model at CP=1.

The model is a HybridModel of attention and MLP layers (pattern '*-' per GPT block, Megatron's successor to
GPTModel; ``--pattern 'M*-M*-'`` puts Mamba layers beside the 2D attention layers).

    python -m megatron_2d_dev.demo [--ranks 8] [--hp 2] [--inner-ring-size 2] [--placement head_first] [--steps 8]
                               [--sliding-window TOKENS] [--pattern '*-*-*-*-']

Forks N gloo ranks; trains the model for a few Adam steps at CP=1 and at CP=N (hp x N/hp, Double-Ring inner ring size w)
with the "2d" backend, and prints both losses per step and the bytes each rank sent per step, by kind.
"""

from __future__ import annotations

import argparse
import warnings

# megatron-core warns at import about CUDA-only extras (TE, apex) that a CPU demo does not use
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

from megatron_2d.testing.distributed import run_on_ranks  # noqa: E402
from megatron_2d_dev import tiny_gpt as tg  # noqa: E402
from megatron_2d_dev.cli import add_arguments, render_table  # noqa: E402
from megatron_2d_dev.hybrid_cpu import install_hybrid_cpu_shims  # noqa: E402


def train(rank, world, args, context_parallel: bool):
    from megatron_2d.megatron.core_attention import CoreAttention2D
    from megatron_2d.megatron.hybrid_spec import hybrid_stack_spec_2d_local
    from megatron_2d_dev import tiny_hybrid as th

    settings = (args.hp, args.inner_ring_size, args.placement) if context_parallel else None
    overrides = dict(window_size=(args.sliding_window, 0)) if args.sliding_window is not None else {}
    cfg = th.tiny_hybrid_config(
        args.pattern,
        settings,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        seq_length=args.seq,
        micro_batch_size=2,
        config_overrides=overrides,
    )  # Megatron's own sliding window: on both runs
    tg.init_parallel(context_parallel_size=world if context_parallel else 1)
    model = th.build_tiny_hybrid(cfg, args.pattern, hybrid_stack_spec_2d_local)
    attention = next(m for m in model.modules() if isinstance(m, CoreAttention2D))
    counter = attention.groups.comm_bytes  # shared by all layers
    counter.reset()
    losses = tg.train_steps(model, cfg, steps=args.steps, optimizer="adam", lr=args.lr).losses
    per_step = {kind: n // args.steps for kind, n in counter.as_dict().items()}
    return losses, per_step


def run(rank, world, args):
    return train(rank, world, args, False), train(rank, world, args, True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Tiny GPT: 2D context parallelism vs CP=1 on CPU ranks")
    add_arguments(p, ranks=8, hp=2, inner_ring_size=2)
    p.add_argument("--placement", default="head_first", choices=["head_first", "context_first"])
    add_arguments(p, steps=8, hidden=128, heads=8, kv_heads=2, seq=256, lr=3e-3)
    p.add_argument(
        "--pattern",
        default="*-*-*-*-",
        help="HybridModel layers: * attention (2D), - MLP, M Mamba, G GDN (Megatron's own CP for M/G)",
    )
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="Megatron's window_size=(TOKENS, 0) on every layer: K/V then go to neighbours only",
    )
    args = p.parse_args(argv)
    install_hybrid_cpu_shims()  # the demo runs megatron-core on CPU ranks: it asks for the shims
    (ref_losses, _), (losses, sent) = run_on_ranks(args.ranks, run, args, timeout_s=600)[0]

    cp = args.ranks // args.hp
    layout = f"2D: CP={args.ranks} = hp {args.hp} x cp {cp}, w {args.inner_ring_size}, {args.placement}"
    if args.sliding_window is not None:
        layout += f", sliding window {args.sliding_window}"
    render_table(
        f"Tiny HybridModel '{args.pattern}' (hidden {args.hidden}, {args.heads} heads / {args.kv_heads} "
        f"KV heads, RoPE, seq {args.seq}), Adam, {args.ranks} CPU ranks",
        ["step", "loss CP=1", f"loss {layout}", "|difference|"],
        [
            [str(step), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}"]
            for step, (a, b) in enumerate(zip(ref_losses, losses))
        ],
    )
    kinds = {
        "all_to_all": "all-to-all",
        "inner_ring": "inner ring",
        "outer_ring": "outer ring",
        "neighbour": "neighbour exchange",
    }
    render_table(
        "Bytes sent per rank per training step (forward + backward, all layers)",
        list(kinds.values()),
        [[f"{sent[k] / 2**20:.2f} MiB" for k in kinds]],
    )
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref_losses, losses))
    print(f"max relative loss difference over {args.steps} steps: {worst:.1e}")


if __name__ == "__main__":
    main()
