"""Stock Megatron context parallelism (Transformer Engine's ``attn_forward_func_with_cp``) on CPU ranks: generated
cases, the process groups they need, and one case run on its ranks against the fp64 reference.

A :class:`StockCPCase` is what Megatron users choose (``--cp-comm-type``, ``--hierarchical-context-parallel-sizes``,
the CP size, the mask, sbhd or packed THD) and what the data is (dtype, batch, heads, head dims, sequence or
document lengths), all a pure function of its seed, so every rank builds the same case. Inputs are sharded by the
helpers users use: sbhd by Megatron's zigzag split (:func:`megatron_2d.shard_sequence`, identical to
``get_batch_on_this_cp_rank``); THD by TE's own padding rule (every document padded to a multiple of 2 x CP:
``pad_thd_sequences_for_cp`` from 2.8) and ``tex.thd_get_partitioned_indices`` (what megatron-core's per-document
split calls; checked equal to TE's ``get_batch_on_this_cp_rank`` from 2.8). The outputs and gradients are gathered
to whole tensors and measured with ``norm_err`` against the fp64 reference of the rounded inputs, per output.

What each release accepts is TE's decision: a case TE refuses with its own assertion comes back refused, with TE's
message, and :func:`expected_refusal` says which refusals are expected (tests compare the two).

    with te_context_parallel_on_cpu(version) as te:          # in each rank (a parent may have entered it first)
        groups = StockCPGroups(world, cases)                 # collective: every rank, same cases
        result = run_case(te, case, groups)                  # {"out": err, "dq": ..., ...} or a refusal
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_2d.sequence_sharding import shard_sequence, unshard_sequence
from megatron_2d.testing.reference import attention_with_lse, norm_err, rel_err, rounded

COMM_TYPES = ("p2p", "a2a", "a2a+p2p", "all_gather")
FORMATS = ("sbhd", "thd")
OUTPUTS = ("out", "dq", "dk", "dv")

THD_FROM = {"p2p": "2.5", "a2a": "2.12", "all_gather": "2.18", "a2a+p2p": "2.19"}
"""The first release (of those installed here, the first one whose code accepts it) running THD with each comm
type: earlier ones assert ``qkv_format != "thd"``."""


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:2])


@dataclass(frozen=True)
class StockCPCase:
    """One stock CP configuration and its data. ``a2a``: the all-to-all level of a2a+p2p
    (``--hierarchical-context-parallel-sizes a2a cp/a2a``; first level contiguous, as Megatron builds it), cp for
    a2a, 1 for p2p and all_gather."""

    cp: int
    comm: str
    a2a: int
    causal: bool
    qkv_format: str
    dtype: torch.dtype
    batch: int
    heads: int
    groups: int
    head_dim: int
    value_dim: int
    chunk: int
    """sbhd: tokens per zigzag chunk (S = 2 cp chunk); THD: the largest document length."""
    documents: tuple[int, ...] = ()
    """THD: the real document lengths (padded by TE's rule)."""
    seed: int = 0

    @property
    def name(self) -> str:
        split = f"[{self.a2a},{self.cp // self.a2a}]" if self.comm == "a2a+p2p" else ""
        dims = f"d{self.head_dim}" + (f"/{self.value_dim}" if self.value_dim != self.head_dim else "")
        mask = "causal" if self.causal else "full"
        return (
            f"{self.qkv_format} cp{self.cp} {self.comm}{split} {mask} {str(self.dtype)[6:]} b{self.batch} "
            f"h{self.heads}/{self.groups} {dims} seed{self.seed}"
        )

    @property
    def runs_as(self) -> str:
        """The comm type TE runs: a2a+p2p with one level of size 1 is the other level's (TE's own rule)."""
        if self.comm == "a2a+p2p" and self.a2a in (1, self.cp):
            return "p2p" if self.a2a == 1 else "a2a"
        return self.comm

    @property
    def hierarchical_sizes(self) -> list[int] | None:
        return [self.a2a, self.cp // self.a2a] if self.comm == "a2a+p2p" else None


def expected_refusal(version: str, case: StockCPCase) -> str | None:
    """Why ``version`` of TE refuses ``case`` (an assertion of its own), or None. THD: before the release that runs
    it with the comm type (:data:`THD_FROM`); a2a+p2p with one level of size 1 runs as the other level's comm type,
    and 2.5 converts it before its THD check (so [1, cp] runs as p2p there), 2.8 to 2.18 check first. MLA head dims
    (value dim below the query/key dim): p2p only (a2a+p2p [cp, 1] is a2a)."""
    if case.value_dim != case.head_dim and case.runs_as in ("a2a", "all_gather"):
        return f"MLA head dims with {case.runs_as}"
    if case.qkv_format != "thd":
        return None
    release = _version(version)
    comm = case.runs_as if case.comm == "a2a+p2p" and release < (2, 8) else case.comm
    if release < _version(THD_FROM[comm]):
        return f"THD with {comm} from TE {THD_FROM[comm]}"
    return None


def _splits(cp: int) -> list[int]:
    """The a2a levels of a2a+p2p at ``cp``: every divisor (1 and cp: TE runs them as p2p and a2a)."""
    return [a for a in range(1, cp + 1) if cp % a == 0]


def generated_cases(
    seed: int,
    cp_sizes=(2, 4),
    formats=FORMATS,
    dtypes=(torch.bfloat16,),
    splits: str = "all",
) -> list[StockCPCase]:
    """Every comm type (a2a+p2p at each split, or only the ones with both levels > 1: ``splits="proper"``) x mask
    x CP size x format x dtype, each with data drawn from ``seed``: batch 1-2, MHA or GQA with heads the a2a level
    divides, head dims 16-64 (value dim below it, MLA's shape, where TE allows: p2p and a2a+p2p), sbhd chunks of
    4-12 tokens, THD documents of 1 to 3 x (2 cp) tokens (a one-token one among them)."""
    rng = random.Random(seed)
    cases = []
    for cp in cp_sizes:
        for fmt in formats:
            for dtype in dtypes:
                for comm in COMM_TYPES:
                    levels = {"p2p": [1], "a2a": [cp], "all_gather": [1]}.get(comm) or [
                        a for a in _splits(cp) if splits == "all" or 1 < a < cp
                    ]
                    for a2a in levels:
                        for causal in (True, False):
                            cases.append(_draw(rng, cp, comm, a2a, causal, fmt, dtype))
    return cases


def _draw(rng: random.Random, cp, comm, a2a, causal, fmt, dtype) -> StockCPCase:
    groups = rng.choice([g for g in (2, 4, 8) if g % a2a == 0])
    heads = groups * rng.choice((1, 2))
    head_dim = rng.choice((16, 32, 64))
    # MLA (value head dim below the query/key one): p2p and a2a+p2p ([cp, 1] runs as a2a: TE refuses it), one K/V
    # head per query head as MLA has (TE <= 2.12 sizes p2p's output by V's heads: an error with fewer K/V heads)
    mla = comm in ("p2p", "a2a+p2p") and head_dim > 16 and heads == groups and rng.random() < 0.3
    value_dim = head_dim // 2 if mla else head_dim
    chunk = rng.choice((4, 8, 12))
    documents: tuple[int, ...] = ()
    if fmt == "thd":
        longest = 3 * 2 * cp
        documents = tuple([1] + [rng.randint(2, longest) for _ in range(rng.randint(2, 4))])
        documents = tuple(rng.sample(documents, len(documents)))
        chunk = longest
    return StockCPCase(
        cp, comm, a2a, causal, fmt, dtype, rng.choice((1, 2)) if fmt == "sbhd" else 1, heads, groups, head_dim,
        value_dim, chunk, documents, rng.randrange(1 << 30),
    )  # fmt: skip


# ---- groups ----------------------------------------------------------------------------------------------------


class StockCPGroups:
    """The process groups of stock CP layouts ((cp, a2a level) pairs) on a world of ``world`` ranks, made by every
    rank in one order: the world cut into world / cp CP groups of consecutive ranks, each cut for a2a+p2p into
    consecutive a2a groups and strided p2p groups (megatron-core's hierarchical groups). ``layouts``: the pairs, or
    cases (their cp and a2a)."""

    def __init__(self, world: int, layouts) -> None:
        self.world = world
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        pairs = {(x.cp, x.a2a) if isinstance(x, StockCPCase) else tuple(x) for x in layouts}
        for cp, a2a in sorted(pairs):
            if world % cp:
                raise ValueError(f"a world of {world} ranks does not split into CP groups of {cp}")
            for first in range(0, world, cp):
                self._group(range(first, first + cp))
                for sub in self._levels(first, cp, a2a):
                    self._group(sub)

    @staticmethod
    def _levels(first: int, cp: int, a2a: int) -> list[list[int]]:
        ranks = list(range(first, first + cp))
        a2a_groups = [ranks[i : i + a2a] for i in range(0, cp, a2a)]
        p2p_groups = [ranks[i::a2a] for i in range(a2a)]
        return a2a_groups + p2p_groups

    def _group(self, ranks) -> None:
        key = tuple(ranks)
        if key not in self.groups:
            self.groups[key] = dist.new_group(list(key))

    def of(self, case: StockCPCase, rank: int):
        """(cp_group argument of attn_forward_func_with_cp, the CP group's global ranks, this rank's CP rank)."""
        return self.layout(case.cp, case.comm, case.a2a, rank)

    def layout(self, cp: int, comm: str, a2a: int, rank: int):
        """As :meth:`of`, for CP size ``cp``, cp_comm_type ``comm`` and a2a level ``a2a``."""
        first = rank - rank % cp
        ranks = list(range(first, first + cp))
        whole = self.groups[tuple(ranks)]
        if comm != "a2a+p2p":
            return whole, ranks, rank - first
        levels = self._levels(first, cp, a2a)
        a2a_group = next(g for g in levels[: cp // a2a] if rank in g)
        p2p_group = next(g for g in levels[cp // a2a :] if rank in g)
        return [self.groups[tuple(a2a_group)], self.groups[tuple(p2p_group)]], ranks, rank - first

    def whole(self, case: StockCPCase, rank: int) -> dist.ProcessGroup:
        first = rank - rank % case.cp
        return self.groups[tuple(range(first, first + case.cp))]


@dataclass
class InstalledTE:
    """The installed Transformer Engine (on GPUs) as :func:`run_case` takes TE; on CPU ranks it takes the
    :class:`~.te_context_parallel.TEOnCPU` of TE's CPU context."""

    transformer_engine: object
    context_parallel: object
    extension: object

    @property
    def attn_forward_func_with_cp(self):
        return self.context_parallel.attn_forward_func_with_cp

    @property
    def version(self) -> str:
        return str(self.transformer_engine.__version__)


def installed_te() -> InstalledTE:
    """The installed Transformer Engine; ImportError when it does not import."""
    import transformer_engine
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch
    from transformer_engine.pytorch.attention.dot_product_attention import context_parallel

    return InstalledTE(transformer_engine, context_parallel, transformer_engine_torch)


# ---- one case -------------------------------------------------------------------------------------------------------


def _inputs(case: StockCPCase, tokens: int) -> list[torch.Tensor]:
    """q, k, v, dout of the whole problem, fp64 values exactly representable in the case's dtype."""
    g = torch.Generator().manual_seed(case.seed)
    lead = (tokens, case.batch) if case.qkv_format == "sbhd" else (tokens,)
    shapes = [
        (case.heads, case.head_dim), (case.groups, case.head_dim), (case.groups, case.value_dim),
        (case.heads, case.value_dim),
    ]  # fmt: skip
    return [rounded(torch.randn(*lead, *s, generator=g, dtype=torch.float64), case.dtype) for s in shapes]


def _reference(case: StockCPCase, q, k, v, dout, bounds: list[int]) -> dict[str, torch.Tensor]:
    """fp64 out, dq, dk, dv; THD: per document of ``bounds`` (cumulative real lengths)."""
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    scale = case.head_dim**-0.5
    if case.qkv_format == "sbhd":
        out, _ = attention_with_lse(*(x.transpose(0, 1) for x in leaves), causal=case.causal, scale=scale)
        out = out.transpose(0, 1)
    else:
        out = torch.cat([
            attention_with_lse(*(x[a:b][None] for x in leaves), causal=case.causal, scale=scale)[0][0]
            for a, b in zip(bounds[:-1], bounds[1:])
        ])  # fmt: skip
    out.backward(dout)
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def _reference_max_logit(case: StockCPCase, q, k, bounds: list[int]) -> torch.Tensor:
    """[h] fp64: each query head's max of scale * q . k over the pairs its mask allows (THD: within each document of
    ``bounds``, real tokens only)."""
    scale = case.head_dim**-0.5
    k = k.repeat_interleave(case.heads // case.groups, dim=-2)  # each query head's K/V head
    if case.qkv_format == "sbhd":  # [s, b, h, d]: one sequence per batch row
        runs = [(q[:, i], k[:, i]) for i in range(q.shape[1])]
    else:
        runs = [(q[a:b], k[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    best = torch.full((case.heads,), float("-inf"), dtype=torch.float64)
    for qs, ks in runs:
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if case.causal:
            scores = scores.masked_fill(torch.ones(len(qs), len(ks), dtype=torch.bool).triu(1), float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(1, 2)))
    return best


def thd_layout(te, documents, cp: int, cp_rank: int, device: torch.device | None = None):
    """(cu_seqlens of the real lengths, cu_seqlens_padded, the padded stream's source token or -1 for padding,
    this rank's indices into the padded stream) of documents of lengths ``documents``, by TE's padding rule
    (every document to a multiple of 2 cp: TE's ``pad_thd_sequences_for_cp`` from 2.8) and partition
    (``tex.thd_get_partitioned_indices``, what megatron-core's per-document split calls; on ``device``, where the
    real extension runs). The returned tensors are on the CPU."""
    factor = 2 * cp
    documents = [int(n) for n in documents]
    cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.arange(int(cu[-1]))
    pad = getattr(te.context_parallel, "pad_thd_sequences_for_cp", None)
    padded_lengths = [-(-n // factor) * factor for n in documents]
    cu_padded = torch.tensor([0, *torch.tensor(padded_lengths).cumsum(0).tolist()], dtype=torch.int32)
    if pad is not None:  # TE's own rule, from 2.8
        source, _, cu_te = pad(tokens, tokens, cu, factor, padding_token_id=-1, padding_label_id=-1)
        if not torch.equal(cu_te.to(torch.int32), cu_padded):
            raise AssertionError(f"TE pads {documents} to {cu_te.tolist()}, expected {cu_padded.tolist()}")
    else:
        source = torch.full((int(cu_padded[-1]),), -1)
        for a, b, p in zip(cu[:-1].tolist(), cu[1:].tolist(), cu_padded[:-1].tolist()):
            source[p : p + b - a] = tokens[a:b]
    on = cu_padded if device is None else cu_padded.to(device)
    local = te.extension.thd_get_partitioned_indices(on, int(cu_padded[-1]), cp, cp_rank).long().cpu()
    return cu, cu_padded, source, local


def _shard_thd_check(te, case, cu_padded, source, local, group, device) -> None:
    """TE's own THD batch split (from 2.8) picks the same tokens as the partition helper."""
    split = getattr(te.context_parallel, "get_batch_on_this_cp_rank", None)
    if split is None:
        return
    positions = torch.arange(int(cu_padded[-1]), device=device)
    mine = split(cu_padded.to(device), positions, positions, positions, group, "thd")[0].cpu()
    if not torch.equal(mine, local):
        raise AssertionError(f"{case.name}: TE's get_batch_on_this_cp_rank picks {mine.tolist()}, not {local.tolist()}")


def _gather(local: torch.Tensor, group, device: torch.device) -> list[torch.Tensor]:
    local = local.to(device).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [p.cpu() for p in parts]


ROUTES = ("function", "module")
"""How a case reaches TE's CP: ``attn_forward_func_with_cp`` itself, or TE's ``DotProductAttention`` (the module
megatron-core's TEDotProductAttention is: backend query, TE's checks, then the same function)."""


def _call_te(
    te, case: StockCPCase, route: str, q, k, v, meta: dict, cp_group, cp_ranks, max_logit: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """TE's CP attention of this rank's shards, by ``route``; out [tokens(, b), h, dv], and with ``max_logit``
    (the function route, TE 2.9 on) TE's max logit [h] too."""
    scale = case.head_dim**-0.5
    causal_mask = "causal" if case.qkv_format == "sbhd" else "padding_causal"
    mask = causal_mask if case.causal else "no_mask" if case.qkv_format == "sbhd" else "padding"
    if route == "function":
        return te.attn_forward_func_with_cp(
            True, q, k, v, meta["cu_seqlens_q"], meta["cu_seqlens_kv"], meta["max_seqlen_q"], meta["max_seqlen_kv"],
            meta["cu_seqlens_q_padded"], meta["cu_seqlens_kv_padded"], 0.0, cp_group, cp_ranks, torch.cuda.Stream(),
            case.comm, softmax_scale=scale, qkv_format=case.qkv_format, attn_mask_type=mask,
            use_fused_attention=True, window_size=(-1, 0) if case.causal else (-1, -1),
            pad_between_seqs=case.qkv_format == "thd", **({"return_max_logit": True} if max_logit else {}),
        )  # fmt: skip
    if max_logit:
        raise ValueError("max_logit: through the function route only")
    channels = case.head_dim if case.value_dim == case.head_dim else (case.head_dim, case.value_dim)
    module = te.transformer_engine.pytorch.DotProductAttention(
        case.heads, channels, num_gqa_groups=case.groups, qkv_format=case.qkv_format, attn_mask_type=mask,
        cp_group=cp_group, cp_global_ranks=cp_ranks, cp_stream=torch.cuda.Stream(), cp_comm_type=case.comm,
        softmax_scale=scale,
    )  # fmt: skip
    out = module(q, k, v, **({} if case.qkv_format == "sbhd" else meta))
    return out.view(*q.shape[:-1], case.value_dim)  # [.., h * dv] -> [.., h, dv]


def run_case(
    te,
    case: StockCPCase,
    groups: StockCPGroups,
    route: str = "function",
    rank: int | None = None,
    device: torch.device | None = None,
    max_logit: bool = False,
) -> dict[str, object]:
    """Run ``case`` on this rank's CP group through TE (``route``, :data:`ROUTES`), forward and backward.

    Returns {"case": asdict, "route", "calls": extension calls, "errors": {output: norm_err of the whole tensor}
    (on the CP group's first rank only)} or, when TE refuses it, {"case", "route", "refused": TE's message} (on
    every rank: TE asserts before any collective). ``device``: where TE runs (the CPU when None); the reference is
    computed on the CPU. ``max_logit``: TE's ``return_max_logit`` too (QK-clip's statistic), and on every rank
    "max_logit_error", the rel_err of this rank's max logit [h] against the fp64 max over the pairs the mask lets
    each head see (real tokens only)."""
    device = torch.device("cpu") if device is None else device
    rank = dist.get_rank() if rank is None else rank
    cp_group, cp_ranks, cp_rank = groups.of(case, rank)
    whole = groups.whole(case, rank)
    if case.qkv_format == "sbhd":
        tokens = 2 * case.cp * case.chunk
        q, k, v, dout = _inputs(case, tokens)
        bounds, thd = [], None

        def shard(x):
            return shard_sequence(x, cp_rank, case.cp).to(device, case.dtype).contiguous()

        cu = torch.arange(0, (case.batch + 1) * tokens, tokens, dtype=torch.int32, device=device)
        meta = dict(
            cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=tokens, max_seqlen_kv=tokens, cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None,
        )  # fmt: skip
    else:
        cu, cu_padded, source, local = thd_layout(te, case.documents, case.cp, cp_rank, device)
        _shard_thd_check(te, case, cu_padded, source, local, whole, device)
        q, k, v, dout = _inputs(case, int(cu[-1]))
        bounds, thd = cu.tolist(), (source, _gather(local, whole, device))

        def shard(x):
            padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[source]  # padding: the zero row
            return padded[local].to(device, case.dtype).contiguous()

        longest = max(int(b - a) for a, b in zip(cu_padded[:-1], cu_padded[1:]))
        cu_on, padded_on = cu.to(device), cu_padded.to(device)
        meta = dict(
            cu_seqlens_q=cu_on, cu_seqlens_kv=cu_on, max_seqlen_q=longest, max_seqlen_kv=longest,
            cu_seqlens_q_padded=padded_on, cu_seqlens_kv_padded=padded_on,
        )  # fmt: skip
    ql, kl, vl = (shard(x).requires_grad_(True) for x in (q, k, v))
    result: dict[str, object] = {"case": asdict(case) | {"dtype": str(case.dtype)}, "route": route}
    calls = getattr(te.extension, "calls", None)  # the CPU extension counts its calls
    if calls is not None:
        calls.clear()
    try:
        out = _call_te(te, case, route, ql, kl, vl, meta, cp_group, cp_ranks, max_logit)
    except AssertionError as error:  # TE's own refusal (raised on every rank before any collective)
        result["refused"] = str(error)
        return result
    if max_logit:
        out, got = out
        result["max_logit_error"] = rel_err(got.detach().cpu().double(), _reference_max_logit(case, q, k, bounds))
    out.backward(shard(dout))
    result["calls"] = dict(calls) if calls is not None else {"fused_attn_fwd": 1, "fused_attn_bwd": 1}
    wholes = [_whole(value, whole, thd, cp_rank) for value in (out, ql.grad, kl.grad, vl.grad)]
    if cp_rank == 0:  # the group's first rank measures (the others' shards gathered to it)
        expected = _reference(case, q, k, v, dout, bounds)
        result["errors"] = {name: norm_err(w, expected[name]) for name, w in zip(OUTPUTS, wholes)}
    return result


def _whole(local: torch.Tensor, group, thd, cp_rank: int) -> torch.Tensor | None:
    """The whole tensor on the group's first rank (None elsewhere): the CP group's shards gathered (THD: the real
    tokens only, each at its source token; ``thd`` = (source of each padded token, every CP rank's indices into the
    padded stream))."""
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))] if cp_rank == 0 else None
    dist.gather(local, parts, group_dst=0, group=group)
    if cp_rank != 0:
        return None
    parts = [p.cpu() for p in parts]
    if thd is None:
        return unshard_sequence(parts, seq_dim=0).double()
    source, indices = thd
    tokens = int((source >= 0).sum())
    whole = torch.zeros(tokens, *local.shape[1:], dtype=torch.float64)
    for part, index in zip(parts, indices):
        real = source[index] >= 0
        whole[source[index][real]] = part[real].double()
    return whole
