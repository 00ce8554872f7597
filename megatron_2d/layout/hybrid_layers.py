"""HybridModel layer patterns and what Megatron's Mamba and GDN context parallelism asks of the CP group.

Pure Python (the planner imports it without torch). A pattern (``--hybrid-layer-pattern``) has one symbol per
layer: ``M`` Mamba-2, ``G`` Gated DeltaNet, ``*`` attention, ``D`` DeepSeek sparse attention, ``+`` MLA, ``-`` MLP,
``E`` MoE; ``|`` separates pipeline segments and ``/`` starts the multi-token-prediction suffix (neither is a
decoder layer). Only ``*`` layers run 2D attention.

Mamba and GDN layers parallelise over the CP group with their own all-to-all (megatron-core's
``ssm/mamba_context_parallel.py`` and ``ssm/gated_delta_net``): every layer swaps its sequence shard for a head
shard over the *whole* CP group (hp x cp ranks), whatever the 2D split of the attention layers. So their heads
must divide over TP x CP, and they read tokens in Megatron's zigzag order (sbhd: 2*CP chunks; THD: each document
split in 2*CP chunks), which is the 2d backend's default layout and not its documents layout.
"""

from __future__ import annotations

from dataclasses import dataclass

MAMBA, GDN, ATTENTION = "M", "G", "*"
LAYER_SYMBOLS = frozenset("MG*D+-E")
SSM_SYMBOLS = frozenset((MAMBA, GDN))
PIPE, MTP_SEPARATOR = "|", "/"
MAMBA_EXPAND = 2
"""MambaMixer's default expand (d_inner = expand * hidden size) when mamba_num_heads is not given."""


def decoder_layers(pattern: str) -> str:
    """The decoder's layer symbols of ``pattern`` in order (pipeline separators and the MTP suffix dropped)."""
    main = pattern.split(MTP_SEPARATOR, 1)[0].replace(PIPE, "")
    unknown = sorted(set(main) - LAYER_SYMBOLS)
    if unknown or not main:
        raise ValueError(
            f"hybrid layer pattern {pattern!r} has {'symbols ' + str(unknown) if unknown else 'no layers'}"
            f"; layers are one of {''.join(sorted(LAYER_SYMBOLS))} ('|' between pipeline segments)"
        )
    return main


@dataclass(frozen=True)
class HybridLayerCounts:
    """How many layers of each family a pattern has."""

    attention: int
    mamba: int
    gdn: int
    total: int

    @classmethod
    def of(cls, pattern: str) -> HybridLayerCounts:
        layers = decoder_layers(pattern)
        return cls(layers.count(ATTENTION), layers.count(MAMBA), layers.count(GDN), len(layers))

    @property
    def ssm(self) -> int:
        return self.mamba + self.gdn


def mamba_num_heads(
    hidden_size: int, mamba_head_dim: int, mamba_num_heads_given: int | None = None, expand: int = MAMBA_EXPAND
) -> int:
    """MambaMixer's head count: mamba_num_heads, else expand * hidden_size // mamba_head_dim."""
    return mamba_num_heads_given if mamba_num_heads_given is not None else expand * hidden_size // mamba_head_dim


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mamba_cp_problem(num_heads: int, num_groups: int, tp: int, cp: int) -> str | None:
    """Why Megatron's Mamba context parallelism cannot run ``num_heads`` heads in ``num_groups`` groups over TP x
    CP, or None. Its rules: every CP rank gets whole heads (heads / TP divisible by CP), and B/C groups either
    split over CP (groups / TP divisible by CP) or are replicated (CP divisible by groups / TP)."""
    if cp == 1:
        return None
    heads_tp, groups_tp = num_heads // tp, num_groups // tp
    valid = [
        c
        for c in _divisors(max(heads_tp, 1))
        if heads_tp % c == 0 and (groups_tp % c == 0 if groups_tp >= c else c % max(groups_tp, 1) == 0)
    ]
    if heads_tp % cp:
        return (
            f"Mamba layers split their heads over the whole CP group: {num_heads} Mamba heads / TP {tp} = "
            f"{heads_tp} per TP rank do not divide by context_parallel_size {cp} (hp x cp); "
            f"CP sizes Mamba can run: {valid}"
        )
    if groups_tp == 0 or (groups_tp < cp and cp % groups_tp) or (groups_tp >= cp and groups_tp % cp):
        return (
            f"Mamba layers split or replicate their B/C groups over the whole CP group: mamba_num_groups "
            f"{num_groups} / TP {tp} = {groups_tp} per TP rank and context_parallel_size {cp} divide neither "
            f"way; CP sizes Mamba can run: {valid}"
        )
    return None


def gdn_cp_problem(num_key_heads: int, num_value_heads: int, tp: int, cp: int) -> str | None:
    """Why Megatron's Gated DeltaNet context parallelism cannot split its heads over TP x CP, or None (each CP rank
    takes whole key and value heads)."""
    if cp == 1:
        return None
    key_tp, value_tp = num_key_heads // tp, num_value_heads // tp
    if key_tp % cp or value_tp % cp:
        valid = [c for c in _divisors(max(key_tp, 1)) if value_tp % c == 0]
        return (
            f"GDN layers split their heads over the whole CP group: {num_key_heads} key / {num_value_heads} "
            f"value heads / TP {tp} = {key_tp} / {value_tp} per TP rank do not both divide by "
            f"context_parallel_size {cp} (hp x cp); CP sizes GDN can run: {valid}"
        )
    return None
