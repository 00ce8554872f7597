"""``TransformerConfig2D`` / ``MLATransformerConfig2D``: megatron-core's TransformerConfig and MLATransformerConfig
with the 2D context-parallel settings (one set of fields, :class:`Fields2D`, shared by both)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from ..deprecation import renamed_field
from ..layout.choices import CHECKPOINT_KEEPS, check_dkv_comm_dtype, check_packing_mode
from .attention_settings import check_attention_settings
from .checkpoint_plus import check_checkpoint_plus_config
from .mla import check_mla_settings
from .process_groups import group_registry
from .settings import layer_comm_types, settings_from_config, uses_2d


@dataclass
class Fields2D:
    """The 2D settings, mixed into megatron-core's config classes (see :class:`TransformerConfig2D`)."""

    cp_2d_head_parallel_size: int | None = None
    """hp: ranks per head group (all-to-all over heads). Must divide context_parallel_size and the heads per
    TP rank; K/V heads are replicated when hp exceeds them."""

    cp_2d_context_size: int | None = None
    """cp: ranks per context ring. Optional: derived as context_parallel_size / hp; if given, checked."""

    cp_2d_ring_window: int = 1
    """w: context ranks per inner ring (Double-Ring); cp / w windows form the outer ring. 1 = plain ring."""

    cp_2d_window_size: int | None = None
    """Deprecated name of cp_2d_ring_window (a DeprecationWarning; copied into it, and refused when both are set
    to different values)."""

    cp_2d_placement: str = "head_first"
    """"head_first" (head groups on adjacent ranks) or "context_first" (context rings on adjacent ranks)."""

    cp_2d_dkv_comm_dtype: str = "accumulator"
    """How dK/dV partials travel the ring in backward: "accumulator" (fp32, exact; the default) or "input" (the
    activation dtype, Transformer Engine's bytes; see megatron_2d.attention_2d for the measured error)."""

    cp_2d_packing: str = "zigzag"
    """How packed documents (THD batches) are laid out over the CP group: "zigzag" (Megatron's per-document
    split, what --sft batches get), "sequence" (Megatron's per-sequence split, what
    --dataloader-inter-document-masking batches get: chosen by itself in such a launch) or "documents" (short
    documents whole on one context rank; needs the data path of megatron_2d.megatron.packed_data, as
    examples/pretrain_gpt_2d.py uses). Unpacked batches ignore it."""

    selective_checkpoint_plus_plus: bool = False
    """Selective Checkpoint++: with full-layer recompute, keep each layer's attention output and log-sum-exp from
    the forward pass so the recompute pass skips the attention's kernels and ring traffic (what else is kept, and
    so which all-to-alls the recompute runs: ``selective_checkpoint_plus_plus_keep``)."""

    cp_2d_mla_ring: str = "expanded"
    """What travels the context ring under multi-latent attention (MLA): "expanded" (per-head K and V, as every
    CP backend sends them) or "latent" (the compressed KV after its layernorm and the rope key, up-projected by
    each rank for its own heads at every ring step: (heads per TP rank / hp) x (qk + v head dims) / (kv_lora_rank
    + rope dim) times fewer ring bytes, about 9x for DeepSeek-V3 at TP 8 and hp 1, for the repeated
    up-projection's FLOPs; see megatron_2d.megatron.mla)."""
    selective_checkpoint_plus_plus_check: str = "tolerance"
    """How Selective Checkpoint++ compares a recompute with its first pass: "tolerance" (the dtype's rounding
    noise allowed, as GPU recomputes through atomics give) or "bitwise" (a debug mode). Neither syncs the host."""
    selective_checkpoint_plus_plus_keep: str = CHECKPOINT_KEEPS[0]
    """What Selective Checkpoint++ keeps of attention until the recompute: "outputs" (the default, LoongTrain's:
    the attention output and its log-sum-exp; the recompute runs the head all-to-alls again, not the ring) or
    "attention-inputs" (also the head-layout q and K/V: the recompute sends nothing). See docs/memory.md."""

    def __post_init__(self) -> None:
        renamed_field(self, "cp_2d_window_size", "cp_2d_ring_window", default=1)
        super().__post_init__()
        group_registry(self)  # the model's 2D groups live here; Megatron's per-layer config copies share them
        if self.selective_checkpoint_plus_plus:
            problem = check_checkpoint_plus_config(self)
            if problem:
                raise ValueError(problem)
        else:
            unused = {
                name: getattr(self, name)
                for name, default in (
                    ("selective_checkpoint_plus_plus_check", "tolerance"),
                    ("selective_checkpoint_plus_plus_keep", CHECKPOINT_KEEPS[0]),
                )
                if getattr(self, name) != default
            }
            if unused:
                raise ValueError(
                    f"{unused} set without selective_checkpoint_plus_plus, so they would be ignored; set "
                    f"selective_checkpoint_plus_plus=True (--selective-checkpoint-plus-plus) or drop them"
                )
        if uses_2d(self.cp_comm_type):
            check_dkv_comm_dtype(self.cp_2d_dkv_comm_dtype, "cp_2d_dkv_comm_dtype")
            check_packing_mode(self.cp_2d_packing, "cp_2d_packing")
            check_mla_settings(self)
            settings_from_config(self)
            check_attention_settings(self)
            return
        given = {
            name: getattr(self, name)
            for name, default in (
                ("cp_2d_head_parallel_size", None),
                ("cp_2d_context_size", None),
                ("cp_2d_ring_window", 1),
                ("cp_2d_placement", "head_first"),
                ("cp_2d_dkv_comm_dtype", "accumulator"),
                ("cp_2d_packing", "zigzag"),
                ("cp_2d_mla_ring", "expanded"),
            )
            if getattr(self, name) != default
        }
        if given:
            raise ValueError(
                f"2D settings {given} are set but cp_comm_type is {layer_comm_types(self.cp_comm_type)}, "
                f"so they would be ignored; set cp_comm_type='2d' (--cp-comm-type 2d) or drop them"
            )


@dataclass
class TransformerConfig2D(Fields2D, TransformerConfig):
    """Select the backend with ``cp_comm_type="2d"`` (or a per-layer list containing "2d").

    Validated when built: hp x cp = context_parallel_size, hp divides the heads per TP rank, w divides cp, a
    known placement, and every attention setting honoured or refused (:mod:`.attention_settings`). 2D settings
    given without the "2d" backend are refused.
    """


@dataclass
class MLATransformerConfig2D(Fields2D, MLATransformerConfig):
    """:class:`TransformerConfig2D` for multi-latent attention (megatron-core's MLATransformerConfig): the same 2D
    settings and validation, and ``cp_2d_mla_ring`` to choose what travels the ring."""
