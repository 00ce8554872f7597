"""``latent_attention_2d``: multi-latent attention (MLA) whose context ring carries the latent, not per-head K/V.

MLA makes every head's key and value from one small per-token latent: k = [c W_k^h, k_rope], v = c W_v^h, with c the
compressed KV (kv_lora_rank wide, after its layernorm) and k_rope one rope key shared by all heads. Every CP backend
up-projects first and rings per-head K/V (heads x (dk + dv) values per token); here the ring carries
[c, k_rope] (kv_lora_rank + rope dim values per token) and each rank up-projects every block it receives with the
up-projection rows of its own heads (:class:`LatentExpander`, the ring's expander).

Notation
    hq  heads on this TP rank       hp, cp  head-parallel and context sizes      hl = hq / hp   heads of this rank
    dn  per-head key dim without rope (qk_head_dim)   dr  rope dim   dk = dn + dr   dv  value head dim
    r   kv_lora_rank       S  tokens of this context rank after the head all-to-all

    q [s_local, b, hq, dk]  --head all-to-all-->  [b, S, hl, dk]
    latent [s_local, b, r + dr]  --all-gather over the head group-->  block [b, S, r + dr]  (every head needs it)
    the ring moves blocks; at each step  k, v = expand(block, W[heads of this rank])  [b, keys, hl, dk | dv]
    out [b, S, hl, dv]  --inverse all-to-all-->  [s_local, b, hq, dv]
Backward sends d(block) home round the ring instead of dK/dV, sums the latent's gradient over the head group (the
all-gather's backward) and returns the weight gradient of this rank's heads from every block it saw; summed over the
CP group (as Megatron's gradient reduction does for a weight replicated over CP) it is the full gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import check_packed_query, check_query, check_sinks, group_max_logit, head_sinks
from .call.options import AttentionOptions
from .call.plan import prepare
from .groups import Groups2D
from .head_all_to_all import Direction, HeadAllGather, HeadAllToAll, HeadCall
from .layout.choices import DkvCommDtype
from .layout.heads import check_head_split
from .packed_sharding import PackedSharding
from .ring_attention import RingAttention, RingCall


@dataclass(frozen=True)
class LatentDims:
    """The head dims of MLA's up-projection: each head's rows of linear_kv_up_proj's weight are ``nope_dim`` rows of
    K (without RoPE, qk_head_dim), then ``value_dim`` rows of V (v_head_dim)."""

    nope_dim: int
    value_dim: int


class LatentExpander:
    """The ring's expander for MLA: a block [b, keys, r + dr] ([c, k_rope]) and this rank's up-projection weight
    [hl, dn + dv, r] -> (k [b, keys, hl, dn + dr], v [b, keys, hl, dv])."""

    def __init__(self, latent_dim: int, nope_dim: int, value_dim: int) -> None:
        self.latent_dim, self.nope_dim, self.value_dim = latent_dim, nope_dim, value_dim

    def __call__(self, block: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hl = weight.shape[0]
        c, k_rope = block[..., : self.latent_dim], block[..., self.latent_dim :]  # [b, keys, r | dr]
        kv = torch.matmul(c, weight.flatten(0, 1).t()).unflatten(-1, (hl, -1))  # [b, keys, hl, dn + dv]
        k = torch.cat([kv[..., : self.nope_dim], k_rope.unsqueeze(2).expand(-1, -1, hl, -1)], dim=-1)
        return k, kv[..., self.nope_dim :]

    def __repr__(self) -> str:
        return f"LatentExpander(r={self.latent_dim}, dn={self.nope_dim}, dv={self.value_dim})"


def _check_latent(q: torch.Tensor, latent: torch.Tensor, weight: torch.Tensor, nope_dim: int, value_dim: int) -> int:
    """Validate shapes (q [s, b, hq, dk], latent [s, b, r + dr], weight [hq * (dn + dv), r]); return r."""
    s, b, hq, dk = q.shape
    rope = dk - nope_dim
    if rope < 0 or nope_dim < 0 or value_dim < 1:
        raise ValueError(f"q's head dim {dk} must be qk_head_dim {nope_dim} plus the rope dim; value dim {value_dim}")
    if latent.dim() != 3 or latent.shape[:2] != (s, b) or latent.shape[2] <= rope:
        raise ValueError(
            f"latent must be [s, b, kv_lora_rank + rope dim {rope}] for q {tuple(q.shape)}, got {tuple(latent.shape)}"
        )
    r = latent.shape[2] - rope
    if weight.shape != (hq * (nope_dim + value_dim), r):
        raise ValueError(
            f"the up-projection weight must be [heads {hq} x (qk_head_dim {nope_dim} + v_head_dim "
            f"{value_dim}), kv_lora_rank {r}] = [{hq * (nope_dim + value_dim)}, {r}], got "
            f"{tuple(weight.shape)}"
        )
    if not (q.dtype == latent.dtype == weight.dtype) or not (q.device == latent.device == weight.device):
        raise ValueError(
            f"q, latent and weight must share dtype and device, got {q.dtype}/{latent.dtype}/"
            f"{weight.dtype} on {q.device}/{latent.device}/{weight.device}"
        )
    return r


def latent_attention_2d(
    q: torch.Tensor,
    latent: torch.Tensor,
    up_weight: torch.Tensor,
    groups: Groups2D,
    *,
    nope_dim: int,
    value_dim: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str | None = None,
    sliding_window: tuple[int, int] | None = (-1, -1),
    sinks: torch.Tensor | None = None,
    dkv_comm_dtype: str = DkvCommDtype.ACCUMULATOR,
    packing: PackedSharding | None = None,
    return_max_logit: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA's attention over the whole CP group with the latent on the ring (see the module docstring).

    Args:
        q: [s, b, hq, dn + dr] queries (RoPE applied to their last dr dims), zigzag-sharded like
            :func:`megatron_2d.attention_2d`'s (or [t_local, hq, dk] with ``packing``).
        latent: [s, b, r + dr] (or [t_local, r + dr]): the compressed KV after its layernorm, then the rope key
            after RoPE at the token's true position.
        up_weight: [hq * (dn + dv), r] the K/V up-projection weight of this TP rank's hq heads (Megatron's
            linear_kv_up_proj.weight: per head dn rows of K, then dv rows of V).
        nope_dim, value_dim: dn (qk_head_dim) and dv (v_head_dim).
        The other arguments are :func:`megatron_2d.attention_2d`'s; ``dkv_comm_dtype`` applies to d(latent);
            ``return_max_logit``: the max over q . k with each step's up-projected keys (k = [c W_k^h, k_rope]).
    Returns out [s, b, hq, dv] (or [t_local, hq, dv]) in q's dtype, and max_logit [hq] when ``return_max_logit``.
    """
    options = AttentionOptions(
        causal=causal,
        softmax_scale=softmax_scale,
        kernel=kernel,
        sliding_window=sliding_window,
        dkv_comm_dtype=dkv_comm_dtype,
        return_max_logit=return_max_logit,
    )
    dims = LatentDims(nope_dim, value_dim)
    return run_latent_attention_2d(q, latent, up_weight, groups, dims, options, sinks, packing)


def run_latent_attention_2d(
    q: torch.Tensor,
    latent: torch.Tensor,
    up_weight: torch.Tensor,
    groups: Groups2D,
    dims: LatentDims,
    options: AttentionOptions,
    sinks: torch.Tensor | None = None,
    packing: PackedSharding | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`latent_attention_2d` with its settings as one :class:`~megatron_2d.call.options.AttentionOptions` (see
    :func:`megatron_2d.attention.run_attention_2d`; ``options.kept`` keeps the gathered latent where attention_2d's
    keeps the K/V block)."""
    if packing is not None:
        check_packed_query(q, groups, packing)
        q, latent = q.unsqueeze(1), latent.unsqueeze(1)  # [t_local, 1, ...]
    else:
        check_query(q)
    latent_dim = _check_latent(q, latent, up_weight, dims.nope_dim, dims.value_dim)
    check_sinks(sinks, q)
    hq, hp = q.shape[2], groups.head_parallel_size
    check_head_split(hq, hp)
    plan = prepare(q, dims.value_dim, groups, options, packing)
    hl, head_rank, kept = hq // hp, groups.place.head_rank, options.kept
    weight = up_weight.view(hq, dims.nope_dim + dims.value_dim, latent_dim)[head_rank * hl : (head_rank + 1) * hl]
    head_call = HeadCall(plan.route, kept)
    (q,) = HeadAllToAll.apply(head_call, Direction.TO_HEADS, (1,), q)  # [b, S, hl, dk]
    block = HeadAllGather.apply(head_call, latent.contiguous())  # [b, S, r + dr]
    expander = LatentExpander(latent_dim, dims.nope_dim, dims.value_dim)
    ring = RingCall(plan.ring, kept, options.return_max_logit, expander)
    out, local_max = RingAttention.apply(q, block, head_sinks(sinks, groups, hq), ring, weight)
    (out,) = HeadAllToAll.apply(head_call, Direction.TO_TOKENS, None, out)  # [s, b, hq, dv]
    out = out.squeeze(1) if packing is not None else out
    return (out, group_max_logit(local_max, groups, hq, kept)) if options.return_max_logit else out
