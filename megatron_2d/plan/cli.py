"""``python -m megatron_2d.plan``: rank context-parallel layouts for a model, cluster and sequence length.

    python -m megatron_2d.plan --model 7B-GQA --cluster 8xH100 --gpus 64 --seq 128K
    python -m megatron_2d.plan --model 7B-MHA --cluster 8xA100 --gpus 32 --tp 2 --seq 256K --json
    python -m megatron_2d.plan --model 7B-GQA --cluster 8xH200 --gpus 64 --seq 128K --plot plan.png
    python -m megatron_2d.plan grid [--details]        # best 2D vs best stock over models, GPUs, lengths
    python -m megatron_2d.plan --gpus 64 --seq 128K --lengths-dist one-half     # packed documents, both modes
    python -m megatron_2d.plan --gpus 64 --seq 128K --lengths lengths.txt       # one length per line / JSON list
    python -m megatron_2d.plan --model 70B-GQA --tp 8 --gpus 64 --seq 256K      # Hybrid ZeRO, Checkpoint++ planned
    python -m megatron_2d.plan --gpus 32 --seq 1M --fair-memory   # stock gets the same memory options (what-if)
    python -m megatron_2d.plan paper                   # LoongTrain's reported figures next to the planner's
    python -m megatron_2d.plan --dynamic --gpus 8 --seq 256K --mix long-tail --max-seqlen-per-rank 4K
                                                       # a global batch's sequences: static CP vs hybrid (dynamic) CP

Exit status: 0 with a recommendation; 1 when no layout is feasible (the plan is still printed, with the smallest
memory found and what would help) or when --plot cannot be written; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from ..layout.choices import DKV_COMM_DTYPES, DkvCommDtype
from .console import parse_seq, parse_window
from .grid import main as grid_main
from .hardware import CLUSTER_PRESETS, MODEL_PRESETS, ParallelSpec, PlanError, get_cluster, get_model
from .job import CHOICES as MEMORY_CHOICES
from .job import Job, MemoryPolicy
from .kernel_rates import PLANNED_KERNELS
from .lengths import DISTRIBUTIONS, SEQUENCE_MIXES, document_lengths, read_lengths, sequence_lengths
from .links import FLAGS as LINK_FLAGS
from .links import IDEAL_LINKS, LinkEfficiency
from .memory import RECOMPUTE_MODES
from .paper import main as paper_main
from .planner import AUTO, plan, recommended
from .plot import DEFAULT_SEQS, PlotUnavailable, plot_sweep
from .report import job_metadata, plan_json, print_plan

EXIT_OK, EXIT_NO_FEASIBLE, EXIT_USAGE = 0, 1, 2
DKV_DTYPE_ALIASES = {"fp32": DkvCommDtype.ACCUMULATOR, "bf16": DkvCommDtype.INPUT, "fp16": DkvCommDtype.INPUT}
"""``--dkv-dtype`` values (element types) as the op's ``dkv_comm_dtype`` names, for bf16 training."""


def _cp(text: str) -> int | None:
    if text.lower() in ("all", "auto", "left"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--cp {text!r}: give a positive integer or 'all' (all GPUs left)")
    return int(text)


def _dkv_dtype_alias(text: str) -> str:
    """--dkv-dtype (the planner's earlier vocabulary) in the op's: fp32 -> accumulator, bf16 / fp16 -> input."""
    if text not in DKV_DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(
            f"--dkv-dtype {text!r} is not one of {list(DKV_DTYPE_ALIASES)} (or use "
            f"--dkv-comm-dtype {{{','.join(DKV_COMM_DTYPES)}}})"
        )
    return DKV_DTYPE_ALIASES[text]


def _positive(text: str) -> int:
    if not text.lstrip("+").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer (use --all to list every layout)")
    return int(text)


def link_efficiency(args, base: LinkEfficiency) -> LinkEfficiency:
    """The cluster's link efficiency with the command line's --ideal-links and --*-eff / --interference applied."""
    links = IDEAL_LINKS if args.ideal_links else base
    given = {name: getattr(args, flag[2:].replace("-", "_")) for name, (flag, _) in LINK_FLAGS.items()}
    given = {k: v for k, v in given.items() if v is not None}
    return replace(links, **given) if given else links


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_2d.plan",
        description="Rank 2D-Attention (LoongTrain) layouts and Megatron's stock context "
        "parallelism by predicted attention time.",
    )
    _model_arguments(p)
    _cluster_arguments(p)
    _link_arguments(p)
    _job_arguments(p)
    _packed_arguments(p)
    _dynamic_arguments(p)
    _output_arguments(p)
    return p


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """The model preset and its overrides."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default="7B-GQA", help=f"preset: {', '.join(MODEL_PRESETS)} (default 7B-GQA)")
    for name, hlp in (
        ("layers", "layers"),
        ("hidden", "hidden size D"),
        ("heads", "query heads"),
        ("kv-heads", "key/value heads"),
        ("ffn", "MLP intermediate size"),
        ("vocab", "vocabulary"),
    ):
        g.add_argument(f"--{name}", type=int, help=f"override the preset's {hlp}")


def _cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster preset and its overrides."""
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", default="8xH100", help=f"preset: {', '.join(CLUSTER_PRESETS)} (default 8xH100)")
    c.add_argument("--gpus", type=int, required=True, help="total GPUs (world size)")
    c.add_argument("--gpus-per-node", type=int, help="GPUs per NVLink node")
    c.add_argument("--tflops", type=float, help="dense bf16 peak per GPU, TFLOP/s")
    c.add_argument(
        "--attn-eff",
        type=float,
        help="attention-kernel efficiency (fraction of peak) for every kernel, e.g. a measured one (default: "
        "each kernel's published rate on the cluster's architecture, megatron_2d.plan.kernel_rates)",
    )
    c.add_argument(
        "--kernel",
        choices=PLANNED_KERNELS,
        default=None,
        help="the attention kernel 2D runs (default: what its selection picks, as stock TE's: te_fused on "
        "Hopper, flash_attn2 on Ampere); the flags then carry --cp-2d-kernel. Stock runs TE's kernel",
    )
    c.add_argument(
        "--qk-clip",
        action="store_true",
        help="QK-clip (Megatron's --qk-clip / --log-max-attention-logit): every attention forward also computes the "
        "max attention logit; charged as a separate q k^T pass per ring step unless the kernel's launch returns it "
        "(te_fused: TE 2.9+), plus two all-reduces",
    )
    c.add_argument("--dense-eff", type=float, help="dense-GEMM efficiency for the non-attention part (default 0.6)")
    c.add_argument("--nvlink-gbps", type=float, help="NVLink GB/s per GPU per direction")
    c.add_argument("--net-gbps", type=float, help="network GB/s per node (all NICs)")
    c.add_argument("--nics", type=int, help="NICs per node")
    c.add_argument("--gpu-mem-gb", type=float, help="memory per GPU, GB")
    c.add_argument(
        "--mem-fraction",
        type=float,
        help="fraction of GPU memory a layout may use (default 0.9: context, NCCL, fragmentation)",
    )


def _link_arguments(p: argparse.ArgumentParser) -> None:
    """Link efficiency and interference (defaults: megatron_2d.plan.links)."""
    e = p.add_argument_group("link efficiency (megatron_2d.plan.links: defaults from published NCCL measurements)")
    for flag, what in LINK_FLAGS.values():
        e.add_argument(flag, type=float, metavar="X", help=what)
    e.add_argument(
        "--ideal-links",
        action="store_true",
        help="every flow at its nominal rate and no interference (then the flags above adjust that)",
    )


def _job_arguments(p: argparse.ArgumentParser) -> None:
    """The job: sequence, parallel sizes, mask; then how it may hold its memory."""
    j = p.add_argument_group("job")
    j.add_argument("--seq", type=parse_seq, required=True, help="sequence length: 131072, 128K or 1M")
    j.add_argument("--tp", type=int, default=1, help="tensor-parallel size (fixed)")
    j.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (fixed)")
    j.add_argument("--dp", type=int, help="data-parallel size (default: what is left after --cp, or 1)")
    j.add_argument("--cp", type=_cp, default=None, help="context-parallel size, or 'all' GPUs left (default)")
    j.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    j.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="TP without Megatron's --sequence-parallel (the activation model assumes it on by default)",
    )
    j.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    j.add_argument(
        "--hybrid-pattern",
        default=None,
        metavar="PATTERN",
        help="a HybridModel's --hybrid-layer-pattern (e.g. 'M*-M*-'): 2D costed on the attention layers "
        "('*', each with one MLP), Mamba (M) / GDN (G) layers' own all-to-all over the whole CP "
        "group added to every layout",
    )
    j.add_argument(
        "--window",
        type=parse_window,
        default=None,
        help="causal sliding window (tokens back, e.g. 4096 or 4K) on every layer, or a per-layer pattern "
        "repeated over the layers, 'full' for a full causal layer (e.g. 128,full); p2p and a2a+p2p "
        "are then refused as Transformer Engine refuses them",
    )
    _memory_arguments(j)


def _memory_arguments(j: argparse._ArgumentGroup) -> None:
    """Recompute, model-state options and the dK/dV riders' dtype (in the job's group)."""
    j.add_argument(
        "--recompute",
        default=AUTO,
        choices=(AUTO,) + RECOMPUTE_MODES,
        help="activation recompute: auto (default: the fastest mode that fits in memory, per layout), "
        "or force one: none, selective (Megatron core attention), full, ckpt++ (Selective "
        "Checkpoint++ keeping attention outputs, 2D only), ckpt++inputs (keeping its head-layout inputs too)",
    )
    j.add_argument(
        "--memory",
        default="auto",
        choices=MEMORY_CHOICES,
        help="model-state options: auto (default: each side its own; 2D Hybrid ZeRO, stock the distributed "
        "optimizer and megatron-fsdp), dist-opt (everyone the distributed optimizer only), stock "
        "(everyone Megatron's own: 2D without Hybrid ZeRO's partial sharding), all (auto plus "
        "optimizer states sharded wider than params, which needs gradient clipping off)",
    )
    j.add_argument(
        "--fair-memory",
        action="store_true",
        help="what-if: stock baselines get 2D's memory options (Hybrid ZeRO) and, hypothetically, "
        "Selective Checkpoint++, to separate what 2D gains by itself from what memory options give",
    )
    j.add_argument(
        "--global-batch",
        type=parse_seq,
        default=4 << 20,
        metavar="TOKENS",
        help="tokens per optimizer step, e.g. 4M (default): per-step gradient and parameter communication "
        "is spread over its micro-batches",
    )
    j.add_argument(
        "--dkv-comm-dtype",
        default=DkvCommDtype.ACCUMULATOR,
        choices=DKV_COMM_DTYPES,
        help="how the 2D ring's dK/dV partials travel, the op's --cp-2d-dkv-comm-dtype: accumulator "
        "(fp32, the default) or input (bf16; the recommended flags then carry it); Transformer "
        "Engine's rings are always modelled with input",
    )
    j.add_argument(
        "--dkv-dtype",
        dest="dkv_comm_dtype",
        type=_dkv_dtype_alias,
        metavar="{fp32,bf16,fp16}",
        help="the older spelling of --dkv-comm-dtype: fp32 = accumulator, bf16 or fp16 = input",
    )


def _packed_arguments(p: argparse.ArgumentParser) -> None:
    """Packed documents: their lengths, from a file or a named distribution."""
    k = p.add_argument_group("packed documents (THD)")
    src = k.add_mutually_exclusive_group()
    src.add_argument(
        "--lengths",
        metavar="FILE",
        help="document lengths of one packed sequence (one per line, or a JSON list), summing to --seq: "
        "each layout is predicted in both packed modes (2D zigzag and documents; stock THD zigzag)",
    )
    src.add_argument(
        "--lengths-dist",
        choices=DISTRIBUTIONS,
        help="a named length distribution with --seq tokens in all (see megatron_2d.plan.lengths)",
    )
    k.add_argument("--lengths-seed", type=int, default=0, help="seed of --lengths-dist (default 0)")


def _dynamic_arguments(p: argparse.ArgumentParser) -> None:
    """Dynamic (hybrid) context parallelism: a global batch's sequence lengths planned both ways."""
    d = p.add_argument_group("dynamic (hybrid) context parallelism (megatron_2d.plan.dynamic)")
    d.add_argument(
        "--dynamic",
        action="store_true",
        help="plan one global batch of sequences both ways: one static CP size (for the longest) with packed "
        "samples, and Megatron's hybrid CP (a CP group per sequence) with a 2D layout per group size; says which "
        "wins and by how much. --gpus counts the DP x CP ranks (times --tp); lengths from --lengths or --mix",
    )
    d.add_argument(
        "--mix",
        choices=SEQUENCE_MIXES,
        help="a named sequence mix with --seq tokens in all (see megatron_2d.plan.lengths)",
    )
    d.add_argument(
        "--max-seqlen-per-rank",
        type=parse_seq,
        metavar="TOKENS",
        help="Megatron's --max-seqlen-per-dp-cp-rank (default: the longest sequence / the DP x CP ranks)",
    )


def _output_arguments(p: argparse.ArgumentParser) -> None:
    """What to print or plot."""
    o = p.add_argument_group("output")
    o.add_argument("--top", type=_positive, default=15, help="feasible layouts to list (default 15)")
    o.add_argument("--all", action="store_true", help="list every feasible layout")
    o.add_argument(
        "--json",
        action="store_true",
        help="print JSON: a list of objects with the same keys, one per candidate, each with the job's "
        "metadata ('job') and 'recommended'",
    )
    o.add_argument("--plot", metavar="PATH", help="write a PNG of predicted time vs sequence length")
    o.add_argument(
        "--plot-seqs",
        type=parse_seq,
        nargs="+",
        default=list(DEFAULT_SEQS),
        help="sequence lengths for --plot (default 32K 64K 128K 256K 512K 1M)",
    )


def _specs(args):
    model = get_model(args.model)
    overrides = {
        k: v
        for k, v in (
            ("layers", args.layers),
            ("hidden", args.hidden),
            ("heads", args.heads),
            ("kv_heads", args.kv_heads),
            ("ffn_hidden", args.ffn),
            ("vocab", args.vocab),
        )
        if v is not None
    }
    if overrides:
        model = replace(model, name=f"{model.name}(custom)", **overrides)
    cluster = get_cluster(args.cluster)
    changes = {
        k: v
        for k, v in (
            ("gpus_per_node", args.gpus_per_node),
            ("peak_tflops", args.tflops),
            ("attn_efficiency", args.attn_eff),
            ("dense_efficiency", args.dense_eff),
            ("nvlink_gbps", args.nvlink_gbps),
            ("net_gbps_per_node", args.net_gbps),
            ("nics_per_node", args.nics),
            ("gpu_memory_gb", args.gpu_mem_gb),
            ("usable_memory_fraction", args.mem_fraction),
        )
        if v is not None
    }
    links = link_efficiency(args, cluster.links)
    if links != cluster.links:
        changes["links"] = links
    if changes:
        cluster = cluster.with_(name=f"{cluster.name}(custom)", **changes)
    parallel = ParallelSpec(
        gpus=args.gpus,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        dp=args.dp,
        micro_batch=args.micro_batch,
        sequence_parallel=not args.no_sequence_parallel,
    )
    return model, cluster, parallel


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grid"] or "--grid" in argv:
        return grid_main([a for a in argv if a not in ("grid", "--grid")])
    if argv[:1] == ["paper"]:
        return paper_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dynamic:
        return _dynamic_main(args, parser)
    if args.mix or args.max_seqlen_per_rank:
        parser.error("--mix and --max-seqlen-per-rank plan a sequence mix: add --dynamic")
    try:
        model, cluster, parallel = _specs(args)
        causal = not args.no_causal
        if args.window is not None and not causal:
            raise PlanError("--window models causal sliding windows; drop --no-causal")
        lengths = None
        if args.lengths:
            try:
                lengths = read_lengths(args.lengths).tolist()
            except (OSError, ValueError) as err:
                raise PlanError(f"--lengths: {err}") from None
        elif args.lengths_dist:
            lengths = document_lengths(args.lengths_dist, args.seq, args.lengths_seed).tolist()
        if lengths is not None and args.plot:
            raise PlanError("--plot sweeps sequence lengths; it does not take packed --lengths")
        memory = MemoryPolicy(args.memory, args.fair_memory, args.global_batch)
        job = Job(
            model,
            cluster,
            parallel,
            args.seq,
            causal,
            args.window,
            args.recompute,
            args.dkv_comm_dtype,
            lengths=lengths,
            hybrid_pattern=args.hybrid_pattern,
            memory=memory,
            kernel=args.kernel,
            qk_clip=args.qk_clip,
        )
        cands = plan(job)
    except PlanError as err:
        parser.error(str(err))
    if args.json:
        job = job_metadata(
            model, cluster, parallel, args.seq, causal, args.window, args.recompute, args.dkv_comm_dtype, memory
        )
        print(plan_json(cands, job))
    else:
        if lengths is not None:
            srt = sorted(lengths)
            print(
                f"packed: {len(lengths)} documents of {sum(lengths)} tokens ("
                f"{args.lengths or args.lengths_dist}), longest {srt[-1]}, median {srt[len(srt) // 2]}; "
                f"rows per layout: 2d zigzag / 2d documents / stock THD zigzag (padded to 2*CP)"
            )
        print_plan(
            cands,
            model,
            cluster,
            parallel,
            args.seq,
            None if args.all else args.top,
            causal,
            window=args.window,
            memory=memory,
        )
    status = EXIT_OK if recommended(cands) is not None else EXIT_NO_FEASIBLE
    if status != EXIT_OK:
        print(
            "no feasible layout (see the plan above for the smallest memory found and what would help)", file=sys.stderr
        )
    if args.plot:
        try:
            plot_sweep(
                args.plot,
                model,
                cluster,
                parallel,
                args.plot_seqs,
                causal,
                args.window,
                args.recompute,
                args.dkv_comm_dtype,
                memory,
            )
            print(f"wrote {args.plot}", file=sys.stderr)
        except PlotUnavailable as err:
            print(f"cannot write {args.plot}: {err}", file=sys.stderr)
            status = EXIT_NO_FEASIBLE if status == EXIT_OK else status
    return status


def _dynamic_main(args, parser: argparse.ArgumentParser) -> int:
    """``--dynamic``: a global batch's sequences, static CP vs hybrid CP (megatron_2d.plan.dynamic)."""
    import json

    from .dynamic import plan_length_mix

    try:
        if args.pp != 1:
            raise PlanError("--dynamic plans megatron-core 0.19's hybrid CP, which runs without pipelining: --pp 1")
        if args.lengths_dist:
            raise PlanError("--lengths-dist names documents of one packed sequence; with --dynamic use --mix")
        if bool(args.lengths) == bool(args.mix):
            raise PlanError("--dynamic needs the sequence lengths: --lengths FILE or --mix NAME (with --seq tokens)")
        model, cluster, _ = _specs(replace_cp(args))
        if args.gpus % args.tp:
            raise PlanError(f"--gpus {args.gpus} is not divisible by --tp {args.tp}")
        ranks = args.gpus // args.tp
        try:
            lengths = (
                read_lengths(args.lengths).tolist()
                if args.lengths
                else sequence_lengths(args.mix, args.seq, args.lengths_seed).tolist()
            )
        except (OSError, ValueError) as err:
            raise PlanError(f"--lengths: {err}") from None
        longest = args.max_seqlen_per_rank or -(-max(lengths) // ranks)
        result = plan_length_mix(model, cluster, ranks, lengths, longest, args.tp)
    except PlanError as err:
        parser.error(str(err))
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print("\n".join(result.describe(lengths, longest)))
    return EXIT_OK


def replace_cp(args):
    """``args`` with the job's parallel sizes reset (--dynamic chooses CP itself)."""
    return argparse.Namespace(**{**vars(args), "cp": None, "dp": None})
