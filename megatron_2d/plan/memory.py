"""Peak memory per GPU of one layout, in parts (activations per token and layer, logits, the attention's
transient buffers, model states), and what each activation recompute mode keeps of it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..layout.choices import RECOMPUTE_MODES, CheckpointKeep, MlaRing, RecomputeMode
from ..layout.heads import replicated_kv_heads
from ..layout.zero_sharding import HybridZeRO, state_bytes_per_rank
from .attention_time import BF16, FP32, layer_work
from .hardware import ModelSpec, ParallelSpec

if TYPE_CHECKING:
    from .packed import PackedWork

# RECOMPUTE_MODES (RecomputeMode's members, in order): activation recomputation: none; Megatron's selective
# recompute of core attention (--recompute-activations); Megatron's full-layer recompute (uniform, every layer);
# Selective Checkpoint++ (full recompute that keeps each layer's attention output + lse, and with "ckpt++inputs" its
# head-layout inputs: 2D only). See MemoryBreakdown and .step.recompute_extra_s.

CHECKPOINT_PLUS_MODES = {
    RecomputeMode.CKPT_PLUS: CheckpointKeep.OUTPUTS,
    RecomputeMode.CKPT_PLUS_INPUTS: CheckpointKeep.ATTENTION_INPUTS,
}
"""Selective Checkpoint++'s modes and the keep policy each runs (--selective-checkpoint-plus-plus-keep): "ckpt++"
keeps the attention output + lse ("outputs"), "ckpt++inputs" also the head-layout q/K/V ("attention-inputs")."""
LAYER_RECOMPUTE_MODES = (RecomputeMode.FULL, *CHECKPOINT_PLUS_MODES)
"""The modes that recompute whole layers, so can recompute some of them (--recompute-method block)."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak memory per GPU, in parts, from which every recompute mode's peak is derived (bytes).

    Activations are counted per local token (``tokens`` = B * S / CP) per layer, bf16, TP-sharded, and with
    sequence parallelism (``ParallelSpec.sequence_parallel``, on by default) the norm inputs and the linears' inputs
    sequence-sharded over TP too (SP = TP with it, 1 without). Parts of one layer (Korthikanti et al. 2022's
    34*s*b*h/TP per layer with SP, (10 + 24/TP)*s*b*h without, with flash attention; no dropout masks):

        layer_input  = 2 * D/SP                 the layer's input (first norm's input)
        dense_rest   = 2 * (3D/SP + (F' + F)/TP)  QKV-GEMM input, pre-MLP norm input, fc1 input (Megatron's linears
                                                save their input sequence-sharded under SP), fc1 output
                                                (F' = 2F gated, else F), fc2 input
        qkv          = 2 * (Ht*dk + L*(dk+dv))  q, k, v in the attention's layout (K/V after replication to L;
                                                the latent ring: Ht*dk + hp*(r + dr), the all-gathered latent)
        attn_out     = 2 * Ht * dv              the attention output as the kernel/ring keeps it
        o_proj_in    = 2 * Ht * dv              the output after the inverse all-to-all (o-proj input)
        lse          = 4 * Ht                   the softmax log-sum-exp (fp32)
        A_none       = the sum of all six

    1F1B keeps PP micro-batches of layers/PP layers on stage 0: ``layers`` layers' worth in all. Kept per token
    per layer, by recompute mode:

        none          A_none
        selective     A_none - attn_out - lse     Megatron's core-attention checkpoint re-saves q, k, v; flash
                                                  attention stores nothing quadratic, so only its output and lse
                                                  go (an upper bound on the saving: tools/memory_report.py
                                                  measures none on our op)
        full          layer_input                 only the checkpointed layer inputs
        ckpt++        layer_input + attn_out + lse        Selective Checkpoint++ keeping "outputs"
        ckpt++inputs  layer_input + qkv + attn_out + lse [+ o_proj_in]   keeping "attention-inputs": also the
                                                  head all-to-all's outputs, and the output after the inverse
                                                  exchange unless that is a view of the ring's (hp 1, one
                                                  sequence: ``out_view``)
                      (megatron_2d/kept_forward.py; tools/memory_report.py measures both within 2% of full +
                      these parts)

    and full / ckpt++ also hold one rebuilt layer (A_none) during its backward. With n of the layers recomputed
    (Megatron's --recompute-method block; n = layers for uniform) and the others kept whole:

        activations(mode, n) = tokens * (n * kept(mode) + (layers - n) * A_none + [n > 0, layer mode] * A_none)
        total(mode, n)       = activations(mode, n) + logits + comm_buffers + model_states
    """

    tokens: float
    layers: int
    layer_input: float
    dense_rest: float
    qkv: float
    attn_out: float
    o_proj_in: float
    lse: float
    logits: float
    """fp32 logits of the local tokens: 4 * tokens * V/TP."""
    comm_buffers: float
    """One layer's transient attention buffers: two K/V and two dK/dV blocks in flight (plus one of each for the
    outer ring when there are both an inner and an outer ring, 1 < w < cp) and one all-to-all staging copy of q,
    k, v, out."""
    model_states: float
    """bf16 weights + fp32 gradients of N/(TP*PP) parameters, and fp32 master weights + Adam moments (12 bytes
    per parameter) sharded over DP x CP (Megatron's distributed optimizer: megatron_2d.layout.zero_sharding's
    state_bytes_per_rank, the library's own count); a memory option (:mod:`.memory_options`) replaces it."""
    sharded_states: float = 0.0
    """The part of ``model_states`` sharded over DP x CP (the optimizer's 12 bytes per parameter)."""
    out_view: bool = False
    """The output after the inverse exchange is a view of the ring's (hp 1 and one sequence per micro-batch)."""

    @property
    def per_token_none(self) -> float:
        """A_none: every part of one layer, bytes per token."""
        return self.layer_input + self.dense_rest + self.qkv + self.attn_out + self.o_proj_in + self.lse

    def kept_per_token(self, mode: str) -> float:
        """Bytes per token per layer kept for backward under recompute ``mode``."""
        if mode == RecomputeMode.NONE:
            return self.per_token_none
        if mode == RecomputeMode.SELECTIVE:
            return self.per_token_none - self.attn_out - self.lse
        if mode == RecomputeMode.FULL:
            return self.layer_input
        if mode == RecomputeMode.CKPT_PLUS:
            return self.layer_input + self.attn_out + self.lse
        if mode == RecomputeMode.CKPT_PLUS_INPUTS:
            return self.layer_input + self.qkv + self.attn_out + self.lse + (0.0 if self.out_view else self.o_proj_in)
        raise ValueError(f"recompute mode {mode!r} is not one of {RECOMPUTE_MODES}")

    def activations(self, mode: str = RecomputeMode.NONE, n: int | None = None) -> float:
        """Activation bytes with ``n`` layers recomputed under ``mode`` (None: all of them)."""
        n = self.layers if n is None or mode == RecomputeMode.NONE else n
        rebuilt = self.per_token_none if mode in LAYER_RECOMPUTE_MODES and n > 0 else 0.0
        return self.tokens * (n * self.kept_per_token(mode) + (self.layers - n) * self.per_token_none + rebuilt)

    def total(self, mode: str = RecomputeMode.NONE, n: int | None = None) -> float:
        return self.activations(mode, n) + self.logits + self.comm_buffers + self.model_states

    def layers_to_fit(self, mode: str, budget_bytes: float, step: int = 1) -> int | None:
        """The fewest recomputed layers (a multiple of ``step``, e.g. PP for per-stage block recompute) with which
        ``total(mode, n)`` fits ``budget_bytes``; None when even all layers do not fit."""
        # total(mode, n) for n >= 1 is linear in n: total(mode, 1) - (n - 1) * tokens * (A_none - kept)
        first = self.total(mode, step)
        if first <= budget_bytes:
            return step
        saved = self.tokens * (self.per_token_none - self.kept_per_token(mode))
        if saved <= 0:
            return None
        n = step + step * math.ceil((first - budget_bytes) / (saved * step) - 1e-12)
        while n - step >= step and self.total(mode, n - step) <= budget_bytes:  # guard rounding
            n -= step
        while n <= self.layers and self.total(mode, n) > budget_bytes:
            n += step
        return n if n <= self.layers else None


def memory_breakdown(
    model: ModelSpec,
    parallel: ParallelSpec,
    hp: int,
    cp: int,
    w: int,
    seq: int,
    dkv_bytes_per_elem: int = FP32,
    kv_heads: int | None = None,
    mla_ring: str | None = None,
    packed: PackedWork | None = None,
) -> MemoryBreakdown:
    """The :class:`MemoryBreakdown` of one layout (``kv_heads``, ``dkv_bytes_per_elem``, ``mla_ring``: as
    :func:`.attention_time.layer_work`; the latent ring keeps the all-gathered latent, hp * (r + dr) per local
    token, for K/V).

    ``packed``: a packed batch; every per-token part counts the slots a rank really holds (its real tokens and its
    padding: ``token_fraction`` * S / CP), and the ring's blocks in flight hold the ring prefix (or, with the
    neighbour exchange, the busiest rank's messages)."""
    B, tp, D, F = parallel.micro_batch, parallel.tp, model.hidden, model.ffn_hidden
    sp = tp if parallel.sequence_parallel else 1
    dk, dv = model.qk_dim, model.v_dim
    CP = hp * cp
    Ht, Hkvt = model.heads // tp, model.kv_heads // tp
    L = replicated_kv_heads(Hkvt, hp) if kv_heads is None else kv_heads
    kv_per_token = hp * model.mla.latent_width if mla_ring == MlaRing.LATENT else L * (dk + dv)
    tokens = B * seq / CP * (1.0 if packed is None else packed.token_fraction)
    fc1_out = (2 if model.gated_mlp else 1) * F
    work = layer_work(
        model, parallel, hp, cp, seq, dkv_bytes_per_elem=dkv_bytes_per_elem, kv_heads=kv_heads, mla_ring=mla_ring
    )
    nw = cp // w
    blocks = (2 + (1 if nw > 1 and w > 1 else 0)) * (work.kv_bytes + work.dkv_bytes) if cp > 1 else 0.0
    if packed is not None:  # the ring prefix, or two neighbour messages (K/V + dK/dV) in flight
        prefix = packed.ring_fraction if packed.dense else packed.key_tokens / max(packed.messages, 1) / (seq / cp)
        blocks *= prefix if packed.ring_tokens else 0.0
    staging = BF16 * tokens * (Ht * (dk + dv) + kv_per_token) if hp > 1 else 0.0
    states = state_bytes_per_rank(
        -(-model.total_params() // (tp * parallel.pp)),
        HybridZeRO("optimizer"),
        parallel.dp_size,
        CP,
        param_bytes=BF16,
        grad_bytes=FP32,
    )
    return MemoryBreakdown(
        tokens=tokens,
        layers=model.layers,
        layer_input=BF16 * D / sp,
        dense_rest=BF16 * (3 * D / sp + (fc1_out + F) / tp),
        qkv=BF16 * (Ht * dk + kv_per_token),
        attn_out=BF16 * Ht * dv,
        o_proj_in=BF16 * Ht * dv,
        lse=FP32 * Ht,
        logits=FP32 * tokens * model.vocab / tp,
        comm_buffers=blocks + staging,
        model_states=float(sum(states.values())),
        sharded_states=float(states["optimizer"]),
        out_view=hp == 1 and B == 1,
    )


def memory_bytes(
    model: ModelSpec,
    parallel: ParallelSpec,
    hp: int,
    cp: int,
    w: int,
    seq: int,
    recompute: str = RecomputeMode.NONE,
    dkv_bytes_per_elem: int = FP32,
    kv_heads: int | None = None,
    mla_ring: str | None = None,
) -> tuple[float, float]:
    """(total, activations) bytes per GPU under ``recompute`` (see :class:`MemoryBreakdown` for what is counted)."""
    mb = memory_breakdown(model, parallel, hp, cp, w, seq, dkv_bytes_per_elem, kv_heads, mla_ring)
    return mb.total(recompute), mb.activations(recompute)
