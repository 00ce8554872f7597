"""The planner's command lines reproduce its plans: each planned row's flags, given to Megatron's own argument
parser (with the 2d flags) and turned into a TransformerConfig2D as pretrain does, arrive as every choice the row
models: the CP layout, the Double-Ring inner ring size and placement, the dK/dV rider dtype, the MLA ring, the recompute
mode and its layers, the memory option and the packed-documents mode. Stock rows arrive as Megatron's own CP."""

from __future__ import annotations

import shlex
import sys

import megatron.training.arguments as megatron_arguments
import pytest

from megatron_2d.layout.choices import DKV_COMM_DTYPES
from megatron_2d.megatron import MLATransformerConfig2D, TransformerConfig2D
from megatron_2d.megatron.arguments import add_2d_arguments, transformer_config_from_args_2d
from megatron_2d.plan import Candidate, ModelSpec, ParallelSpec, get_cluster, get_model, plan
from megatron_2d.plan.cli import main as plan_main
from megatron_2d.plan.lengths import document_lengths
from megatron_2d.plan.memory import CHECKPOINT_PLUS_MODES
from megatron_2d.plan.memory_options import MemoryPolicy, memory_options

pytestmark = pytest.mark.megatron


def model_flags(model: ModelSpec, seq: int) -> list[str]:
    """The model's own flags (what the user's launch script already has)."""
    flags = [
        "--num-layers",
        str(model.layers),
        "--hidden-size",
        str(model.hidden),
        "--num-attention-heads",
        str(model.heads),
        "--ffn-hidden-size",
        str(model.ffn_hidden),
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--micro-batch-size",
        "1",
        "--lr",
        "1e-4",
        "--train-iters",
        "10",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(model.vocab),
        "--position-embedding-type",
        "rope",
        "--no-rope-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--transformer-impl",
        "local",
        "--attention-dropout",
        "0",
    ]
    if model.kv_heads != model.heads:
        flags += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    if model.mla is not None:
        m = model.mla
        flags += [
            "--multi-latent-attention",
            "--q-lora-rank",
            str(m.q_lora_rank),
            "--kv-lora-rank",
            str(m.kv_lora_rank),
            "--qk-head-dim",
            str(m.qk_head_dim),
            "--qk-pos-emb-head-dim",
            str(m.qk_rope_dim),
            "--v-head-dim",
            str(m.v_head_dim),
            "--rope-type",
            "rope",
        ]
    return flags


@pytest.fixture
def parse(monkeypatch):
    """parse_and_validate_args on a simulated job of ``gpus`` ranks (validate_args asks the CUDA arch: Hopper)."""
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setenv("RANK", "0")

    def run(flags: list[str], gpus: int, max_connections: str | None = "1"):
        from megatron.training.global_vars import unset_global_variables

        monkeypatch.setenv("WORLD_SIZE", str(gpus))
        if max_connections is None:  # megatron-fsdp refuses CUDA_DEVICE_MAX_CONNECTIONS=1, CP without it needs 1
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", max_connections)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
        try:
            return megatron_arguments.parse_and_validate_args(extra_args_provider=add_2d_arguments)
        finally:
            unset_global_variables()  # parse_and_validate_args keeps the args in megatron.training's globals

    yield run


def check_arrives(c: Candidate, args, parallel: ParallelSpec) -> None:
    """Every choice ``c`` models, read back from the parsed ``args`` and the config built from them."""
    e, layout = c.estimate, c.scheme
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (parallel.tp, parallel.pp)
    assert args.context_parallel_size == layout.cp_size
    config = transformer_config_from_args_2d(args)
    assert isinstance(config, (TransformerConfig2D, MLATransformerConfig2D))
    if c.kind == "2d":
        assert config.cp_comm_type == "2d"
        assert (config.cp_2d_head_parallel_size, config.cp_2d_inner_ring_size, config.cp_2d_placement) == (
            layout.hp,
            layout.w,
            layout.placement,
        )
        assert config.cp_2d_dkv_comm_dtype == c.dkv_comm_dtype
        assert config.cp_2d_mla_ring == (layout.mla_ring or "expanded")
        assert config.cp_2d_packing == (c.packing if c.packing == "documents" else "zigzag")
    elif c.kind == "a2a+p2p":
        assert config.cp_comm_type == "a2a+p2p"
        assert list(args.hierarchical_context_parallel_sizes) == [layout.hp, layout.cp]
    else:
        assert config.cp_comm_type == c.kind
    # recompute: the mode, and for block recompute the layers per pipeline stage
    mode = "full" if c.note.startswith("hypothetical") else e.recompute
    granularity = {"none": None, "selective": "selective"}.get(mode, "full")
    assert config.recompute_granularity == granularity
    assert getattr(config, "selective_checkpoint_plus_plus", False) == (mode in CHECKPOINT_PLUS_MODES)
    if mode in CHECKPOINT_PLUS_MODES:  # the keep policy the planner costed
        assert config.selective_checkpoint_plus_plus_keep == CHECKPOINT_PLUS_MODES[mode]
    if granularity == "full":
        block = e.recompute_layers not in (0, e.layers)
        assert config.recompute_method == ("block" if block else "uniform")
        assert config.recompute_num_layers == (e.recompute_layers // parallel.pp if block else 1)
    check_states(e.states.option.zero, args, parallel.dp_size, layout.cp_size)


def check_states(zero, args, dp: int, cp: int) -> None:
    """The memory option (how model states are sharded, a HybridZeRO) read back from the parsed args."""
    ddp = zero.ddp_config_kwargs(dp, cp)
    assert args.use_distributed_optimizer == ddp["use_distributed_optimizer"]
    assert args.num_distributed_optimizer_instances == ddp["num_distributed_optimizer_instances"]
    assert args.use_megatron_fsdp == bool(ddp.get("use_megatron_fsdp"))
    if ddp.get("use_megatron_fsdp"):
        assert args.data_parallel_sharding_strategy == ddp["data_parallel_sharding_strategy"]
        assert args.outer_dp_sharding_strategy == ddp["outer_dp_sharding_strategy"]


def choices(c: Candidate) -> dict:
    """What a row chooses, by dimension."""
    e = c.estimate
    return {
        "kind": c.kind,
        "head_parallel": c.hp > 1,
        "double_ring": c.w < c.cp,
        "placement": c.placement,
        "mla_ring": c.scheme.mla_ring,
        "packing": c.packing,
        "recompute": e.recompute,
        "block": e.recompute_layers not in (0, e.layers),
        "states": e.states.option.label,
        "dkv": c.dkv_comm_dtype,
    }


def varied_rows(cands: list[Candidate]) -> list[Candidate]:
    """The rows that run (ds-ulysses has no Megatron flag), each kept when it brings a value not seen before in
    some dimension of :func:`choices` (2D and stock rows apart): every choice the plan makes, in few rows."""
    seen, out = set(), []
    for c in cands:
        if c.runs and c.kind != "ds-ulysses":
            new = {(c.kind == "2d", *item) for item in choices(c).items()} - seen
            if new:
                seen |= new
                out.append(c)
    return out


JOBS = [
    # (what it exercises, model, gpus, tp, pp, sequence, plan keywords)
    ("GQA: windows, placements, stock kinds", "7B-GQA", 64, 1, 1, 1 << 17, {}),
    ("input-dtype riders", "7B-GQA", 64, 1, 1, 1 << 17, {"dkv_comm_dtype": "input"}),
    ("1M tokens: Checkpoint++, block recompute, fsdp-z3", "7B-GQA", 64, 1, 1, 1 << 20, {}),
    ("1M tokens: both Checkpoint++ keep policies", "7B-GQA", 64, 1, 1, 1 << 20, {"recompute": CHECKPOINT_PLUS_MODES}),
    ("selective recompute", "7B-GQA", 32, 1, 1, 1 << 17, {"recompute": "selective"}),
    ("fsdp-z2", "8B-GQA", 32, 1, 1, 1 << 18, {}),
    ("TP 8 x PP 2", "70B-GQA", 128, 8, 2, 1 << 16, {}),
    ("MLA: the expanded and the latent ring", "DSV3-MLA", 64, 8, 1, 1 << 17, {}),
    ("packed documents", "7B-GQA", 32, 1, 1, 1 << 17, {"lengths": "one-half"}),
]
EXPECTED = {
    "input-dtype riders": ("dkv", {"input"}),
    "selective recompute": ("recompute", {"selective"}),
    "1M tokens: Checkpoint++, block recompute, fsdp-z3": ("block", {True}),
    "1M tokens: both Checkpoint++ keep policies": ("recompute", set(CHECKPOINT_PLUS_MODES)),
    "fsdp-z2": ("states", {"fsdp-z2"}),
    "MLA: the expanded and the latent ring": ("mla_ring", {"expanded", "latent"}),
    "packed documents": ("packing", {"zigzag", "documents"}),
}


@pytest.mark.parametrize("what, name, gpus, tp, pp, seq, keywords", JOBS, ids=[j[0] for j in JOBS])
def test_planned_flags_arrive_in_megatron(parse, what, name, gpus, tp, pp, seq, keywords):
    model = get_model(name)
    if keywords.get("lengths"):
        keywords = {**keywords, "lengths": document_lengths(keywords["lengths"], seq, 0).tolist()}
    parallel = ParallelSpec(gpus=gpus, tp=tp, pp=pp)
    rows = varied_rows(plan(model, "8xH100", parallel, seq, **keywords))
    for c in rows:
        fsdp = "--use-megatron-fsdp" in c.flags
        args = parse(model_flags(model, seq) + shlex.split(c.flags), parallel.gpus, None if fsdp else "1")
        check_arrives(c, args, parallel)
    assert "2d" in {c.kind for c in rows} and len(rows) >= 3
    if what in EXPECTED:
        dimension, values = EXPECTED[what]
        assert {choices(c)[dimension] for c in rows if c.kind == "2d"} >= values


def test_every_memory_option_arrives(parse):
    """Each memory option a 2D row may take (Hybrid ZeRO's partial sharding included), as the planner appends it."""
    model, parallel, seq = get_model("7B-GQA"), ParallelSpec(gpus=64, cp=8), 1 << 17
    c = next(c for c in plan(model, "8xH100", parallel, seq, memory=MemoryPolicy("all")) if c.kind == "2d")
    layout_flags = c.flags[: c.flags.index(c.estimate.states.option.flags("2d", parallel.dp_size, 8))]
    options = memory_options("2d", parallel, get_cluster("8xH100"), MemoryPolicy("all"), 8)
    assert {"dist-opt", "fsdp-z2", "fsdp-z3", "hz-z1/8", "hz-z3/8"} <= {o.label for o in options}
    for option in options:
        flags = layout_flags + option.flags("2d", parallel.dp_size, 8)
        fsdp = "--use-megatron-fsdp" in flags
        args = parse(model_flags(model, seq) + shlex.split(flags), parallel.gpus, None if fsdp else "1")
        check_states(option.zero, args, parallel.dp_size, 8)


def test_dkv_dtype_vocabulary_is_the_ops(capsys):
    """The planner takes the op's names (choices.DKV_COMM_DTYPES, which the op checks against); the older
    --dkv-dtype spelling maps onto them."""
    from megatron_2d.attention import check_dkv_comm_dtype

    assert [check_dkv_comm_dtype(name) for name in DKV_COMM_DTYPES] == list(DKV_COMM_DTYPES)
    outputs = {}
    for flags in (["--dkv-comm-dtype", "input"], ["--dkv-dtype", "bf16"], ["--dkv-dtype", "fp32"], []):
        assert plan_main(["--gpus", "64", "--seq", "128K", "--json", "--top", "3", *flags]) == 0
        outputs[" ".join(flags)] = capsys.readouterr().out
    assert outputs["--dkv-comm-dtype input"] == outputs["--dkv-dtype bf16"]
    assert outputs["--dkv-dtype fp32"] == outputs[""]
    assert '"dkv_comm_dtype_2d": "input"' in outputs["--dkv-comm-dtype input"]
    with pytest.raises(SystemExit):
        plan_main(["--gpus", "64", "--seq", "128K", "--dkv-dtype", "fp8"])
    assert "--dkv-dtype 'fp8' is not one of ['fp32', 'bf16', 'fp16']" in capsys.readouterr().err
